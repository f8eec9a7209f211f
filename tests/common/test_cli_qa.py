"""QA of the shared CLI layer: recipes, overrides and provenance as a hostile user meets them."""

from __future__ import annotations

import copy
import errno
import json
import os
import pickle
import signal
import sys
import types
from pathlib import Path

import pyarrow as pa
import pytest

from eaglenest import cli, config, engine, launch
from eaglenest.config import apply_overrides, load_yaml
from eaglenest.errors import ConfigError
from eaglenest.featurestore import schema as S
from eaglenest.featurestore.cli import main as featurestore_main
from eaglenest.featurestore.table import store
from eaglenest.provenance import REDACTED, write_json_atomic, write_provenance
from eaglenest.pipeline.train_cli import main as cli_main
from eaglenest.recipe import load_recipe
from eaglenest.runconfig import RunConfig


@pytest.mark.parametrize("raw", ["2024-01-01", "2001-12-14t21:59:43.10-05:00", "2024-06-01 10:00:00"])
def test_an_override_that_looks_like_a_date_is_the_text_typed(raw):
    # Before: PyYAML's YAML 1.1 timestamps, so `run.workdir=2024-01-01` was refused as
    # "expected str, got datetime.date(2024, 1, 1)" (YAML 1.2's core schema has no dates).
    assert apply_overrides({}, [f"a.b={raw}"])["a"]["b"] == raw


def test_a_run_named_by_its_date_loads(root, monkeypatch):
    monkeypatch.chdir(root)
    recipe = load_recipe("recipes/toy.yaml", ["run.workdir=2024-01-01", "train.track.run_name=2024-06-01"])
    assert recipe.run.workdir == "2024-01-01" and recipe.train.track.run_name == "2024-06-01"


def _pipe_path(text: str) -> str:
    """A path like bash's ``<(...)``: a pipe holding ``text`` with its writer closed."""
    read_fd, write_fd = os.pipe()
    os.write(write_fd, text.encode())
    os.close(write_fd)
    return f"/proc/{os.getpid()}/fd/{read_fd}"


def test_a_recipe_from_process_substitution_is_read(root, monkeypatch):
    # Before: `--recipe <(sed ... recipes/toy.yaml)` was "/dev/fd/63: file not found" (a pipe is no
    # regular file), though the path is there and readable.
    monkeypatch.chdir(root)
    path = _pipe_path((root / "recipes" / "toy.yaml").read_text() + "\n# piped\n")
    try:
        assert load_recipe(path, ["run.seed=7"]).run.seed == 7
    finally:
        os.close(int(path.rsplit("/", 1)[1]))


def test_an_oversized_pipe_is_refused_by_its_size(monkeypatch):
    monkeypatch.setattr(config, "MAX_YAML_BYTES", 50_000)
    path = _pipe_path("a: " + "x" * 60_000 + "\n")  # over the limit, under the pipe's buffer
    try:
        with pytest.raises(ConfigError, match=rf"^{path}: larger than 48 KiB"):
            load_yaml(path)
    finally:
        os.close(int(path.rsplit("/", 1)[1]))


def test_api_keys_in_the_environment_never_reach_provenance(tmp_path, monkeypatch):
    # Before: only *SECRET*/*TOKEN*/*PASSWORD*... variables were redacted: an OPENAI_API_KEY or the
    # variable a recipe names as ingest.api_key_env, pasted into an argument, was written as is.
    monkeypatch.setenv("OPENAI_API_KEY", "sk-proj-0123456789abcdef")
    monkeypatch.setenv("MY_SERVER_CRED", "s3kr1t-value-42")
    monkeypatch.setenv("HF_TOKEN", "hf_abcdefghijklmnopqrst")
    argv = ["ingest", "build", "x=sk-proj-0123456789abcdef", "--note", "s3kr1t-value-42", "hf_abcdefghijklmnopqrst"]
    config = {"ingest": {"api_key_env": "MY_SERVER_CRED", "note": "key s3kr1t-value-42"}}
    path = write_provenance(tmp_path, config=config, argv=argv)
    text = path.read_text()
    for secret in ("sk-proj-0123456789abcdef", "s3kr1t-value-42", "hf_abcdefghijklmnopqrst"):
        assert secret not in text, secret
    record = json.loads(text)
    assert record["argv"] == ["ingest", "build", f"x={REDACTED}", "--note", REDACTED, REDACTED]
    assert record["config"]["ingest"] == {"api_key_env": "MY_SERVER_CRED", "note": f"key {REDACTED}"}


def test_a_recipe_can_be_copied_and_pickled(root, monkeypatch):
    # Before: RecursionError: copy and pickle look up __setstate__/__deepcopy__ on an instance whose
    # ``sections`` is not set yet, and Recipe.__getattr__ asked for ``sections`` again, forever.
    monkeypatch.chdir(root)
    recipe = load_recipe("recipes/toy.yaml", ["run.seed=5"])
    for copied in (copy.deepcopy(recipe), pickle.loads(pickle.dumps(recipe))):
        assert copied.run.seed == 5 and copied.to_dict() == recipe.to_dict()
    with pytest.raises(AttributeError, match="no_such_section"):
        recipe.no_such_section


def test_a_full_disk_while_writing_vllms_log_config_leaves_no_half_file(tmp_path, monkeypatch):
    # Before: the temporary `.vllm-logging.json.tmp<pid>` stayed in <workdir>/logs when the write failed.
    for key in engine.VLLM_LOG_ENV:
        monkeypatch.setenv(key, "x")  # recorded, so what quiet_vllm sets is undone after the test
        monkeypatch.delenv(key)
    monkeypatch.setattr(engine, "_deferred_log_dir", None)
    real = Path.write_text

    def half_then_full(self, text, *args, **kwargs):
        real(self, text[:10], *args, **kwargs)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", half_then_full)
    assert engine.defer_quiet_vllm(tmp_path / "logs", verbose=0)
    assert engine.quiet_vllm() is None  # vLLM logs at WARNING on the console instead
    assert os.environ["VLLM_LOGGING_LEVEL"] == "WARNING"
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == []


def test_a_workdir_under_home_is_the_one_every_stage_uses(tmp_path, monkeypatch, capsys, root):
    # The shell does not expand `~` in `run.workdir=~/w` (not a variable assignment). Before: the
    # writability checks expanded it, Lance and vLLM did not: `featurestore show run.workdir=~/w`
    # said "no store at ~/w/store" beside a store in $HOME/w/store, and a build wrote to ./~/w.
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(root)
    recipe = load_recipe("recipes/toy.yaml", ["run.workdir=~/w", "run.target=~/model", "run.store="])
    assert recipe.run.workdir == str(tmp_path / "home" / "w") and recipe.run.target == str(tmp_path / "home" / "model")
    assert recipe.run.store_uri == str(tmp_path / "home" / "w" / "store")
    assert load_recipe("recipes/toy.yaml", ["run.store=~/s"]).run.store_uri == str(tmp_path / "home" / "s")
    rows = [{"sample_id": "s-0", "domain": "d", "source": "synthetic", "split": "train", "mode": "raw",
             "messages_json": "[]", "prompt_token_ids": [1, 2, 3], "response_token_ids": [4, 5],
             "finish_reason": "length", "gen_params_id": "g0"}]
    table = pa.Table.from_pylist(rows, schema=S.PROMPTS_SCHEMA)
    store.append(str(tmp_path / "home" / "w" / "store"), store.PROMPTS, table)
    capsys.readouterr()
    assert featurestore_main(["show", "run.workdir=~/w"]) == 0, capsys.readouterr().err
    assert "prompts" in capsys.readouterr().out
    assert not (root / "~").exists()


def _strict_json(text: str):
    """``json.loads`` as jq and browsers read: NaN and Infinity are not JSON."""
    def refuse(name):
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def test_json_written_by_eaglenest_is_strict_json(tmp_path, caplog):
    # Before: a diverged loss or an empty bucket's AL was written as NaN / Infinity (Python's json
    # default), which jq, browsers and every strict parser refuse: the whole report became unreadable.
    record = {"overall": {"acceptance_length": float("nan"), "n": 3}, "loss": float("inf"),
              "step_loss": [1.5, float("-inf")], "ok": 2.5}
    path = tmp_path / "report.json"
    with caplog.at_level("WARNING", logger="eaglenest.provenance"):
        write_json_atomic(path, record)
    assert _strict_json(path.read_text()) == {"overall": {"acceptance_length": None, "n": 3}, "loss": None,
                                              "step_loss": [1.5, None], "ok": 2.5}
    warned = caplog.text
    assert "report.json" in warned
    for key in ("overall.acceptance_length", "loss", "step_loss[1]"):
        assert key in warned, key
    write_provenance(tmp_path / "p", config={"train": {"lr": float("nan")}})
    assert _strict_json((tmp_path / "p" / "provenance.json").read_text())["config"] == {"train": {"lr": None}}


@pytest.mark.parametrize("section", ["ingest", "featurestore", "evaluate"])
def test_an_engine_dtype_vllm_does_not_know_is_refused_at_load(root, monkeypatch, section):
    # Before: `ingest.engine.dtype=bf16` loaded; vLLM refused it once the command had imported it and
    # built its engine config, ~20 s later, as a pydantic ValidationError traceback.
    monkeypatch.chdir(root)
    with pytest.raises(ConfigError, match=rf"^{section}\.engine\.dtype: 'bf16' is not one of 'auto', .*'bfloat16'"):
        load_recipe("recipes/toy.yaml", [f"{section}.engine.dtype=bf16"])
    assert load_recipe("recipes/toy.yaml", [f"{section}.engine.dtype=bfloat16"]).sections[section].engine.dtype == \
        "bfloat16"


class KVShortLLM:
    """A stub of ``vllm.LLM`` (a real start here costs ~20 s) whose start fails where vLLM's does when
    the KV cache cannot hold one sequence of ``max_model_len``: vLLM's own check, with its words."""

    available = 0

    def __init__(self, model, **kwargs):
        from vllm.v1.core.kv_cache_utils import _check_enough_kv_cache_memory

        _check_enough_kv_cache_memory(self.available, lambda: 3 << 30, kwargs["max_model_len"], lambda n: 100)


@pytest.mark.parametrize("available", [0, 1 << 30])
def test_a_kv_cache_too_small_for_one_sequence_names_the_keys(monkeypatch, tiny_target, available):
    # Before: a ValueError traceback from vLLM's engine start, naming vLLM's `gpu_memory_utilization`,
    # which no recipe has.
    import vllm

    monkeypatch.setattr(vllm, "LLM", KVShortLLM)
    monkeypatch.setattr(KVShortLLM, "available", available)
    with pytest.raises(ConfigError) as err:
        engine.make_llm(str(tiny_target), engine.EngineConfig(in_process=True, max_model_len=4096,
                                                              memory_fraction=0.01))
    text = str(err.value)
    assert text.startswith("engine.memory_fraction: 0.01 ") and "engine.max_model_len" in text and "4096" in text
    assert "gpu_memory_utilization" not in text


@pytest.mark.parametrize("key", ["workdir", "target", "store"])
@pytest.mark.parametrize("value", ["${HOME}/runs/x", "$HOME/runs/x", "runs/${USER}"])
def test_an_environment_variable_in_a_run_path_is_refused_not_taken_literally(tmp_path, monkeypatch, root, key,
                                                                             value):
    # Before: `workdir: ${HOME}/runs/x` in a recipe (no shell expands it) made the run's store and
    # outputs under a folder literally named '${HOME}' in the current directory.
    monkeypatch.chdir(tmp_path)
    recipe = tmp_path / "r.yaml"
    recipe.write_text((root / "recipes" / "toy.yaml").read_text())
    with pytest.raises(ConfigError, match=rf"^run\.{key}: .*{value[:5].replace('$', '[$]').replace('{', '[{]')}.* "
                                          r"environment variable"):
        load_recipe(str(recipe), [f"run.{key}={value}"])
    assert list(tmp_path.iterdir()) == [recipe]


def test_an_install_inside_another_git_repository_does_not_record_its_commit(tmp_path, monkeypatch):
    # Before: eaglenest installed (not editable) into a virtual environment inside a user's own git
    # project recorded that project's commit as eaglenest's code_version: `git -C site-packages` finds
    # the enclosing repository.
    import subprocess

    from eaglenest import __version__, provenance

    project = tmp_path / "myproject"
    site = project / ".venv" / "lib" / "site-packages" / "eaglenest"
    site.mkdir(parents=True)
    env = {**os.environ, "GIT_AUTHOR_NAME": "u", "GIT_AUTHOR_EMAIL": "u@x", "GIT_COMMITTER_NAME": "u",
           "GIT_COMMITTER_EMAIL": "u@x"}
    for cmd in (["init", "-q"], ["commit", "-q", "--allow-empty", "-m", "theirs"]):
        subprocess.run(["git", "-C", str(project), *cmd], check=True, env=env, capture_output=True)
    monkeypatch.setattr(provenance, "__file__", str(site / "provenance.py"))
    assert provenance.code_version() == __version__


@pytest.mark.parametrize("name", ["AZURE_STORAGE_ACCESS_KEY", "AZURE_STORAGE_MASTER_KEY"])
def test_object_store_keys_in_the_environment_never_reach_provenance(tmp_path, monkeypatch, name):
    # Before: the Azure keys Lance's object store reads (object_store's azure_storage_access_key and
    # master_key) were not taken for secrets: pasted into an argument, they were written as is.
    secret = "c2VjcmV0LWF6dXJlLWtleS0xMjM0NTY3OA=="
    monkeypatch.setenv(name, secret)
    path = write_provenance(tmp_path, config={"note": f"k {secret}"}, argv=["featurestore", "show", f"x={secret}"])
    text = path.read_text()
    assert secret not in text, name
    assert json.loads(text)["argv"] == ["featurestore", "show", f"x={REDACTED}"]


@pytest.mark.parametrize("key", ["azure_storage_master_key", "master_key"])
def test_a_literal_azure_master_key_in_storage_options_is_refused(root, monkeypatch, key):
    # Before: object_store's Azure account key under its `master_key` names was taken as a plain
    # option, so the recipe's key landed in provenance.json and --dry-run.
    monkeypatch.chdir(root)
    with pytest.raises(ConfigError, match=rf"^run\.storage_options\.{key}: credentials are not written"):
        load_recipe("recipes/toy.yaml", ["run.store=az://container/prefix",
                                         f"run.storage_options.{key}=c2VjcmV0LWF6dXJl"])
    ok = load_recipe("recipes/toy.yaml", ["run.store=az://container/prefix",
                                          f"run.storage_options.{key}=${{AZURE_STORAGE_MASTER_KEY}}"])
    assert ok.run.storage_options == {key: "${AZURE_STORAGE_MASTER_KEY}"}


def _verbosity(recipe, args):
    print(f"verbose={args.verbose}")
    return 0


@pytest.mark.parametrize("argv, level", [(["-v", "x"], 1), (["-vv", "x"], 2), (["-v", "x", "-v"], 2), (["x"], 0)])
def test_verbose_before_the_command_counts(capsys, argv, level):
    # Before: `ingest -v build` was "ingest: error: unrecognized arguments: -v" (exit 2), though every
    # command takes -v: only after the command's name was it known.
    commands = {"x": cli.Command(_verbosity, "prints its verbosity", needs_recipe=False)}
    assert cli.run("demo", "d", commands, argv) == 0
    assert capsys.readouterr().out == f"verbose={level}\n"


@pytest.mark.parametrize("override, section, key, text", [
    ("train.stream.devices=1", "train", ("stream", "devices"), "1"),  # CUDA_VISIBLE_DEVICES of one device
    ("train.track.run_name=42", "train", ("track", "run_name"), "42"),
    ("featurestore.table=2024", "featurestore", ("table",), "2024"),
    ("serve.hub_revision=1234567", "serve", ("hub_revision",), "1234567"),
    ("run.workdir=1.50", "run", ("workdir",), "1.50"),
])
def test_a_number_typed_for_a_text_key_is_the_text_typed(root, monkeypatch, override, section, key, text):
    # Before: "train.stream.devices: expected str, got 1": an override is read as YAML, and no quoting
    # a shell lets through (`'"1"'`) is what anyone types for a device, a run name or a revision.
    monkeypatch.chdir(root)
    value = load_recipe("recipes/toy.yaml", [override]).sections[section]
    for k in key:
        value = getattr(value, k)
    assert value == text
    assert load_recipe("recipes/toy.yaml", ["train.num_epochs=2"]).train.num_epochs == 2  # a number key: a number
    with pytest.raises(ConfigError, match=r"^train\.num_epochs: expected int, got 'x'"):
        load_recipe("recipes/toy.yaml", ["train.num_epochs=x"])


def test_a_number_in_a_recipe_file_for_a_text_key_is_still_refused(tmp_path, root):
    # YAML 1.1 has read `run_name: 0601` as 385 by then: the file must quote it, as before.
    recipe = tmp_path / "r.yaml"
    recipe.write_text("train:\n  track:\n    run_name: 0601\n")
    with pytest.raises(ConfigError, match=r"^train\.track\.run_name: expected str, got 385"):
        load_recipe(str(recipe), [])


def test_credentials_in_a_url_never_reach_provenance(tmp_path):
    # Before: an endpoint behind basic auth (`https://user:password@host/v1`) or a signed URL
    # (`...?sig=...`, `?api_key=...`) was written to provenance.json as given, in the config and argv.
    url = "https://bob:hunter2-pass@llm.example:8443/v1"
    signed = "https://acct.blob.example/c/data.jsonl?sv=2024&sig=SIGNATURE0123&se=2030"
    keyed = "http://127.0.0.1:8000/v1?api_key=KEY0123456789"
    path = write_provenance(tmp_path, config={"ingest": {"endpoints": [url, keyed]}, "src": signed},
                            argv=["ingest", "build", f"ingest.endpoints=[{url}]", signed])
    text = path.read_text()
    for secret in ("hunter2-pass", "SIGNATURE0123", "KEY0123456789"):
        assert secret not in text, secret
    record = json.loads(text)
    assert record["config"]["ingest"]["endpoints"] == [f"https://bob:{REDACTED}@llm.example:8443/v1",
                                                       f"http://127.0.0.1:8000/v1?api_key={REDACTED}"]
    assert record["argv"][-1] == f"https://acct.blob.example/c/data.jsonl?sv=2024&sig={REDACTED}&se=2030"


@pytest.mark.parametrize("text", ["", "\n\n", "# train:\n#   lr: 1e-3\n"])
def test_an_empty_recipe_is_refused_not_run_with_every_default(tmp_path, capsys, text):
    # Before: an empty recipe (a file truncated by a full disk, `--recipe <(cmd)` whose cmd failed, every
    # line commented out) ran the command with every default: the toy target, in runs/toy.
    recipe = tmp_path / "r.yaml"
    recipe.write_text(text)
    with pytest.raises(ConfigError, match=rf"^{recipe}: empty .*write {{}}"):
        load_recipe(str(recipe), [])
    assert cli_main(["run", "--recipe", str(recipe), "--dry-run"]) == 2
    assert capsys.readouterr().err.startswith(f"train: error: {recipe}: empty")
    recipe.write_text("{}\n")  # every default, said so
    assert load_recipe(str(recipe), []).run == RunConfig()


def test_a_second_command_in_one_process_logs_vllm_to_its_own_run(tmp_path, monkeypatch):
    # Before: what the first command set (VLLM_LOGGING_CONFIG_PATH, VLLM_CONFIGURE_LOGGING) counted as
    # the user's own setting: a second command in the same process (a notebook, a script calling each
    # stage's main) logged vLLM into the first run's folder, or, that folder removed, an engine started
    # in its own processes failed on the missing config file.
    for key in engine.VLLM_LOG_ENV:
        monkeypatch.setenv(key, "x")  # recorded, so what the calls below set is undone after the test
        monkeypatch.delenv(key)
    monkeypatch.setattr(engine, "_deferred_log_dir", None)
    monkeypatch.setattr(engine, "_set_here", {}, raising=False)
    assert engine.defer_quiet_vllm(tmp_path / "a" / "logs", verbose=0)
    assert engine.quiet_vllm() == tmp_path / "a" / "logs" / "vllm.log"
    assert engine.defer_quiet_vllm(tmp_path / "b" / "logs", verbose=0)
    assert engine.quiet_vllm() == tmp_path / "b" / "logs" / "vllm.log"
    assert os.environ["VLLM_LOGGING_CONFIG_PATH"] == str(tmp_path / "b" / "logs" / "vllm-logging.json")
    assert not engine.defer_quiet_vllm(tmp_path / "c" / "logs", verbose=1)  # -v: vLLM's own logging
    assert not any(k in os.environ for k in engine.VLLM_LOG_ENV)
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")  # a user's own setting is left alone
    assert not engine.defer_quiet_vllm(tmp_path / "d" / "logs", verbose=0)
    assert os.environ["VLLM_LOGGING_LEVEL"] == "DEBUG"


@pytest.mark.parametrize("session", ["IPython", "ipykernel", "ps1"])
def test_ctrl_c_in_a_python_session_stops_the_command_not_the_session(monkeypatch, session):
    # A CLI's main() run in a notebook (ipykernel installs Python's own SIGINT handler while a cell runs)
    # would have ended the whole kernel by SIGINT on "interrupt", where it should stop the command.
    if session == "ps1":
        monkeypatch.setattr(sys, "ps1", ">>> ", raising=False)
    else:
        monkeypatch.setitem(sys.modules, session, types.ModuleType(session))
    monkeypatch.setattr(signal, "getsignal", lambda sig: signal.default_int_handler)
    assert launch.end_by_sigint_after_cleanup() is False


@pytest.mark.parametrize("cfg, want", [
    ({"recommended_num_speculative_tokens": True}, 5),  # true was served as K = 1
    ({"speculators_config": "greedy"}, 5),  # an AttributeError traceback (evaluate al reads it first)
    ({"speculators_config": {"proposal_methods": "x"}}, 5),
    ({"speculators_config": {"proposal_methods": [{"speculative_tokens": True}]}}, 5),
    ({"speculators_config": {"proposal_methods": [{"speculative_tokens": 4}]}}, 4),
    ({"recommended_num_speculative_tokens": 2}, 2),
])
def test_a_drafts_k_that_is_no_count_falls_back_to_the_default(tmp_path, cfg, want):
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert engine.draft_num_speculative_tokens(str(tmp_path), 5) == want
