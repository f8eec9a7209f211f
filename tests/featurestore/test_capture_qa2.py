"""Second QA pass on capture and the streaming bypass: input the engine cannot take (a conversation
of no token, one longer than the engine's context, one tokenized for another model), a table that
takes no rows, a stream-serve given a target that is not there and a stream depth the transport
cannot honour: each refused in one line naming the row, table, flag or key, before an engine starts
or a peer is contacted."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import socket
import threading
import time
from datetime import timedelta

import numpy as np
import pyarrow as pa
import pytest

from eaglenest.engine import EngineConfig
from eaglenest.errors import ConfigError, SchemaError, StoreError
from eaglenest.featurestore import schema as S
from eaglenest.featurestore.capture import build, identity
from eaglenest.featurestore.capture.publish import Publisher
from eaglenest.featurestore.cli import main as featurestore_main
from eaglenest.featurestore.config import FeaturestoreConfig
from eaglenest.featurestore.stream.local import MAX_DEPTH, Channel
from eaglenest.featurestore.stream.xhost import PROTOCOL, RankStream, serve
from eaglenest.featurestore.table import store
from eaglenest.train.stream_source import StreamShards

import fs_helpers  # on sys.path via conftest

CFG = FeaturestoreConfig(engine=EngineConfig(max_model_len=64, memory_fraction=0.1))


def _rows(n: int) -> list[dict]:
    return fs_helpers.prompt_rows(n, seed=1)


def _store(tmp_path, rows: list[dict], target) -> str:
    return fs_helpers.prompts_store(tmp_path, rows, target)


@pytest.fixture
def no_engine(monkeypatch):
    """Fails the test if the capture gets as far as starting its engine."""
    fs_helpers.forbid_capture_engine(monkeypatch)


def _stream(uri: str, target) -> StreamShards:
    return StreamShards(uri, featurestore=CFG, target=str(target), split="train", pack_tokens=64, batch_rows=1,
                        seed=0, depth=1)


def test_a_conversation_of_no_token_is_refused_before_the_engine_naming_the_row(tmp_path, tiny_target, no_engine):
    """An empty prompt with an empty response (a damaged or hand-made prompts table): vLLM refused
    the empty prompt only once its engine was up, with a traceback."""
    rows = _rows(3)
    rows[2]["prompt_token_ids"], rows[2]["response_token_ids"], rows[2]["finish_reason"] = [], [], "stop"
    uri = _store(tmp_path, rows, tiny_target)
    with pytest.raises(StoreError, match=r"prompts row s-002: no token \(empty prompt and response\)"):
        build.capture(target=str(tiny_target), store_uri=uri, cfg=CFG)
    assert not store.exists(uri, store.FEATURES)


@pytest.mark.parametrize("extra", [0, 5])
def test_a_conversation_past_max_model_len_names_the_row_and_the_length_needed(tmp_path, tiny_target, no_engine,
                                                                              extra):
    """64 tokens in a 64-token engine still needs one position for the generated token: the message
    said "a conversation has 64 tokens: raise featurestore.engine.max_model_len" (which one, to what?)."""
    rows = _rows(3)
    rows[1]["response_token_ids"] = list(range(3, 3 + 54 + extra))  # 10 + 54 + extra tokens
    uri = _store(tmp_path, rows, tiny_target)
    want = (rf"featurestore\.engine\.max_model_len: 64 is too small for prompts row s-001 \({64 + extra} tokens; "
            rf"capture needs {65 + extra}\)")
    with pytest.raises(ConfigError, match=want):
        build.capture(target=str(tiny_target), store_uri=uri, cfg=CFG)
    assert not store.exists(uri, store.FEATURES)
    with pytest.raises(ConfigError, match=want):  # the stream refuses the same, before start()
        _stream(uri, tiny_target)


def test_the_stream_refuses_a_token_id_outside_the_vocabulary_before_an_engine(tmp_path, tiny_target):
    """`featurestore capture` refuses this before its engine starts; the stream planned the run and
    started an engine (minutes on a big target) that then failed in the producer's log."""
    rows = _rows(3)
    rows[0]["prompt_token_ids"][3] = 50000
    uri = _store(tmp_path, rows, tiny_target)
    with pytest.raises(StoreError, match=r"prompts row s-000: prompt_token_ids holds token id 50000, outside the "
                                         r"vocabulary of run\.target"):
        _stream(uri, tiny_target)


@pytest.mark.parametrize("target", ["/nonexistent/eaglenest-target", "not-here-relative"])
def test_stream_serve_refuses_a_missing_target_before_contacting_the_trainer(target, capsys):
    """A --target that is not there was found out only when the engine started, after the whole
    group (every rank and engine) had formed, failing them all."""
    t0 = time.monotonic()
    code = featurestore_main(["stream-serve", "--addr", "127.0.0.1:1", "--engine-rank", "0", "--target", target,
                              "--timeout-s", "30"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"featurestore: error: --target {target}: "), err
    assert "cannot reach the stream store" not in err[0]
    assert time.monotonic() - t0 < 10  # no wait for a store at all


def test_stream_serve_without_target_refuses_a_trainer_target_this_host_lacks():
    """No --target: the engine uses the trainer's run.target path. When this host has no such
    directory the engine claimed its rank, waited for its share and joined the group, and only its
    engine start failed (ending every rank); now it stops at the spec, naming the path and the flag."""
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=20))
    trainer_target = "/only/on/the/trainer/model"
    master.set("spec", json.dumps({"protocol": PROTOCOL, "world_size": 1, "num_engines": 1,
                                   "target": trainer_target}))
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=rf"--target: not given, and the trainer's run\.target is not usable on "
                                          rf"this host \({trainer_target}: no such directory .*give --target DIR"):
        serve(f"127.0.0.1:{port}", 0, timeout_s=20)
    assert time.monotonic() - t0 < 10  # not the 20 s wait for a share
    assert not master.check(["claim/engine-0"])  # the rank was not claimed



def test_a_stream_depth_below_the_engines_feeding_a_rank_is_refused_before_the_group():
    """Each engine link got max(1, depth // k) credits: depth 1 with two engines feeding one rank
    let two captures be in flight, past the bound train.stream.depth promises."""

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{s.getsockname()[1]}"
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=r"train\.stream\.depth: 1 is less than the 2 engines that feed rank 0 "
                                          r"\(train\.stream\.engines=2, 1 ranks\).*set it to 2 or more"):
        RankStream(addr, rank=0, world_size=1, num_engines=2, spec={}, sequences=[[5, 6, 7]], steps=[0], depth=1,
                   timeout_s=5)
    assert time.monotonic() - t0 < 3  # refused at once, not after the group's 5 s wait


def test_a_stream_depth_past_what_the_socket_can_grant_is_refused_not_a_hang(tmp_path):
    """train.stream.depth=1000000: the receiver thread's grant of a million credit bytes filled the
    socket and blocked, the publisher blocked on its frames, and the trainer waited for ever (0 of
    3000 captures after 20 s here). Refused in one line, nothing left behind."""

    path = str(tmp_path / "s.sock")
    with pytest.raises(ConfigError, match=rf"train\.stream\.depth: 1000000 captures in flight is more than the "
                                          rf"{MAX_DEPTH} the stream can grant"):
        Channel(path, num_items=3, depth=1_000_000, check=lambda: None)
    assert not (tmp_path / "s.sock").exists()
    # The bound itself streams: 3000 small frames, all granted at once, none waiting on another.
    import torch

    n = 3000
    chan = Channel(path, num_items=n, depth=MAX_DEPTH, check=lambda: None)

    def publish():
        pub = Publisher(path)
        for i in range(n):
            pub.publish(i, torch.arange(8), torch.zeros(8, 2, 16))

    threading.Thread(target=publish, daemon=True).start()
    got = []
    reader = threading.Thread(target=lambda: got.extend(chan.next()[0][0] for _ in range(n)), daemon=True)
    reader.start()
    reader.join(30)
    chan.close()
    assert len(got) == n


def test_a_rank_refuses_a_depth_its_engines_would_refuse_before_the_group_forms():
    """Across hosts the engines' local streams get the trainer's depth: they refused it only once
    the whole group had formed and their engines were starting."""

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{s.getsockname()[1]}"
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=rf"train\.stream\.depth: {MAX_DEPTH + 1} captures in flight is more"):
        RankStream(addr, rank=0, world_size=1, num_engines=1, spec={}, sequences=[[5, 6, 7]], steps=[0],
                   depth=MAX_DEPTH + 1, timeout_s=5)
    assert time.monotonic() - t0 < 3


def test_resuming_into_a_schema_version_1_table_is_refused_before_the_engine(tmp_path, tiny_target, no_engine):
    """A capture killed under an older eaglenest (a version-1 features table, two of three samples
    missing), resumed after an upgrade: the table was reused, the engine started and captured a
    commit's worth, and only the write was refused. Refused now before the engine, as the write
    would be, naming the table and featurestore.table."""
    import lance

    rows = _rows(3)
    uri = _store(tmp_path, rows, tiny_target)
    meta = build.feature_meta(str(tiny_target), [], "auto", sample_ids=[r["sample_id"] for r in rows],
                              gen_params_ids=["g0"])
    comps = {**json.loads(meta.identity), "schema_version": 1}
    old = dataclasses.replace(meta, identity=json.dumps(comps, sort_keys=True),
                              feature_set_id=identity.identity_hash(comps))
    n, L, H = 22, len(meta.layer_ids), meta.hidden_size
    first = build.feature_row(rows[0], np.zeros((n, L, H), np.float32), np.zeros((n, H), np.float32), old)
    fields = [pa.field(f.name, f.type, nullable=f.nullable) for f in S.FEATURES_SCHEMA]
    schema = pa.schema(fields, metadata={**S.features_schema(old).metadata, b"eaglenest.schema_version": b"1"})
    lance.write_dataset(pa.Table.from_pylist([first], schema=schema), str(store.table_path(uri, store.FEATURES)),
                        schema=schema, data_storage_version="2.0")
    before = store.latest_version(uri, store.FEATURES)
    with pytest.raises(SchemaError, match=r"table 'features' is features schema version 1 .* to add rows, capture "
                                          r"into a new table \(featurestore\.table\)"):
        build.capture(target=str(tiny_target), store_uri=uri, cfg=CFG)
    assert store.latest_version(uri, store.FEATURES) == before


_StubCapturer = fs_helpers.StubCapturer


def test_a_resumed_capture_into_its_own_table_adds_only_what_is_missing(tmp_path, tiny_target, monkeypatch):
    """The pre-engine check of a reused table lets an ordinary resume through: a capture that dies
    after its first commit, re-run, adds the other two rows once each."""
    monkeypatch.setattr(build, "Capturer", _StubCapturer)
    uri = _store(tmp_path, _rows(3), tiny_target)
    cfg = FeaturestoreConfig(commit_every=1, engine=CFG.engine)
    monkeypatch.setattr(_StubCapturer, "die_after", 1)
    with pytest.raises(StoreError, match=r"died \(stub\)"):
        build.capture(target=str(tiny_target), store_uri=uri, cfg=cfg)
    assert store.sample_ids(uri, store.FEATURES) == {"s-000"}
    monkeypatch.setattr(_StubCapturer, "die_after", None)
    stats = build.capture(target=str(tiny_target), store_uri=uri, cfg=cfg)
    assert stats["captured"] == 2 and stats["target_forward_passes"] == 2
    ids = store.read(uri, store.FEATURES, columns=["sample_id"]).column("sample_id").to_pylist()
    assert sorted(ids) == ["s-000", "s-001", "s-002"]


def test_a_stream_depth_past_the_limit_is_refused_when_the_recipe_loads():
    """The same bound as the channel's, checked when the recipe loads, before a store or an engine."""
    from eaglenest.train.config import StreamConfig

    assert StreamConfig(depth=MAX_DEPTH).depth == MAX_DEPTH
    with pytest.raises(ConfigError, match=f"train.stream.depth: {MAX_DEPTH + 1} captures in flight is more than"):
        StreamConfig(depth=MAX_DEPTH + 1)


def test_a_target_config_that_is_not_json_is_one_line_naming_it(tmp_path):
    """``target_facts`` read config.json with ``json.loads`` unguarded: a truncated file was a
    JSONDecodeError traceback for any caller that did not catch it first."""
    (tmp_path / "config.json").write_text('{"hidden_size": 64, "num_hid')
    with pytest.raises(ConfigError, match=rf"run\.target: {re.escape(str(tmp_path / 'config.json'))} is not valid JSON"):
        build.target_facts(str(tmp_path))


@pytest.mark.parametrize("name", ["tekken.json", "vocab.txt", "cl100k.tiktoken"])
def test_a_changed_tokenizer_file_of_any_kind_changes_the_identity(tmp_path, name):
    """Mistral's tekken.json, a vocab.txt or a tiktoken file could change without the tokenizer's
    identity changing: a store captured with the old tokenizer was reused as if it were the same."""
    (tmp_path / "tokenizer_config.json").write_text("{}")
    before = identity.tokenizer_hashes(str(tmp_path))
    (tmp_path / name).write_text("a 1\n")
    first = identity.tokenizer_hashes(str(tmp_path))
    (tmp_path / name).write_text("a 2\n")
    assert before != first != identity.tokenizer_hashes(str(tmp_path))


def test_tokenizer_identity_of_the_usual_files_is_unchanged(tiny_target):
    """Stores captured before keep their identity: the added kinds add nothing when absent."""
    tok = hashlib.sha256()
    for name in ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt", "tokenizer_config.json",
                 "special_tokens_map.json"):
        if (tiny_target / name).is_file():
            tok.update(name.encode() + (tiny_target / name).read_bytes())
    assert identity.tokenizer_hashes(str(tiny_target))[0] == tok.hexdigest()
