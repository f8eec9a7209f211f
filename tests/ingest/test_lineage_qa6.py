"""`ingest build` records how the target tokenized the conversations it answered (the sha256 of its
tokenizer files and of its chat template, next to ``target_id``), and the on-policy guard refuses the
same weights with another tokenizer or template: an edited ``chat_template``, another revision of the
model. No engine: a scripted backend answers (ingest_helpers.py)."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil

import pyarrow as pa
import pytest
from ingest_helpers import Scripted

from eaglenest.config import build as build_cfg
from eaglenest.errors import ConfigError
from eaglenest.featurestore import schema as S
from eaglenest.featurestore.capture import policy
from eaglenest.featurestore.table import fragments, store
from eaglenest.hf import load_tokenizer
from eaglenest.ingest.build import build
from eaglenest.ingest.config import IngestConfig
from eaglenest.ingest.manifest import Manifest
from eaglenest.ingest.pool import PoolEntry


def _manifest() -> Manifest:
    return build_cfg(Manifest, {"name": "t", "licence": "x", "raw_fraction": 0.0, "held_out_fraction": 0.0,
                                "domains": {"a": {"cap_prompts": 100, "sources": [{"path": "x", "provenance": "p"}]}}})


def _entries(start: int, n: int, mode: str = "chat") -> list[PoolEntry]:
    return [PoolEntry(sample_id=f"a-{i:016x}", domain="a", source="s", split="train", mode=mode, system="",
                      prompt=f"question {i}") for i in range(start, start + n)]


def _ingest(target, uri: str, entries: list[PoolEntry], **kw) -> dict:
    tok = load_tokenizer(str(target), trust_remote_code=False)
    return build(_manifest(), entries, target=str(target), store_uri=uri, backend=Scripted(tok),
                 cfg=IngestConfig(), **kw)


def _prompts(uri: str, lineage: dict, *, mode: str = "chat") -> None:
    rows = [{"sample_id": f"p{i}", "domain": "d", "source": "s", "split": "train", "mode": mode,
             "messages_json": json.dumps([{"role": "user", "content": "hi"}]), "prompt_token_ids": [5, 6, 7],
             "response_token_ids": [8, 9, 2], "finish_reason": "stop", "gen_params_id": "g"} for i in range(2)]
    store.append(uri, store.PROMPTS, pa.Table.from_pylist(rows, schema=S.PROMPTS_SCHEMA),
                 lineage={"stage": "ingest", "shard": 0, **lineage})


def test_ingest_records_the_tokenizer_and_chat_template_it_generated_with(tmp_path, tiny_target):
    """Each ingest commit's lineage held the target's name and weights hash only: nothing said which
    tokenizer and template produced the stored token ids, so capture could not tell they changed."""
    uri = str(tmp_path / "store")
    assert _ingest(tiny_target, uri, _entries(0, 3))["regenerated"] == 3
    ds = store.dataset(uri, store.PROMPTS)
    lineage = fragments.lineage_of(ds, int(ds.version))
    assert lineage["target_id"] == policy.target_id(str(tiny_target))
    template = json.loads((tiny_target / "tokenizer_config.json").read_text())["chat_template"]
    assert lineage["chat_template_sha256"] == hashlib.sha256(template.encode()).hexdigest()
    assert len(lineage["tokenizer_sha256"]) == 64
    assert lineage["tokenizer_sha256"] == policy.tokenization_record(str(tiny_target))["tokenizer_sha256"]


def test_an_edited_template_keeps_the_tokenizer_hash_and_changes_the_template_hash(tmp_path, tiny_target,
        edited_target):
    """The tokenizer hash leaves the template out, so a refusal can say which of the two changed; a
    tokenizer_config.json only re-indented is the same tokenizer and the same template."""
    mine = policy.tokenization_record(str(tiny_target))
    edited = policy.tokenization_record(str(edited_target))
    assert edited["tokenizer_sha256"] == mine["tokenizer_sha256"]
    assert edited["chat_template_sha256"] != mine["chat_template_sha256"]
    reindented = tmp_path / "reindented"
    shutil.copytree(tiny_target, reindented)
    path = reindented / "tokenizer_config.json"
    path.write_text(json.dumps(json.loads(path.read_text()), indent=4, sort_keys=True))
    assert policy.tokenization_record(str(reindented)) == mine


def test_ingest_adding_responses_after_the_template_changed_is_refused(tmp_path, tiny_target, edited_target):
    """A second `ingest build` into the same store after the template was edited appended answers
    rendered another way beside the stored ones (only a warning about mixed generation settings),
    and capture then took both as on-policy. Refused now, naming the template; nothing is added."""
    uri = str(tmp_path / "store")
    _ingest(tiny_target, uri, _entries(0, 2))
    edited = edited_target
    before = store.latest_version(uri, store.PROMPTS)
    with pytest.raises(ConfigError, match=r"^ingest build: the chat template \(sha256 [0-9a-f]{12} then, "
                                          r"[0-9a-f]{12} now\) of run\.target .*edited changed since `ingest build` "
                                          r"generated the responses in .*run\.off_policy=true"):
        _ingest(edited, uri, _entries(2, 2))
    assert store.latest_version(uri, store.PROMPTS) == before


def test_off_policy_lets_ingest_add_them_and_capture_still_names_the_change(tmp_path, tiny_target, edited_target,
        caplog):
    uri = str(tmp_path / "store")
    _ingest(tiny_target, uri, _entries(0, 2))
    edited = edited_target
    with caplog.at_level(logging.WARNING, logger=policy.__name__):
        assert _ingest(edited, uri, _entries(2, 2), off_policy=True)["regenerated"] == 2
    assert "chat template" in caplog.text and "going on because run.off_policy=true" in caplog.text
    # the older answers are still the old template's: refused for the new target, and for the old one the new
    with pytest.raises(ConfigError, match=r"the chat template \(sha256 .* then, .* now\)"):
        policy.check_prompts(uri, str(edited), off_policy=False, stage="featurestore capture")
    with pytest.raises(ConfigError, match=r"the chat template \(sha256 .* then, .* now\)"):
        policy.check_prompts(uri, str(tiny_target), off_policy=False, stage="featurestore capture")


def test_another_tokenizer_with_the_same_weights_is_refused_naming_the_tokenizer(tmp_path, tiny_target):
    """Another revision of the model with the same weights and another vocabulary file (a token
    added): `train run` compared the weights only."""
    uri = str(tmp_path / "store")
    _prompts(uri, policy.lineage_record(str(tiny_target)))
    other = tmp_path / "other-revision"
    shutil.copytree(tiny_target, other)
    special = other / "special_tokens_map.json"
    special.write_text(json.dumps({**json.loads(special.read_text()), "additional_special_tokens": ["<|tool|>"]}))
    with pytest.raises(ConfigError, match=r"^train run: the tokenizer \(vocabulary, merges, special tokens\) "
                                          r"\(sha256 [0-9a-f]{12} then, [0-9a-f]{12} now\) of run\.target "
                                          r".*other-revision changed since"):
        policy.check_prompts(uri, str(other), off_policy=False, stage="train run")


def test_a_store_from_before_the_record_is_not_refused_nor_warned_about(tmp_path, tiny_target, edited_target, caplog):
    """Old stores keep working: lineage with the target's identity but no tokenization record."""
    uri = str(tmp_path / "store")
    _prompts(uri, {"target": str(tiny_target), "target_id": policy.target_id(str(tiny_target))})
    edited = edited_target
    with caplog.at_level(logging.WARNING, logger=policy.__name__):
        policy.check_prompts(uri, str(edited), off_policy=False, stage="featurestore capture")
    assert caplog.text == ""


def test_a_template_change_does_not_matter_to_raw_completions(tmp_path, tiny_target, edited_target):
    """Raw-completion rows never went through the chat template: an edited template is no reason to
    refuse them (another tokenizer still is)."""
    uri = str(tmp_path / "store")
    _prompts(uri, policy.lineage_record(str(tiny_target)), mode="raw")
    policy.check_prompts(uri, str(edited_target), off_policy=False,
                         stage="featurestore capture")


def test_a_target_with_named_chat_templates_is_ingested_not_a_traceback(tmp_path, tiny_target):
    """tokenizer_config.json may hold a list of named templates (default, tool_use: Command-R, Hermes);
    transformers then gives the tokenizer's chat_template as a dict, and the generation settings'
    hash called ``.encode()`` on it: an AttributeError traceback before any prompt was answered.
    Each template edit still changes the settings' id and the lineage's template hash."""
    target = tmp_path / "named"
    shutil.copytree(tiny_target, target)
    path = target / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg["chat_template"] = [{"name": "default", "template": cfg["chat_template"]},
                            {"name": "tool_use", "template": "{{ 'tools' }}"}]
    path.write_text(json.dumps(cfg))
    uri = str(tmp_path / "store")
    stats = _ingest(target, uri, _entries(0, 2))
    assert stats["regenerated"] == 2
    ds = store.dataset(uri, store.PROMPTS)
    lineage = fragments.lineage_of(ds, int(ds.version))
    assert lineage["chat_template_sha256"] == policy.tokenization_record(str(target))["chat_template_sha256"]
    cfg["chat_template"][1]["template"] = "{{ 'other tools' }}"
    path.write_text(json.dumps(cfg))
    again = _ingest(target, str(tmp_path / "store2"), _entries(0, 1))
    assert again["gen_params_id"] != stats["gen_params_id"]
    assert policy.tokenization_record(str(target))["chat_template_sha256"] != lineage["chat_template_sha256"]


def test_the_rendering_kwargs_of_versions_gc_removed_are_still_read(tmp_path, tiny_target):
    """Capture renders a multi-turn conversation's earlier turns with the chat_template_kwargs ingest
    recorded, to find their loss spans; evaluation renders held-out prompts so. `featurestore gc`
    on the prompts table dropped the record of every version it removed (the target record was kept,
    in the table's gc lineage file), so rows rendered with those kwargs were then trained on their
    last answer only."""
    from eaglenest.featurestore.table import maintenance

    uri = str(tmp_path / "store")
    _prompts(uri, {**policy.lineage_record(str(tiny_target)), "chat_template_kwargs": {"enable_thinking": True}})
    more = [{"sample_id": "q0", "domain": "d", "source": "s", "split": "train", "mode": "chat",
                      "messages_json": "[]", "prompt_token_ids": [5], "response_token_ids": [8],
                      "finish_reason": "stop", "gen_params_id": "g2"}]
    store.append(uri, store.PROMPTS, pa.Table.from_pylist(more, schema=S.PROMPTS_SCHEMA),
                 lineage={"stage": "ingest", "shard": 0, "chat_template_kwargs": {},
                          **policy.lineage_record(str(tiny_target))})
    assert policy.rendered_kwargs(uri) == [{"enable_thinking": True}, {}]
    removed = maintenance.gc(uri, store.PROMPTS, older_than_hours=0, grace_hours=0)
    assert len(removed["versions_after"]) < len(removed["versions_before"])
    assert policy.rendered_kwargs(uri) == [{"enable_thinking": True}, {}]


def test_ingest_build_refuses_an_edited_template_in_one_line_before_reading_the_pool(tmp_path, tiny_target,
        edited_target, capsys):
    """Through the CLI: exit 2 and one line naming the template and run.off_policy, before the manifest's
    pool is read (the recipe's manifest is not even there) or anything is written."""
    from eaglenest.ingest.cli import main

    work = tmp_path / "run"
    _prompts(str(work / "store"), policy.lineage_record(str(tiny_target)))
    before = store.latest_version(str(work / "store"), store.PROMPTS)
    edited = edited_target
    rc = main(["build", f"run.workdir={work}", f"run.target={edited}", f"ingest.manifest={tmp_path / 'absent.yaml'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("ingest: error: ingest build: the chat template (sha256 "), err[0]
    assert "run.off_policy=true" in err[0]
    assert store.latest_version(str(work / "store"), store.PROMPTS) == before
    assert not (work / "ingest").exists()
