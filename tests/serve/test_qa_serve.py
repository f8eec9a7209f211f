"""``serve up`` and ``train run`` QA repros, all refused before an engine starts (none starts here).
Before each fix:

* ``serve.host=::1`` (an IPv6 address vLLM listens on) was refused as "port in use", or with
  ``serve.port=0`` a traceback (``gaierror``), as was a host name that does not resolve;
* a draft whose weights are missing or truncated, whose ``d2t`` / ``t2d`` has the wrong length or
  maps outside the target's vocabulary, or that was exported for another target, reached vLLM:
  a traceback in its log after 20-60 s, or (``d2t`` missing, out of range) a draft served wrongly;
* ``train run`` with a target config lacking ``hidden_size`` or holding text sizes: a traceback
  from the memory check (pipeline/commands.py ``check_fit``).
"""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from eaglenest.errors import ConfigError, EaglenestError
from eaglenest.recipe import load_recipe
from eaglenest.serve.cli import main as serve_main
from eaglenest.serve.commands import up_server


def _recipe(root, work, *overrides):
    return load_recipe(root / "recipes" / "toy.yaml", [f"run.workdir={work}", "serve.port=0", *overrides])


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback on this machine")
def test_an_ipv6_host_is_served(tmp_path, root):
    server = up_server(_recipe(root, tmp_path, "serve.host=::1"), no_spec=True)
    assert server.port > 0 and server.url == f"http://[::1]:{server.port}"
    assert server.argv[server.argv.index("--host") + 1] == "::1"
    with socket.socket(socket.AF_INET6) as busy:  # and a busy IPv6 port is refused by its own words
        busy.bind(("::1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(EaglenestError, match=rf"serve.port: cannot listen on \[::1\]:{port} "):
            up_server(_recipe(root, tmp_path, "serve.host=::1", f"serve.port={port}"), no_spec=True)


def test_a_host_that_does_not_resolve_is_one_line(capsys, tmp_path, root):
    code = serve_main(["up", f"--recipe={root / 'recipes' / 'toy.yaml'}", f"run.workdir={tmp_path}", "--no-spec",
                       "serve.port=0", "serve.host=no-such-host.invalid"])
    assert code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    assert lines[0].startswith("serve: error: serve.host: cannot listen on 'no-such-host.invalid'"), lines[0]


def _weights(edit):
    def damage(draft: Path) -> None:
        path = draft / "model.safetensors"
        save_file(edit(load_file(str(path))), str(path))
    return damage


def _config(**changes):
    def damage(draft: Path) -> None:
        path = draft / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return damage


DAMAGE = [
    (lambda d: (d / "model.safetensors").unlink(), "draft/model.safetensors: missing"),
    (lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:4000]),
     "draft/model.safetensors: unreadable"),
    (_weights(lambda st: {**st, "d2t": st["d2t"][:10]}),
     "draft/model.safetensors: d2t is [10], config.json's draft_vocab_size makes it [1024]"),
    (_weights(lambda st: {**st, "t2d": np.ones(4096, dtype=bool)}),
     "draft/model.safetensors: t2d is [4096], config.json's vocab_size makes it [2048]"),
    (_weights(lambda st: {**st, "d2t": st["d2t"] + 5000}),
     "draft/model.safetensors: d2t maps draft id 0 to target id 5000, outside the target's vocabulary 0..2047"),
    (_weights(lambda st: {k: v for k, v in st.items() if k != "d2t"}),
     "draft/model.safetensors: no d2t tensor for a draft vocabulary of 1024 of 2048 target ids"),
    (_config(vocab_size=4096, draft_vocab_size=1024),
     "draft/config.json: a draft for a target with vocab_size 4096, run.target has 2048"),
    (_config(target_hidden_size=256),
     "draft/config.json: a draft for a target with hidden_size 256, run.target has 128"),
    (_config(draft_vocab_size="all"), "draft/config.json: draft_vocab_size: a positive integer, got all"),
]


@pytest.mark.parametrize("damage, says", DAMAGE, ids=["no-weights", "truncated", "short-d2t", "long-t2d",
                                                      "d2t-range", "no-d2t", "other-vocab", "other-hidden",
                                                      "text-draft-vocab"])
def test_a_draft_vllm_would_fail_on_is_refused_before_it_starts(capsys, tmp_path, root, toy_export, damage, says):
    shutil.copytree(toy_export, tmp_path / "draft")
    damage(tmp_path / "draft")
    before = {p.name: p.read_bytes() for p in (tmp_path / "draft").iterdir()}
    code = serve_main(["up", f"--recipe={root / 'recipes' / 'toy.yaml'}", f"run.workdir={tmp_path}",
                       "serve.port=0", "--for-seconds=1"])
    assert code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    assert lines[0].startswith("serve: error: ") and f"{tmp_path}/{says}" in lines[0], lines[0]
    assert {p.name: p.read_bytes() for p in (tmp_path / "draft").iterdir()} == before
    assert not (tmp_path / "serve").exists()  # refused before the server's log was opened


def test_an_intact_draft_passes_the_check(tmp_path, root, toy_export):
    shutil.copytree(toy_export, tmp_path / "draft")
    server = up_server(_recipe(root, tmp_path))
    assert json.loads(server.argv[server.argv.index("--speculative-config") + 1])["model"] == str(tmp_path / "draft")


@pytest.mark.parametrize("changes, says", [
    ({"hidden_size": None}, "hidden_size: a positive integer, got None"),
    ({"num_attention_heads": 0}, "num_attention_heads: a positive integer, got 0"),
    ({"vocab_size": "big"}, "vocab_size: an integer >= 0 or null, got 'big'"),
    ({"intermediate_size": 1.5}, "intermediate_size: an integer >= 0 or null, got 1.5"),
], ids=["no-hidden", "zero-heads", "text-vocab", "float-mlp"])
def test_train_run_target_sizes_are_one_line(tmp_path, root, tiny_target, changes, says):
    from eaglenest.pipeline.commands import check_fit

    target = tmp_path / "target"
    target.mkdir()
    cfg = {**json.loads((tiny_target / "config.json").read_text()), **changes}
    (target / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    recipe = load_recipe(root / "recipes" / "toy.yaml", [f"run.workdir={tmp_path / 'w'}", f"run.target={target}"])
    with pytest.raises(ConfigError) as err:
        check_fit(recipe)
    assert str(err.value) == f"run.target: {target}/config.json: {says}"


@pytest.mark.parametrize("args, says", [
    (["--num-prompts", "0"], "--num-prompts: at least 1, got 0"),
    (["--num-spec", "-1"], "--num-spec: at least 1, got -1"),
    (["--max-tokens", "0"], "--max-tokens: at least 1, got 0"),
], ids=["no-prompts", "negative-k", "no-tokens"])
def test_draft_check_refuses_a_check_of_nothing(capsys, tmp_path, tiny_target, toy_export, args, says):
    """``python -m eaglenest.serve.draft_check``: zero prompts would start two engines and report the
    draft lossless (0 of 0 outputs identical); a K < 1 reached vLLM (a traceback)."""
    from eaglenest.serve.draft_check import main

    assert main([str(tiny_target), str(toy_export), "--prompts-from", str(tmp_path / "store"), *args]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"draft_check: error: {says}"]


def test_draft_check_refuses_a_damaged_draft_before_reading_the_store(capsys, tmp_path, tiny_target, toy_export):
    from eaglenest.serve.draft_check import main

    shutil.copytree(toy_export, tmp_path / "draft")
    _weights(lambda st: {**st, "d2t": st["d2t"] + 5000})(tmp_path / "draft")
    store = tmp_path / "no-store-here"
    assert main([str(tiny_target), str(tmp_path / "draft"), "--prompts-from", str(store)]) == 2
    line, = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"draft_check: error: {tmp_path}/draft/model.safetensors: d2t maps draft id 0"), line
    assert main([str(tiny_target), str(tmp_path / "none"), "--prompts-from", str(store)]) == 2
    assert capsys.readouterr().err.strip() == (f"draft_check: error: no exported draft at {tmp_path}/none: "
                                               "run `serve export` first")


def test_no_spec_reads_no_draft_config(tmp_path, root, tiny_target, monkeypatch):
    """``serve up --no-spec`` looked for the draft's K in ``./config.json`` (the draft path was ""), so a
    damaged config.json in the current folder refused a server that serves no draft."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.json").write_text("[not json")
    recipe = load_recipe(root / "recipes" / "toy.yaml", [f"run.workdir={tmp_path / 'w'}", f"run.target={tiny_target}",
                                                         "serve.port=0"])
    server = up_server(recipe, no_spec=True)
    assert "--speculative-config" not in server.argv and server.served_name == str(tiny_target)


@pytest.mark.parametrize("damage, says", DAMAGE[:6], ids=["no-weights", "truncated", "short-d2t", "long-t2d",
                                                          "d2t-range", "no-d2t"])
def test_push_refuses_a_draft_vllm_cannot_load(capsys, monkeypatch, tmp_path, root, toy_export, damage, says):
    """``serve push`` checked only that config.json exists: a draft without its weights (or with a
    broken vocabulary map) went to the Hub. Refused before the token is looked up or the Hub reached."""
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # no saved login either
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: a request would fail
    shutil.copytree(toy_export, tmp_path / "draft")
    damage(tmp_path / "draft")
    code = serve_main(["push", f"--recipe={root / 'recipes' / 'toy.yaml'}", f"run.workdir={tmp_path}",
                       f"ingest.manifest={root / 'recipes' / 'manifests' / 'toy.yaml'}", "serve.hub_repo_id=me/x"])
    assert code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"{tmp_path}/{says}" in lines[0], lines


@pytest.mark.parametrize("seconds", ["-5", "nan"])
def test_up_for_negative_seconds_is_refused_before_a_server_starts(capsys, tmp_path, root, seconds):
    """``--for-seconds -5`` (or nan) started vLLM, waited for it, and stopped it at once, exit 0."""
    code = serve_main(["up", f"--recipe={root / 'recipes' / 'toy.yaml'}", f"run.workdir={tmp_path}", "--no-spec",
                       "serve.port=0", f"--for-seconds={seconds}"])
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"serve: error: --for-seconds: seconds >= 0 (0: until Ctrl-C), got {float(seconds)}"]
    assert not (tmp_path / "serve").exists()  # no server log: none started


def _speculators(draft: Path) -> None:
    """The draft re-exported in speculators' format (its checkpoint recorded in provenance.json)."""
    from eaglenest.serve.export import export_draft

    ckpt = json.loads((draft / "provenance.json").read_text())["inputs"]
    export_draft(ckpt["checkpoint"], draft, target_dir=ckpt["target"], format="speculators")


def _then(*steps):
    def damage(draft: Path) -> None:
        for step in steps:
            step(draft)
    return damage


def _proposal(**changes):
    def damage(draft: Path) -> None:
        path = draft / "config.json"
        cfg = json.loads(path.read_text())
        cfg["speculators_config"]["proposal_methods"][0].update(changes)
        path.write_text(json.dumps(cfg))
    return damage


CONFIG_DAMAGE = [
    (_config(recommended_num_speculative_tokens=True), "recommended_num_speculative_tokens: a positive integer, "
                                                        "got True"),
    (_config(recommended_num_speculative_tokens="3"), "recommended_num_speculative_tokens: a positive integer, "
                                                       "got '3'"),
    (_config(trained_num_speculative_tokens=0), "trained_num_speculative_tokens: a positive integer, got 0"),
    (_config(eagle_aux_hidden_state_layer_ids=[2, 40, 5]),
     "eagle_aux_hidden_state_layer_ids: the draft reads aux layers [40], run.target has 8 layers "
     "(vLLM ids 0..7)"),
    (_config(eagle_aux_hidden_state_layer_ids="2,4,5"),
     "eagle_aux_hidden_state_layer_ids: a list of layer ids, got '2,4,5'"),
    (_config(architectures="LlamaForCausalLMEagle3"),
     "architectures: a list of model class names, got 'LlamaForCausalLMEagle3'"),
    (_config(architectures=None), "architectures: a list of model class names, got None"),
    (_config(parallel_drafting=True),
     "mask_token_id: a token id of the target's vocabulary (0..2047) for a peagle draft, got None"),
    (_then(_speculators, _config(speculators_config="greedy")),
     "speculators_config.proposal_methods: a list of objects, got None"),
    (_then(_speculators, _proposal(speculative_tokens=-2)),
     "speculators_config.proposal_methods[0].speculative_tokens: a positive integer, got -2"),
]


@pytest.mark.parametrize("damage, says", CONFIG_DAMAGE, ids=[
    "k-bool", "k-text", "trained-k-zero", "aux-past-target", "aux-text", "arch-text", "no-arch", "peagle-no-mask",
    "speculators-text", "speculators-k"])
def test_a_draft_config_vllm_would_reject_is_refused_before_it_starts(tmp_path, root, toy_export, damage, says):
    """Before: a config.json key serving reads, damaged, reached vLLM (its traceback 20-60 s later, or a
    request failing mid-way: aux layers past the target's), was served at another K (``true`` read as
    K=1, text ignored), or (speculators_config not an object) was an AttributeError traceback."""
    shutil.copytree(toy_export, tmp_path / "draft")
    damage(tmp_path / "draft")
    with pytest.raises(ConfigError) as err:
        up_server(_recipe(root, tmp_path))
    assert str(err.value).startswith(f"{tmp_path}/draft/config.json: {says}; "), str(err.value)
    assert not (tmp_path / "serve").exists()


def test_a_speculators_config_that_is_not_an_object_is_one_line(capsys, monkeypatch, tmp_path, root, toy_export):
    from eaglenest.serve.server import Server

    monkeypatch.setattr(Server, "start", lambda self: pytest.fail("a server was started"))  # none may start
    shutil.copytree(toy_export, tmp_path / "draft")
    _then(_speculators, _config(speculators_config="greedy"))(tmp_path / "draft")
    code = serve_main(["up", f"--recipe={root / 'recipes' / 'toy.yaml'}", f"run.workdir={tmp_path}",
                       "serve.port=0", "--for-seconds=1"])
    assert code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"serve: error: {tmp_path}/draft/config.json: speculators_config.proposal_methods: a list of "
                     "objects, got None; export the draft again (`serve export`)"], lines


def test_an_intact_speculators_draft_passes_the_check(tmp_path, root, toy_export):
    shutil.copytree(toy_export, tmp_path / "draft")
    _speculators(tmp_path / "draft")
    server = up_server(_recipe(root, tmp_path))
    spec = json.loads(server.argv[server.argv.index("--speculative-config") + 1])
    assert spec["model"] == str(tmp_path / "draft") and spec["num_speculative_tokens"] == 3


@pytest.mark.parametrize("k, length, most", [(1000000, 2048, 128), (129, 4096, 128), (64, 64, 63)],
                         ids=["huge", "past-vllms-verifier", "whole-context"])
def test_a_k_no_sequence_can_hold_is_refused_in_the_recipe(capsys, tmp_path, root, k, length, most):
    """``serve.num_speculative_tokens=1000000`` was taken as is (by ``serve export`` into the draft's
    config.json, by ``serve up`` into vLLM, which failed in its own log once started); so was 129, past
    the 128 draft tokens a round vLLM's rejection sampler verifies (its first decode failed)."""
    code = serve_main(["up", f"--recipe={root / 'recipes' / 'toy.yaml'}", f"run.workdir={tmp_path}",
                       "serve.port=0", f"serve.num_speculative_tokens={k}", f"serve.max_model_len={length}"])
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"serve: error: serve.num_speculative_tokens: {k} draft tokens a round; vLLM verifies at most 128 a round, "
        f"and they and the target's own token must fit serve.max_model_len ({length}); set at most {most}"]
    assert not (tmp_path / "serve").exists()
    assert load_recipe(root / "recipes" / "toy.yaml", [f"serve.num_speculative_tokens={most}",
                                                      f"serve.max_model_len={length}"]).serve.num_speculative_tokens \
        == most


@pytest.mark.parametrize("revision", ["a..b", "-x", "v1.lock", "feat/", "a:b", "x@{1}", "dev.", "/main", "a//b"])
def test_a_branch_name_git_refuses_is_refused_before_the_hub(capsys, monkeypatch, tmp_path, root, toy_export, revision):
    """``serve.hub_revision=a..b`` passed the recipe (only whitespace was refused): with a token, the repo was
    created on the Hub and the branch then refused there."""
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_token")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: a request would fail
    shutil.copytree(toy_export, tmp_path / "draft")
    code = serve_main(["push", f"--recipe={root / 'recipes' / 'toy.yaml'}", f"run.workdir={tmp_path}",
                       f"ingest.manifest={root / 'recipes' / 'manifests' / 'toy.yaml'}", "serve.hub_repo_id=me/x",
                       f"serve.hub_revision={revision}"])
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"serve: error: serve.hub_revision: a branch name git accepts, got {revision!r}"]


@pytest.mark.parametrize("revision", ["dev", "feat/eagle-3.1", "v1_2", "refs-x"])
def test_plain_branch_names_pass(root, revision):
    assert load_recipe(root / "recipes" / "toy.yaml", [f"serve.hub_revision={revision}"]).serve.hub_revision == revision


def test_a_drafts_recorded_k_no_sequence_can_hold_is_refused(tmp_path, root, toy_export):
    """A draft whose config.json records K = 10**12 (the recipe's K null) was handed to vLLM as is."""
    shutil.copytree(toy_export, tmp_path / "draft")
    _config(recommended_num_speculative_tokens=10**12)(tmp_path / "draft")
    with pytest.raises(ConfigError) as err:
        up_server(_recipe(root, tmp_path))
    assert str(err.value) == (f"{tmp_path}/draft/config.json: the draft's default of 1000000000000 draft tokens a "
                              "round and the target's own token must fit serve.max_model_len (2048); set "
                              "serve.num_speculative_tokens")
    server = up_server(_recipe(root, tmp_path, "serve.num_speculative_tokens=4"))  # the recipe's K wins
    assert json.loads(server.argv[server.argv.index("--speculative-config") + 1])["num_speculative_tokens"] == 4


#: The end of vLLM's log when its config refuses ``--max-model-len`` past the target's positions.
PYDANTIC_TAIL = """Traceback (most recent call last):
  File "vllm/engine/arg_utils.py", line 1955, in create_model_config
    return ModelConfig(
pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig
  Value error, User-specified max_model_len (100000) is greater than the derived max_model_len (32768) [type=value_error]
    For further information visit https://errors.pydantic.dev/2.14/v/value_error
"""


def test_a_server_refused_at_start_up_says_why(tmp_path, root):
    """``serve up serve.max_model_len=100000`` on a target of 32768 positions: the one line was the last of
    vLLM's log, pydantic's "For further information visit https://errors.pydantic.dev/...", not the reason."""
    import sys

    server = up_server(_recipe(root, tmp_path), no_spec=True)
    server.argv = [sys.executable, "-c", f"import sys; sys.stdout.write({PYDANTIC_TAIL!r}); sys.exit(1)"]
    with pytest.raises(EaglenestError) as err:
        server.start()
    assert str(err.value) == (
        f"vLLM server exited with code 1 during start-up (log {server.log_path}): pydantic_core._pydantic_core."
        "ValidationError: 1 validation error for ModelConfig: Value error, User-specified max_model_len (100000) "
        "is greater than the derived max_model_len (32768) [type=value_error]")


@pytest.mark.parametrize("tail, says", [
    ("loading\nRuntimeError: Engine core initialization failed. See root cause above.\n",
     "RuntimeError: Engine core initialization failed. See root cause above."),
    ("starting\nKilled\n", "Killed"),
    ("", ""),
], ids=["exception", "plain-last-line", "empty"])
def test_the_start_up_reason_is_the_last_exception_or_line(tail, says):
    from eaglenest.serve.server import exit_reason

    assert exit_reason(tail) == says
