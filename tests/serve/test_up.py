"""``serve up`` listens where vLLM users expect: serve.host:serve.port (default 127.0.0.1:8000),
under the target's own model name (or serve.served_model_name); a busy port is one clear error."""

from __future__ import annotations

import json
import shutil
import socket

import pytest

from eaglenest.errors import ConfigError, EaglenestError
from eaglenest.recipe import load_recipe
from eaglenest.serve.commands import up_server


def _argv_value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_defaults_are_vllm_serves(tmp_path):
    recipe = load_recipe("recipes/toy.yaml", [f"run.workdir={tmp_path}"])
    assert (recipe.serve.host, recipe.serve.port, recipe.serve.served_model_name) == ("127.0.0.1", 8000, "")
    # The name defaults to the target's own (what `vllm serve <model>` answers to).
    port = _free_port()  # the default 8000 may be taken on a shared machine: same code path otherwise
    recipe = load_recipe("recipes/toy.yaml", [f"run.workdir={tmp_path}", f"serve.port={port}"])
    server = up_server(recipe, no_spec=True)
    assert (_argv_value(server.argv, "--host"), _argv_value(server.argv, "--port")) == ("127.0.0.1", str(port))
    assert _argv_value(server.argv, "--served-model-name") == "assets/tiny-target" == server.served_name
    assert server.url == f"http://127.0.0.1:{port}"


def test_host_port_and_name_from_the_recipe(tmp_path):
    port = _free_port()
    recipe = load_recipe("recipes/toy.yaml", [f"run.workdir={tmp_path}", f"serve.port={port}",
                                              "serve.host=0.0.0.0", "serve.served_model_name=my-model"])
    server = up_server(recipe, no_spec=True)
    assert (_argv_value(server.argv, "--host"), _argv_value(server.argv, "--port")) == ("0.0.0.0", str(port))
    assert _argv_value(server.argv, "--served-model-name") == "my-model"
    assert server.url == f"http://127.0.0.1:{port}"


def test_busy_port_names_the_key(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        recipe = load_recipe("recipes/toy.yaml", [f"run.workdir={tmp_path}", f"serve.port={port}"])
        with pytest.raises(EaglenestError, match=r"serve.port: cannot listen on 127.0.0.1:\d+"):
            up_server(recipe, no_spec=True)
    recipe = load_recipe("recipes/toy.yaml", [f"run.workdir={tmp_path}", "serve.port=0"])
    assert up_server(recipe, no_spec=True).port > 0  # 0: any free port


@pytest.mark.parametrize("rope, refused", [({"rope_theta": 10000.0, "rope_type": "default"}, True),
                                           # YaRN's max_position_embeddings is already the scaled length: vLLM
                                           # refuses 65 (its _get_and_verify_max_len applies no factor to it)
                                           ({"rope_theta": 10000.0, "rope_type": "yarn", "factor": 4.0,
                                             "original_max_position_embeddings": 16}, True),
                                           ({"rope_theta": 10000.0, "rope_type": "linear", "factor": 2.0}, False)])
def test_max_model_len_past_the_targets_positions_is_refused_before_a_server_starts(tmp_path, tiny_target,
                                                                                     rope, refused):
    target = tmp_path / "target"
    shutil.copytree(tiny_target, target)
    cfg = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 64, "rope_parameters": rope}))
    recipe = load_recipe("recipes/toy.yaml", [f"run.workdir={tmp_path}", f"run.target={target}", "serve.port=0",
                                              "serve.max_model_len=65"])
    if refused:
        with pytest.raises(ConfigError, match=r"serve.max_model_len: 65 is more than .*target has positions for "
                                              r"\(max_position_embeddings=64\); set serve.max_model_len=64 or less"):
            up_server(recipe, no_spec=True)
    else:  # a linear rotary of factor 2: vLLM allows 128
        assert _argv_value(up_server(recipe, no_spec=True).argv, "--max-model-len") == "65"
    ok = load_recipe("recipes/toy.yaml", [f"run.workdir={tmp_path}", f"run.target={target}", "serve.port=0",
                                          "serve.max_model_len=64"])
    assert _argv_value(up_server(ok, no_spec=True).argv, "--max-model-len") == "64"
