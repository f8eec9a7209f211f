"""Sixth QA pass on `featurestore capture` (the fifth hostile one): the target's tokenizer or chat
template changed since `ingest build` generated the responses (same weights: an edited
``chat_template``, another revision), which capture took as on-policy. Refusals are one line naming
what changed and ``run.off_policy``, before any engine starts, and leave the store as it was. The
engine is a stub (named so) wherever what is tested lies around it."""

from __future__ import annotations

import json
import logging
import re
import shutil

import pyarrow as pa
import pytest

from eaglenest.engine import EngineConfig
from eaglenest.errors import ConfigError, StoreError
from eaglenest.featurestore import schema as S
from eaglenest.featurestore.capture import build, policy
from eaglenest.featurestore.cli import main as featurestore_main
from eaglenest.featurestore.config import FeaturestoreConfig
from eaglenest.featurestore.table import store

import fs_helpers  # on sys.path via conftest

CFG = FeaturestoreConfig(engine=EngineConfig(max_model_len=64, memory_fraction=0.1))


_StubCapturer = fs_helpers.StubCapturer


def _chat_rows(n: int) -> list[dict]:
    rows = fs_helpers.prompt_rows(n, seed=1)
    for r in rows:
        r.update(mode="chat", messages_json=json.dumps([{"role": "user", "content": "hi"},
                                                        {"role": "assistant", "content": "yo"}]))
    return rows


def test_capture_refuses_a_chat_template_edited_since_ingest_in_one_line(tmp_path, tiny_target, edited_target,
        monkeypatch, capsys):
    """The user edited tokenizer_config.json's chat_template after `ingest build`: capture went on and
    stored features of token ids the target would no longer produce for those prompts. Exit 2, one
    line naming the template and run.off_policy; no engine, no features table."""
    fs_helpers.forbid_capture_engine(monkeypatch)
    work = tmp_path / "run"
    fs_helpers.prompts_store(work, _chat_rows(2), tiny_target)
    target = edited_target
    rc = featurestore_main(["capture", f"run.workdir={work}", f"run.target={target}",
                            "featurestore.engine.max_model_len=64"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1, err
    assert err[0].startswith("featurestore: error: featurestore capture: the chat template (sha256 "), err[0]
    assert f"of run.target {target} changed since `ingest build`" in err[0]
    assert "run.off_policy=true" in err[0]
    assert not store.exists(str(work / "store"), store.FEATURES)


def test_capture_refuses_another_tokenizer_with_the_same_weights(tmp_path, tiny_target, monkeypatch):
    """Another revision of the model: same weights (the target check passed), a token added to the
    tokenizer. Refused naming the tokenizer, not the template."""
    fs_helpers.forbid_capture_engine(monkeypatch)
    uri = fs_helpers.prompts_store(tmp_path, fs_helpers.prompt_rows(2, seed=1), tiny_target)
    target = tmp_path / "other-revision"
    shutil.copytree(tiny_target, target)
    tok = json.loads((target / "tokenizer.json").read_text())
    tok["added_tokens"].append({"id": max(t["id"] for t in tok["added_tokens"]) + 1, "content": "<|tool|>",
                                "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
                                "special": True})
    (target / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ConfigError, match=r"^featurestore capture: the tokenizer \(vocabulary, merges, special "
                                          r"tokens\) \(sha256 [0-9a-f]{12} then, [0-9a-f]{12} now\) of run\.target "
                                          r".*other-revision changed since") as exc:
        build.capture(target=str(target), store_uri=uri, cfg=CFG)
    assert "chat template" not in str(exc.value)
    assert not store.exists(uri, store.FEATURES)


def test_off_policy_capture_of_an_edited_template_warns_and_captures(tmp_path, tiny_target, edited_target, monkeypatch,
        caplog):
    monkeypatch.setattr(build, "Capturer", _StubCapturer)
    uri = fs_helpers.prompts_store(tmp_path, _chat_rows(2), tiny_target)
    target = edited_target
    with caplog.at_level(logging.WARNING, logger=policy.__name__):
        assert build.capture(target=str(target), store_uri=uri, cfg=CFG, off_policy=True)["captured"] == 2
    assert "the chat template (sha256" in caplog.text and "going on because run.off_policy=true" in caplog.text


def test_the_same_target_and_a_hub_id_are_not_refused(tmp_path, tiny_target, monkeypatch):
    """The target the responses came from passes; a hub id (no files here to hash, its weights
    already told apart) is not compared, not a KeyError out of the comparison."""
    monkeypatch.setattr(build, "Capturer", _StubCapturer)
    uri = fs_helpers.prompts_store(tmp_path, _chat_rows(2), tiny_target)
    assert build.capture(target=str(tiny_target), store_uri=uri, cfg=CFG)["captured"] == 2
    policy.check_tokenization(uri, "org/model", off_policy=False, stage="featurestore capture",
                              lineages=policy.response_lineages(uri))
    policy.check_prompts(uri, "org/model", off_policy=True, stage="featurestore capture")


@pytest.mark.parametrize("kind", ["foreign", "prompts-copy"])
def test_a_table_name_taken_by_a_table_of_another_schema_names_the_key(tmp_path, tiny_target, monkeypatch, kind):
    """featurestore.table naming a table that is no features table (another tool's, a copy of the
    prompts): "table 'mine': missing column 'sample_id'", a SchemaError naming neither the key nor
    what to do. One line naming featurestore.table now; the table is left as it was."""
    import lance

    fs_helpers.forbid_capture_engine(monkeypatch)
    rows = fs_helpers.prompt_rows(2, seed=1)
    uri = fs_helpers.prompts_store(tmp_path, rows, tiny_target)
    data = pa.table({"x": [1, 2]}) if kind == "foreign" else pa.Table.from_pylist(rows, schema=S.PROMPTS_SCHEMA)
    lance.write_dataset(data, f"{uri}/mine.lance")
    cfg = FeaturestoreConfig(table="mine", engine=CFG.engine)
    missing = "sample_id" if kind == "foreign" else "num_tokens"
    with pytest.raises(StoreError, match=rf"^featurestore\.table: table 'mine' in {re.escape(uri)} is not a features "
                                         rf"table \(.*missing column '{missing}'\); set featurestore\.table to "
                                         r"another name$"):
        build.capture(target=str(tiny_target), store_uri=uri, cfg=cfg)
    assert lance.dataset(f"{uri}/mine.lance").version == 1


def test_a_response_that_filled_every_position_names_how_to_capture_it(tmp_path, monkeypatch, config_target):
    """`ingest build` with ingest.engine.max_model_len at the target's positions generates up to all of
    them; capture needs one more for the token it samples, so it said "raise it", and raising it was
    refused as past the target's positions: no way to capture the store. The line says now that vLLM
    takes it with VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 (the test below captures so, exactly)."""
    fs_helpers.forbid_capture_engine(monkeypatch)
    target = config_target("short-target", max_position_embeddings=20)
    uri = fs_helpers.prompts_store(tmp_path, fs_helpers.rows_of(20), target)
    cfg = FeaturestoreConfig(engine=EngineConfig(max_model_len=20, memory_fraction=0.1))
    with pytest.raises(ConfigError, match=r"^featurestore\.engine\.max_model_len: 20 is too small for prompts row "
                                          r"s-000 \(20 tokens; capture needs 21\): raise it; 21 is past the 20 "
                                          r"positions of run\.target .*short-target, which vLLM allows with "
                                          r"VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 in the environment"):
        build.capture(target=str(target), store_uri=uri, cfg=cfg)
    # a conversation short of the positions: the plain advice, nothing about the environment
    with pytest.raises(ConfigError, match=r"capture needs 21\): raise it$"):
        build.check_lengths(fs_helpers.rows_of(20), 20, target=str(config_target("long", max_position_embeddings=64)))
    assert not store.exists(uri, store.FEATURES)


def test_the_advice_captures_a_conversation_of_every_position_exactly(tmp_path, tiny_target, monkeypatch,
        config_target):
    """What the refusal above says, with a real vLLM engine: the hidden states of a conversation of all
    the target's positions equal transformers' (one engine start)."""
    import torch
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    target = config_target("short-target", max_position_embeddings=20)
    rows = fs_helpers.rows_of(20, n=1)
    uri = fs_helpers.prompts_store(tmp_path, rows, target)
    cfg = FeaturestoreConfig(engine=EngineConfig(max_model_len=21, max_num_seqs=2, memory_fraction=0.05))
    assert build.capture(target=str(target), store_uri=uri, cfg=cfg)["captured"] == 1
    meta = S.feature_meta(store.dataset(uri, store.FEATURES).schema)
    (row,) = store.read(uri, store.FEATURES).to_pylist()
    aux = torch.from_numpy(S.decode_tensor(row["aux_hidden"], (20, len(meta.layer_ids), meta.hidden_size),
                                           meta.dtype).copy())
    model = AutoModelForCausalLM.from_pretrained(str(tiny_target), dtype=torch.float32).eval()
    with torch.no_grad():
        hs = model(torch.tensor([row["input_ids"]]), output_hidden_states=True).hidden_states
    assert row["num_tokens"] == 20
    for j, layer in enumerate(meta.layer_ids):
        torch.testing.assert_close(aux[:, j], hs[layer][0], atol=1e-4, rtol=1e-4)


def test_a_damaged_ingest_stats_file_is_not_read_the_prompts_tables_record_is(tmp_path, tiny_target, monkeypatch,
                                                                               capsys):
    """capture took the manifest hash for its lineage from <workdir>/ingest/stats.json: a truncated file
    was a JSONDecodeError traceback (and with run.store set, the file was another store's). The prompts
    table's own lineage is read: the capture goes on to its own refusal (a row too long), in one line."""
    fs_helpers.forbid_capture_engine(monkeypatch)
    work = tmp_path / "run"
    rows = fs_helpers.prompt_rows(2, seed=1)
    rows[1]["response_token_ids"] = list(range(3, 3 + 80))
    fs_helpers.prompts_store(work, rows, tiny_target)
    (work / "ingest").mkdir(parents=True)
    (work / "ingest" / "stats.json").write_text('{"manifest_hash": "ab')
    rc = featurestore_main(["capture", f"run.workdir={work}", f"run.target={tiny_target}",
                            "featurestore.engine.max_model_len=64"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert "featurestore.engine.max_model_len: 64 is too small for prompts row s-001" in err[0]


def test_capture_refuses_a_max_model_len_past_the_targets_positions_before_reading_the_pool(tmp_path, tiny_target,
                                                                                           capsys):
    """featurestore.engine.max_model_len past the target's positions was refused by vLLM once its
    engine started; now at the command's start, naming the key and the target's limit."""
    from eaglenest.target import read_config

    limit = read_config(tiny_target)["max_position_embeddings"]
    work = tmp_path / "run"
    fs_helpers.prompts_store(work, fs_helpers.prompt_rows(2, seed=1), tiny_target)
    rc = featurestore_main(["capture", f"run.workdir={work}", f"run.target={tiny_target}",
                            f"featurestore.engine.max_model_len={limit + 1}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert f"featurestore.engine.max_model_len: {limit + 1} is more than {tiny_target} has positions for" in err[0]
    assert f"set featurestore.engine.max_model_len={limit} or less" in err[0]
    assert not store.exists(str(work / "store"), store.FEATURES)
