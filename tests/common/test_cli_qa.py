"""QA of the shared CLI layer: recipes, overrides and provenance as a hostile user meets them."""

from __future__ import annotations

import copy
import errno
import json
import os
import pickle
from pathlib import Path

import pyarrow as pa
import pytest

from eaglenest import config, engine
from eaglenest.config import apply_overrides, load_yaml
from eaglenest.errors import ConfigError
from eaglenest.featurestore import schema as S
from eaglenest.featurestore.cli import main as featurestore_main
from eaglenest.featurestore.table import store
from eaglenest.provenance import REDACTED, write_provenance
from eaglenest.recipe import load_recipe


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
