"""Fifth QA pass on `featurestore capture`: a capture started while `ingest build` still writes the
prompts table, a re-run after the prompts gained rows, layer ids that are not plain ints, a spooled
capture the engine could not write, a chat template changed since ingest, and the engine window's
byte bound under fp8 storage. Refusals are one line naming the table, key or folder, and leave the
store as it was. The engine is a stub (named so) wherever what is tested lies around it."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest

from eaglenest.engine import EngineConfig
from eaglenest.errors import ConfigError, StoreError
from eaglenest.featurestore import schema as S
from eaglenest.featurestore.capture import build, policy
from eaglenest.featurestore.config import FeaturestoreConfig
from eaglenest.featurestore.table import lease, store

import fs_helpers  # on sys.path via conftest

CFG = FeaturestoreConfig(engine=EngineConfig(max_model_len=64, memory_fraction=0.1))


@pytest.fixture
def no_engine(monkeypatch):
    """Fails the test if the capture gets as far as starting its engine."""
    fs_helpers.forbid_capture_engine(monkeypatch)


def _hold_lease(uri: str, name: str, purpose: str) -> subprocess.Popen:
    """A process holding table ``name``'s writer lease (as `ingest build` does for its whole run)."""
    code = textwrap.dedent(f"""
        import sys, time
        from eaglenest.featurestore.table import lease
        with lease.hold(sys.argv[1], {name!r}, purpose={purpose!r}):
            print("HELD", flush=True)
            time.sleep(600)
        """)
    proc = subprocess.Popen([sys.executable, "-c", code, uri], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "HELD"
    return proc


def test_a_capture_while_ingest_writes_the_prompts_is_refused_naming_it(tmp_path, tiny_target, no_engine,
                                                                         monkeypatch):
    """`ingest build` commits the prompts shard by shard under the prompts table's lease. A capture
    started meanwhile took the half-written pool as its feature set (the pool is part of the
    identity), so once ingest finished every later capture into that table was refused
    (`differs in prompt_pool`). Refused now, naming the ingest, and no features table is made."""
    uri = fs_helpers.prompts_store(tmp_path, fs_helpers.prompt_rows(3, seed=1), tiny_target)
    monkeypatch.setattr(lease, "MAINTENANCE_WAIT_S", 0.3)
    proc = _hold_lease(uri, store.PROMPTS, "ingest build")
    try:
        with pytest.raises(StoreError, match=rf"table 'prompts' in .* is being written by pid {proc.pid} .*"
                                             r"\(ingest build\): this featurestore capture waited"):
            build.capture(target=str(tiny_target), store_uri=uri, cfg=CFG)
    finally:
        proc.kill()
        proc.wait(30)
    assert not store.exists(uri, store.FEATURES)



def test_numpy_layer_ids_are_the_same_feature_set_as_plain_ints(tiny_target):
    """Layer ids a library user computed with numpy (``np.array([2, 4, 5])``): the identity's
    json.dumps raised "Object of type int64 is not JSON serializable", a traceback."""
    ids = ["s-000", "s-001"]
    plain = build.feature_meta(str(tiny_target), [2, 4, 5], "auto", sample_ids=ids, gen_params_ids=["g0"])
    arr = build.feature_meta(str(tiny_target), np.array([2, 4, 5]), "auto", sample_ids=ids, gen_params_ids=["g0"])
    assert arr.feature_set_id == plain.feature_set_id
    assert arr.layer_ids == (2, 4, 5) and all(type(i) is int for i in arr.layer_ids)


@pytest.mark.parametrize("bad", [2.0, 2.5, "2", True])
def test_a_layer_id_that_is_not_a_whole_number_is_refused_naming_the_key(tiny_target, bad):
    """A float went through: 2.0 was stored as a layer id of another feature set than 2 (the
    recipe's), 2.5 reached vLLM's config; a string or a bool was a TypeError traceback or layer 1."""
    with pytest.raises(ConfigError, match=rf"featurestore\.layer_ids: {re.escape(repr(bad))} is not a whole number"):
        build.feature_meta(str(tiny_target), [bad, 4, 5], "auto", sample_ids=["s-000"], gen_params_ids=["g0"])


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_a_spooled_capture_the_engine_could_not_write_is_one_store_error(tmp_path, damage):
    """The engine writes each capture to the spool in the temp folder (GBs for a large target); a
    full temp folder fails that write, which vLLM only logs. Reading it back was then a
    FileNotFoundError (or, for a damaged file, a SafetensorError) traceback. One line naming the
    spool now, and the spool's files are removed."""
    from eaglenest.featurestore.capture.engine import Capturer

    path = tmp_path / "spool" / "req-1.safetensors"
    path.parent.mkdir()
    Path(f"{path}.lock").touch()
    if damage == "truncated":
        path.write_bytes(b"\x10\x00")
    cap = Capturer.__new__(Capturer)  # no engine: _read only needs the capture's layer count
    cap.llm = None  # (no engine to ask whether it died)
    cap.capture_ids = [2, 4, 5, 8]
    out = SimpleNamespace(kv_transfer_params={"hidden_states_path": str(path)})
    with pytest.raises(StoreError, match=rf"cannot read the hidden states the capture engine spooled to "
                                         rf"{re.escape(str(path.parent))} \(.+\): .*TMPDIR"):
        cap._read([5, 6, 7], out)
    assert list(path.parent.iterdir()) == []


_StubCapturer = fs_helpers.StubCapturer


def test_a_prompts_table_that_gained_rows_is_refused_saying_how_the_pool_changed(tmp_path, tiny_target,
                                                                                 monkeypatch):
    """The pool is part of the feature set's identity, so a capture after `ingest build` added
    conversations is refused. It named only `prompt_pool (key ingest.manifest)` and said to restore
    that key, when the manifest had not changed: it says now how many conversations the table lacks.
    Nothing is written."""
    monkeypatch.setattr(build, "Capturer", _StubCapturer)
    rows = fs_helpers.prompt_rows(5, seed=1)
    uri = fs_helpers.prompts_store(tmp_path, rows[:3], tiny_target)
    assert build.capture(target=str(tiny_target), store_uri=uri, cfg=CFG)["captured"] == 3
    store.append(uri, store.PROMPTS, pa.Table.from_pylist(rows[3:], schema=S.PROMPTS_SCHEMA),
                 lineage={"stage": "ingest", "shard": 1, **policy.lineage_record(str(tiny_target))})
    before = store.latest_version(uri, store.FEATURES)
    with pytest.raises(StoreError, match=r"differs in prompt_pool \(key ingest\.manifest\): 2 of the prompts "
                                         r"table's 5 training conversations are not in this table, 0 of its 3 "
                                         r"rows are no longer there"):
        build.capture(target=str(tiny_target), store_uri=uri, cfg=CFG)
    assert store.latest_version(uri, store.FEATURES) == before


def test_the_engine_window_is_cut_to_the_bytes_of_the_captured_tensors_not_the_stored(tmp_path, tiny_target,
                                                                                      monkeypatch):
    """The window (``Capturer.stream``) bounds the captured tensors waiting to be encoded to
    featurestore.write_buffer_mb. It was told the *stored* bytes per token, so with fp8 storage
    (one byte a value) the tensors it held, in the target's dtype (4 bytes here, 2 for bf16), were
    up to 4x the budget. It is told what the engine hands over now."""
    seen = []

    class Recording(_StubCapturer):
        def stream(self, seqs, **kwargs):
            for seq, (aux, last) in zip(seqs, super().stream(seqs, **kwargs), strict=True):
                seen.append(((aux.nbytes + last.nbytes) // len(seq), kwargs["bytes_per_token"]))
                yield aux, last

    monkeypatch.setattr(build, "Capturer", Recording)
    uri = fs_helpers.prompts_store(tmp_path, fs_helpers.prompt_rows(2, seed=1), tiny_target)
    cfg = FeaturestoreConfig(storage="fp8_e4m3", engine=CFG.engine)
    assert build.capture(target=str(tiny_target), store_uri=uri, cfg=cfg)["captured"] == 2
    assert len(seen) == 2
    for captured, told in seen:
        assert told == captured > 0


def test_a_conversation_the_current_chat_template_refuses_trains_on_its_last_answer(tmp_path, tiny_target,
                                                                                    monkeypatch, caplog):
    """The target's chat template changed since ingest to one that refuses a role the stored
    conversation has (a system turn, as Gemma's does): rendering its earlier turns for their loss
    spans raised jinja's TemplateError, a traceback mid-capture with the engine up. Handled as a
    template that does not reproduce the prompt: a warning naming the row, the last answer trained.
    (A template changed since ingest is refused unless run.off_policy=true (test_capture_qa6.py): opted in.)"""
    target = tmp_path / "target"
    shutil.copytree(tiny_target, target)
    cfg_path = target / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    tok_cfg["chat_template"] = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not "
                                "supported') }}{% endif %}" + tok_cfg["chat_template"])
    cfg_path.write_text(json.dumps(tok_cfg))
    rows = fs_helpers.prompt_rows(2, seed=1)
    rows[1]["mode"] = "chat"
    rows[1]["messages_json"] = json.dumps([{"role": "system", "content": "be brief"}, {"role": "user", "content": "a"},
                                           {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"},
                                           {"role": "assistant", "content": "d"}])
    monkeypatch.setattr(build, "Capturer", _StubCapturer)
    uri = fs_helpers.prompts_store(tmp_path, rows, tiny_target)
    with caplog.at_level("WARNING", logger=build.__name__):
        assert build.capture(target=str(target), store_uri=uri, cfg=CFG, off_policy=True)["captured"] == 2
    got = store.read(uri, store.FEATURES, columns=["sample_id", "num_loss_tokens"]).to_pylist()
    assert {r["sample_id"]: r["num_loss_tokens"] for r in got} == {
        r["sample_id"]: len(r["response_token_ids"]) for r in rows}
    assert "s-001: the chat template does not reproduce the prompt" in caplog.text


@pytest.mark.parametrize("bad", [2.5, "2", True])
def test_a_capture_config_built_in_code_refuses_a_layer_id_that_is_not_a_whole_number(bad):
    """``FeaturestoreConfig(layer_ids=["2"])`` built in code (no recipe walker) was a TypeError traceback
    from its own ``i < 0`` check; a bool passed as layer 1."""
    with pytest.raises(ConfigError, match=r"^featurestore\.layer_ids: .* holds a value that is not a whole number"):
        FeaturestoreConfig(layer_ids=[bad, 4, 5])
    assert FeaturestoreConfig(layer_ids=[np.int64(2), 4, 5]).layer_ids[0] == 2
