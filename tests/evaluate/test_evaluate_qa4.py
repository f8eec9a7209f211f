"""QA repros for ``evaluate al`` (fourth pass): context buckets shortened to one length on a
short-context target, published prompts with a null category or an empty first turn, and the
report cache key of a hub target (its revision) and of a chat template kept in
``additional_chat_templates/``. No engine starts."""

from __future__ import annotations

import json
import logging
import shutil

import pytest

from eaglenest.errors import ConfigError
from eaglenest.evaluate import commands
from eaglenest.evaluate.buckets import build_bucket_prompts
from eaglenest.evaluate.prompts import published
from eaglenest.hf import load_tokenizer
from eaglenest.recipe import load_recipe


def test_buckets_shortened_to_one_length_are_decoded_once(tiny_target, caplog):
    """On a 2112-position target, 2048 and 4096 both shorten to 2048 prompt tokens: they were built
    (and decoded) twice with identical prompts, and reported as two buckets."""
    tok = load_tokenizer(tiny_target, trust_remote_code=False)
    with caplog.at_level(logging.WARNING, logger="eaglenest.evaluate.buckets"):
        out = build_bucket_prompts(tok, [], (1024, 2048, 4096, 8192), per_bucket=1, max_positions=2112,
                                   max_tokens=64, kinds=("records",))
    assert sorted(out) == [1024, 2048]
    assert [len(out[b][0]["prompt_token_ids"]) for b in (1024, 2048)] == [1024, 2048]
    assert "4096, 8192 shorten to 2048 prompt tokens, as 2048 does" in caplog.text


def _jsonl(path, *rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_null_category_is_refused_naming_the_row(tmp_path):
    path = _jsonl(tmp_path / "question.jsonl", {"question_id": 1, "category": "writing", "turns": ["Hi."]},
                  {"question_id": 2, "category": None, "turns": ["Hello."]})
    with pytest.raises(ConfigError) as err:
        published(path, name="mt_bench", split="train")
    assert str(err.value) == f"evaluate.prompt_path: row 1 (question_id 2) of {path}: category must be a name, got None"


def test_empty_first_turn_is_skipped_and_counted(tmp_path, caplog):
    path = _jsonl(tmp_path / "question.jsonl", {"question_id": 1, "category": "writing", "turns": ["Hi."]},
                  {"question_id": 2, "category": "writing", "turns": ["", "Then?"]},
                  {"question_id": 3, "category": "coding", "turns": ["  \n"]})
    with caplog.at_level(logging.WARNING, logger="eaglenest.evaluate.prompts"):
        groups = published(path, name="mt_bench", split="train")
    assert groups == {"writing": [{"sample_id": "mt_bench-1", "messages": [{"role": "user", "content": "Hi."}]}]}
    assert "2 question(s) of " in caplog.text and "(question_id 2, 3)" in caplog.text


def test_only_empty_first_turns_is_refused(tmp_path):
    path = _jsonl(tmp_path / "question.jsonl", {"question_id": 1, "category": "writing", "turns": [""]})
    with pytest.raises(ConfigError) as err:
        published(path, name="mt_bench", split="train")
    assert str(err.value) == f"evaluate.prompt_path: no questions in {path}"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """A Hugging Face cache holding ``org/tiny`` at one snapshot: returns a function that adds a new
    revision (a snapshot named by its commit, ``refs/main`` pointing at it)."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    repo = cache / "models--org--tiny"

    def revision(commit: str, config: dict) -> None:
        snap = repo / "snapshots" / commit
        snap.mkdir(parents=True)
        (snap / "config.json").write_text(json.dumps(config))
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(commit)

    return revision


def _key(root, tmp_path, target: str, draft) -> str:
    recipe = load_recipe(root / "recipes" / "toy.yaml", [f"run.workdir={tmp_path / 'work'}", f"run.target={target}"])
    return commands._cache_key(recipe, str(draft))


def test_hub_target_key_follows_its_revision(root, tmp_path, hub_cache, toy_export):
    """A target given as a hub id was keyed on its name only: a new revision in the cache kept the
    earlier report as if it measured it."""
    hub_cache("a" * 40, {"model_type": "llama"})
    first = _key(root, tmp_path, "org/tiny", toy_export)
    assert _key(root, tmp_path, "org/tiny", toy_export) == first
    hub_cache("b" * 40, {"model_type": "llama"})  # same files, another commit
    assert _key(root, tmp_path, "org/tiny", toy_export) != first


def test_additional_chat_templates_count_in_the_key(root, tmp_path, tiny_target, toy_export):
    target = tmp_path / "target"
    shutil.copytree(tiny_target, target)
    (target / "additional_chat_templates").mkdir()
    template = target / "additional_chat_templates" / "tool_use.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    first = _key(root, tmp_path, str(target), toy_export)
    template.write_text("{{ messages[-1]['content'] }}")
    assert _key(root, tmp_path, str(target), toy_export) != first
