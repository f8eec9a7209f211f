"""Bring-your-own targets, QA pass 5: a generation_config.json with odd values (vLLM reads it at every
engine start) and a target folder whose path has spaces and non-ASCII letters. One line naming the file,
before anything is written or any engine starts."""

from __future__ import annotations

import json
import shutil

import pytest

import eaglenest.engine
from eaglenest.engine import EngineConfig, make_llm
from eaglenest.errors import ConfigError
from eaglenest.hf import check_generation_config
from eaglenest.ingest.cli import main as ingest_main


def _target(tmp_path, tiny_target, generation_config: str | None) -> object:
    """A copy of the tiny target in a folder with a space and an umlaut, with ``generation_config`` as its
    generation_config.json text (None: no such file)."""
    dst = tmp_path / "my tärget"
    shutil.copytree(tiny_target, dst)
    (dst / "generation_config.json").unlink()
    if generation_config is not None:
        (dst / "generation_config.json").write_text(generation_config)
    return dst


BAD = [
    # vLLM's engine start raised transformers' ValueError (a traceback, exit 1)
    ('{"max_new_tokens": -5}', "ValueError: `max_new_tokens` must be greater than 0, but is -5."),
    # vLLM's engine start raised TypeError: 'list' object is not a mapping
    ("[1, 2]", "TypeError: it holds no JSON object"),
    # vLLM skipped it without a word: the checkpoint's stop tokens (eos_token_id lists) were lost
    ('{"eos_token_id": [2, 7]', "JSONDecodeError: "),
]


@pytest.mark.parametrize(("text", "says"), BAD)
def test_a_generation_config_transformers_refuses_is_one_line_naming_the_file(tmp_path, tiny_target, text, says):
    target = _target(tmp_path, tiny_target, text)
    with pytest.raises(ConfigError) as info:
        check_generation_config(target)
    message = str(info.value)
    assert message.startswith(f"run.target: {target / 'generation_config.json'} is refused ({says}")
    assert "\n" not in message


def test_an_engine_is_not_started_for_a_refused_generation_config(tmp_path, tiny_target, monkeypatch):
    def reached(*args, **kwargs):
        raise AssertionError("vLLM was reached")

    monkeypatch.setattr(eaglenest.engine, "require", reached)
    target = _target(tmp_path, tiny_target, '{"max_new_tokens": 0}')
    with pytest.raises(ConfigError, match=r"generation_config\.json is refused \(ValueError: `max_new_tokens` must "
                                          r"be greater than 0, but is 0\.\)"):
        make_llm(str(target), EngineConfig(max_model_len=128, memory_fraction=0.05, in_process=True))


def test_ingest_build_refuses_it_before_anything_is_written(tmp_path, tiny_target, root, capsys):
    target = _target(tmp_path, tiny_target, '{"max_new_tokens": -5}')
    work = tmp_path / "work dir"
    rc = ingest_main(["build", "--recipe", str(root / "recipes/toy.yaml"), f"run.target={target}",
                      f"run.workdir={work}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert err == [f"ingest: error: run.target: {target / 'generation_config.json'} is refused (ValueError: "
                   "`max_new_tokens` must be greater than 0, but is -5.); fix the value it names, or remove the "
                   "file (the engine then stops at the tokenizer's end token only)"]
    assert not work.exists()


@pytest.mark.parametrize("text", [None, json.dumps({"eos_token_id": [2, 7], "temperature": 0.6, "top_p": 0.95,
                                                    "do_sample": True})])
def test_no_generation_config_or_an_ordinary_one_passes(tmp_path, tiny_target, text):
    check_generation_config(_target(tmp_path, tiny_target, text))  # raises on a refusal


def test_a_target_without_a_chat_template_is_refused_before_the_store_is_made(tmp_path, tiny_target, root, capsys):
    # The refusal came from build(), after run.store had been created and its prompts lease taken there:
    # the folder was left behind (store/.eaglenest/leases/prompts.lease). No pad token either: not needed.
    target = _target(tmp_path, tiny_target, None)
    tok_cfg = json.loads((target / "tokenizer_config.json").read_text())
    del tok_cfg["chat_template"], tok_cfg["pad_token"]
    (target / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    work = tmp_path / "work dir"
    rc = ingest_main(["build", "--recipe", str(root / "recipes/toy.yaml"), f"run.target={target}",
                      f"run.workdir={work}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and err[0].startswith(f"ingest: error: run.target: {target} has no chat template, and ")
    assert "training prompts are chat" in err[0]
    assert not work.exists()
