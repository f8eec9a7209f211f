"""torchrun's variables in the environment that cannot be torchrun's (QA pass 12).

``WORLD_SIZE=""`` (an exported but empty variable), ``RANK=x``, ``LOCAL_RANK=-1`` under torchrun's
variables, or ``WORLD_SIZE=2 RANK=5`` (a job script's leftovers) ended ``train run`` with a bare ``int()``
ValueError traceback, or went on wrongly (``RANK=5`` of 2 asked for a rendezvous that never completes). Now
one line naming the variable, exit 2, nothing written; a plain process keeps ignoring ``LOCAL_RANK=-1``
(other launchers' "not distributed").
"""

from __future__ import annotations

import pytest

from eaglenest.errors import ConfigError
from eaglenest.pipeline import train_cli
from eaglenest.train.dist import RankEnv, rank_env

_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def env(monkeypatch):
    for name in _VARS:
        monkeypatch.delenv(name, raising=False)

    def set_env(**values):
        for name, value in values.items():
            monkeypatch.setenv(name, value)
    return set_env


@pytest.mark.parametrize("values, names", [
    ({"WORLD_SIZE": ""}, "WORLD_SIZE=''"),
    ({"WORLD_SIZE": "2", "RANK": "x"}, "RANK='x'"),
    ({"RANK": "x"}, "RANK='x'"),
    ({"WORLD_SIZE": "0", "RANK": "0"}, "WORLD_SIZE='0'"),
    ({"WORLD_SIZE": "2", "RANK": "-1"}, "RANK='-1'"),
    ({"WORLD_SIZE": "2", "RANK": "5"}, "RANK=5 in the environment is not below WORLD_SIZE=2"),
    ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "-1"}, "LOCAL_RANK='-1'"),
    ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "2"}, "LOCAL_RANK=2 in the environment is not below WORLD_SIZE=2"),
    ({"WORLD_SIZE": "4", "RANK": "0", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "1"}, "LOCAL_RANK=1"),
    ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_WORLD_SIZE": "3"}, "LOCAL_WORLD_SIZE=3"),
])
def test_a_value_torchrun_cannot_have_set_names_the_variable(env, values, names):
    env(**values)
    with pytest.raises(ConfigError) as exc:
        rank_env()
    assert names in str(exc.value) and "\n" not in str(exc.value)


def test_torchrun_values_and_a_plain_process(env):
    assert rank_env() == RankEnv(rank=0, world_size=1)
    env(LOCAL_RANK="-1")  # a plain process: other launchers' "not distributed", not read
    assert rank_env() == RankEnv(rank=0, world_size=1)
    env(WORLD_SIZE="4")  # one of the two alone: read as it is (the trainer joins no process group without both)
    assert rank_env() == RankEnv(rank=0, world_size=4)
    env(WORLD_SIZE=" 4 ", RANK="3", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2")
    assert rank_env() == RankEnv(rank=3, world_size=4, local_rank=1, local_world_size=2)


@pytest.mark.parametrize("values, name", [
    ({"WORLD_SIZE": ""}, "WORLD_SIZE"),
    ({"WORLD_SIZE": "2", "RANK": "x"}, "RANK"),
    ({"WORLD_SIZE": "2", "RANK": "5"}, "RANK"),
])
def test_train_run_refuses_in_one_line_and_writes_nothing(root, tmp_path, capsys, env, values, name):
    env(**values)
    work = tmp_path / "work"
    rc = train_cli.main(["run", "--recipe", str(root / "recipes" / "toy.yaml"), f"run.workdir={work}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith(f"train: error: {name}="), err
    assert not work.exists()
