"""Mutation audit of the newest tests (QA pass 12, honest tests): each test here kills a plausible bug the
tests of the covered module let through, checked from first principles."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from eaglenest.config import apply_overrides
from eaglenest.errors import ConfigError
from eaglenest.train.dist import RankEnv, rank_env


def test_a_mapping_override_merges_below_the_first_level_too():
    # "a mapping merges key by key, at any depth": a merge of one level only (`{**old, **new}`) passed every
    # test, which nests two levels at most; three levels down the sibling key must still be kept.
    data = {"ingest": {"chat_template_kwargs": {"opts": {"depth": {"a": 1, "b": 2}, "keep": True}}}}
    out = apply_overrides(data, ["ingest={chat_template_kwargs: {opts: {depth: {a: 5}}}}"])
    assert out == {"ingest": {"chat_template_kwargs": {"opts": {"depth": {"a": 5, "b": 2}, "keep": True}}}}
    # the dotted form of the same override gives the same result
    assert apply_overrides(data, ["ingest.chat_template_kwargs.opts.depth.a=5"]) == out


@pytest.mark.parametrize("values, names", [
    ({"WORLD_SIZE": "2", "RANK": "2"}, "RANK=2 in the environment is not below WORLD_SIZE=2"),
    ({"WORLD_SIZE": "1", "RANK": "1"}, "RANK=1 in the environment is not below WORLD_SIZE=1"),
    ({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "2"}, "LOCAL_RANK=2"),
    ({"WORLD_SIZE": "4", "RANK": "0", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, "LOCAL_RANK=2"),
])
def test_a_rank_equal_to_its_size_is_refused(monkeypatch, values, names):
    # ranks count from 0: RANK=WORLD_SIZE is one past the last rank. Only RANK=5 of 2 was tested, so `>` for
    # `>=` passed (and asked for a rendezvous that never completes).
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as exc:
        rank_env()
    assert names in str(exc.value) and "\n" not in str(exc.value)


def test_the_last_rank_is_accepted(monkeypatch):
    for name, value in {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    assert rank_env() == RankEnv(rank=1, world_size=2, local_rank=1, local_world_size=2)


def test_a_caller_with_its_own_argv_gets_its_ctrl_c_back(tmp_path):
    # The guard ends the process only for a console script run as a program; a library caller that gave an
    # argv (a notebook cell, a workflow step) gets KeyboardInterrupt to handle. Dropping the `argv is not None`
    # test passed the qa12 tests and killed such a caller's process. A subprocess: that would end pytest too.
    (tmp_path / "qa12_interrupted_cli.py").write_text("raise KeyboardInterrupt\n")
    code = textwrap.dedent("""
        from eaglenest.entry import enter
        try:
            enter("mytool", "qa12_interrupted_cli", ["go"])
        except KeyboardInterrupt:
            print("caught", flush=True)
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "caught\n", ""), proc
