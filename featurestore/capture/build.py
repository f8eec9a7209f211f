"""``featurestore capture``: run the target over the on-policy conversations, store hidden states.

Reads the ``prompts`` table's training rows, sends prompt + response token ids through a capture
engine, and appends rows to ``features`` in atomic chunks. Resumable like ingest: ids already in the
features table are skipped, and no engine starts when nothing is left to capture.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import shutil
import time
from pathlib import Path

from tqdm import tqdm

from eaglenest import faults, memfit
from eaglenest.config import short, short_text
from eaglenest.errors import ConfigError, SchemaError, StoreError
from eaglenest.featurestore import schema as S
from eaglenest.featurestore.capture import identity, policy, turns
from eaglenest.featurestore.capture.engine import Capturer, resolve_layer_ids
from eaglenest.featurestore.capture.writer import FeatureWriter, bytes_per_token, captured_bytes_per_token
from eaglenest.featurestore.schema import dtype_name
from eaglenest.featurestore.table import fragments, lease, objects, store
from eaglenest.hf import load_config, load_tokenizer
from eaglenest.provenance import code_version
from eaglenest.target import language_config, max_positions, read_config

log = logging.getLogger(__name__)

_DTYPE_ALIASES = {"float32": "float32", "fp32": "float32", "float": "float32", "bfloat16": "bfloat16",
                  "bf16": "bfloat16", "float16": "float16", "fp16": "float16", "half": "float16"}


def target_facts(target: str, *, trust_remote_code: bool = False, key: str = "run.target") -> dict:
    """num_hidden_layers, hidden_size, dtype and vocab_size (None if absent) from a local target's
    config.json (or the hub cache)."""
    path = Path(target) / "config.json"
    if path.is_file():
        cfg = language_config(read_config(target, key=key))  # a multimodal wrapper's text_config; not JSON: one line
    else:
        cfg = language_config(load_config(target, trust_remote_code=trust_remote_code, key=key).to_dict())
    dtype = str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16")
    return {"num_layers": _size(cfg, "num_hidden_layers", target, key),
            "hidden_size": _size(cfg, "hidden_size", target, key),
            "dtype": _DTYPE_ALIASES.get(dtype.replace("torch.", ""), "bfloat16"), "vocab_size": cfg.get("vocab_size")}


def _size(cfg: dict, name: str, target: str, key: str = "run.target") -> int:
    """A positive integer of the target's config (the layer count, the width), or one line naming it."""
    value = cfg.get(name)
    if isinstance(value, bool) or not isinstance(value, (int, str)) or not str(value).isdecimal() or int(value) < 1:
        raise ConfigError(f"{key}: {target}'s config has no {name} (a positive integer; got {short(value)}): "
                          "capture needs a decoder's layer count and hidden size")
    return int(value)


def feature_meta(target: str, layer_ids: list[int], engine_dtype: str, *, storage: str = "raw",
                 sample_ids=(), gen_params_ids=(), trust_remote_code: bool = False) -> S.FeatureMeta:
    """The feature set's metadata, its identity hash over everything that shapes the tensors."""
    facts = target_facts(target, trust_remote_code=trust_remote_code)
    ids = resolve_layer_ids(layer_ids, facts["num_layers"])
    if list(ids) != sorted(ids):  # vLLM hands a capture's aux layers over in layer order, whatever order it was given
        raise ConfigError(f"featurestore.layer_ids: {list(ids)} is not ascending; vLLM captures the aux layers in "
                          f"layer order, so the table would name them wrongly: give {sorted(ids)}")
    dtype = facts["dtype"] if engine_dtype == "auto" else _DTYPE_ALIASES.get(engine_dtype, engine_dtype)
    comps = identity.components(target=target, layer_ids=ids, last_layer_id=facts["num_layers"], dtype=dtype,
                                storage=storage, sample_ids=sample_ids, gen_params_ids=gen_params_ids)
    return S.FeatureMeta(target=str(target), layer_ids=ids, last_layer_id=facts["num_layers"],
                         hidden_size=facts["hidden_size"], dtype=dtype, storage=storage,
                         feature_set_id=identity.identity_hash(comps), identity=json.dumps(comps, sort_keys=True))


def pool_conversations(store_uri: str) -> list[dict]:
    """Training rows of the prompts table that have a response: the pool a feature set covers."""
    rows = store.read(store_uri, store.PROMPTS, filter="split = 'train' AND finish_reason != ''").to_pylist()
    return sorted(rows, key=lambda r: r["sample_id"])


def settled_pool(store_uri: str) -> list[dict]:
    """:func:`pool_conversations`, read under the prompts table's writer lease: an ``ingest build``
    still writing it is named (one line, after ``lease.MAINTENANCE_WAIT_S``). The pool is part of
    the feature set's identity, so a capture of half an ingest's pool could never be extended."""
    with lease.hold(store_uri, store.PROMPTS, purpose="featurestore capture", wait_s=lease.MAINTENANCE_WAIT_S):
        return pool_conversations(store_uri)


def pending_conversations(store_uri: str, table: str = store.FEATURES) -> list[dict]:
    """Pool rows with no features yet in ``table``, by id."""
    done = store.sample_ids(store_uri, table)
    return [r for r in pool_conversations(store_uri) if r["sample_id"] not in done]


def check_reuse(store_uri: str, table: str, meta: S.FeatureMeta, pool_ids=()) -> S.FeatureMeta | None:
    """The table's meta when ``table`` already holds this feature set (None: no table yet, or one a
    capture stopped before its first commit left empty, now removed); refuses a different one, naming
    the keys. A table of an older, still readable schema version whose identity differs only in
    ``schema_version`` holds the same tensors: it is reused as is (read only: adding rows to it is
    refused by ``fragments.check_identity``). So is a table captured before a component of
    :data:`identity.ADDED` existed, same otherwise (its rows are added to)."""
    if not store.exists(store_uri, table):
        return None
    try:
        ds = store.dataset(store_uri, table)
        have = S.feature_meta(ds.schema)
    except SchemaError as exc:  # a table of another kind under that name: the key to change, not a column
        raise StoreError(f"featurestore.table: table '{table}' in {store_uri} is not a features table ({exc}); "
                         "set featurestore.table to another name") from None
    if have.feature_set_id == meta.feature_set_id:
        return have
    have_comps = have.identity_components
    # A component added since the table was captured (identity.ADDED) is no difference: it was not recorded.
    want = {k: v for k, v in meta.identity_components.items() if k in have_comps or k not in identity.ADDED} \
        if have_comps else meta.identity_components
    if have_comps:  # hashed before added_tokens.json, chat_template.json, ... counted: the same tokenization
        old = identity.legacy_tokenization(str(meta.identity_components.get("target", "")))
        want.update({k: old[k] for k in ("tokenizer_sha256", "chat_template_sha256") if have_comps.get(k) == old[k]})
    if have_comps and identity.identity_hash(want) == have.feature_set_id:
        added = [k for k in identity.ADDED if k not in have_comps and k in meta.identity_components]
        # A hub id's revision that was not recorded is unknown: said as a warning (the weights may differ).
        (log.warning if "target_revision" in added else log.info)(
            "table '%s' was captured before %s joined the feature set's identity: reused", table,
            ", ".join(added) or "more tokenizer files")
        return have
    diff = identity.differences(have_comps, want) or ["feature_set_id"]
    diff = [_pool_change(store_uri, table, pool_ids) if d.startswith("prompt_pool") else d for d in diff]
    if [d for d in diff if not d.startswith("schema_version")] == [] and \
            S.schema_version(ds.schema) in S.READABLE_VERSIONS:
        log.info("table '%s' is features schema version %s (same feature set otherwise): reused",
                 table, S.schema_version(ds.schema))
        return have
    if _never_committed(store_uri, ds):  # what a capture stopped before its first commit left: no rows to keep
        log.warning("table '%s' in %s holds no row (a capture of feature set %s stopped before its first commit "
                    "created it): replaced by this capture's (%s)", table, store_uri, have.feature_set_id,
                    "; ".join(diff))
        shutil.rmtree(store.table_path(store_uri, table))
        return None
    raise StoreError(f"table '{table}' holds feature set {have.feature_set_id}, this capture is "
                     f"{meta.feature_set_id}: differs in {'; '.join(diff)}. Set featurestore.table to a new "
                     "name (or restore those keys)")


def _never_committed(store_uri: str, ds) -> bool:
    """Whether a local table is only the empty first version its first data files create (``write_fragment``),
    no commit since: a capture killed (or failed) before its first commit leaves it, holding no feature set's
    rows. Called under the table's writer lease, so no live writer is writing into it; an object store has no
    lease, and such a table there is kept (refused as any other feature set's)."""
    return not objects.is_remote(store_uri) and ds.count_rows() == 0 and len(ds.versions()) == 1


def _pool_change(store_uri: str, table: str, pool_ids) -> str:
    """The ``prompt_pool`` difference, saying how the pool and the table's rows disagree (the
    manifest need not have changed: an ``ingest build`` resumed or extended since)."""
    pool, have = set(pool_ids), store.sample_ids(store_uri, table)
    return (f"prompt_pool (key {identity.KEYS['prompt_pool']}): {len(pool - have)} of the prompts table's "
            f"{len(pool)} training conversations are not in this table, {len(have - pool)} of its {len(have)} "
            "rows are no longer there")


def feature_row(conv: dict, aux, last, meta: S.FeatureMeta, spans=()) -> dict:
    prompt, response = conv["prompt_token_ids"], conv["response_token_ids"]
    # Loss on every token the target generated (its end-of-turn token included): the last answer and,
    # in a multi-turn conversation, the earlier answers' ``spans`` inside the prompt (featurestore/capture/turns.py).
    mask = turns.loss_mask(len(prompt), len(response), list(spans or ()))
    return {
        "sample_id": conv["sample_id"], "domain": conv["domain"], "source": conv["source"],
        "split": conv["split"], "mode": conv["mode"], "gen_params_id": conv["gen_params_id"],
        "num_tokens": len(prompt) + len(response), "num_loss_tokens": sum(mask),
        "input_ids": list(prompt) + list(response),
        "loss_mask": mask,
        # raw: the target dtype's bytes (bit-exact); fp8_e4m3: per-row scales + e4m3 codes (schema.py).
        "aux_hidden": S.encode_value(aux, meta), "last_hidden": S.encode_value(last, meta),
    }


def capture(*, target: str, store_uri: str, cfg, lineage: dict | None = None, off_policy: bool = False,
            trust_remote_code: bool = False) -> dict:
    """Capture every pool conversation not yet in ``cfg.table``; zero passes if the set exists.

    Refuses (unless ``off_policy``) when the prompts' responses were generated by another target
    than ``target`` (``featurestore/capture/policy.py``)."""
    t0 = time.time()
    name = cfg.table
    if cfg.storage not in S.STORAGES:
        raise ConfigError(f"featurestore.storage: {cfg.storage!r} is not one of {', '.join(S.STORAGES)}")
    if not store.is_features(name):  # the conversations themselves: features never go there
        raise ConfigError(f"featurestore.table: {name!r} is the store's prompts table; name a features "
                          "table (default features)")
    if not store.exists(store_uri, store.PROMPTS):
        raise StoreError(f"no prompts table in {store_uri}: run `ingest build` first")
    policy.check_prompts(store_uri, target, off_policy=off_policy, stage="featurestore capture")
    # The whole capture holds the table's writer lease: what is missing is decided once, below, and
    # stays true until the last commit (a second capture, a gc or a restore meanwhile is refused,
    # naming this one). Taken before any engine starts.
    with lease.hold(store_uri, name, purpose="featurestore capture", wait_s=5):
        return _capture(target=target, store_uri=store_uri, cfg=cfg, lineage=lineage, t0=t0,
                        trust_remote_code=trust_remote_code)


def _capture(*, target: str, store_uri: str, cfg, lineage: dict | None, t0: float,
             trust_remote_code: bool = False) -> dict:
    name = cfg.table
    pool = settled_pool(store_uri)
    if not pool:
        raise StoreError(f"the prompts table in {store_uri} has no training conversation with a response: "
                         "nothing to capture (run `ingest build`; check its failures)")
    meta = feature_meta(target, cfg.layer_ids, cfg.engine.dtype, storage=cfg.storage,
                        sample_ids=[r["sample_id"] for r in pool], gen_params_ids=[r["gen_params_id"] for r in pool],
                        trust_remote_code=trust_remote_code)
    have = check_reuse(store_uri, name, meta, [r["sample_id"] for r in pool])
    reused = have is not None
    meta = have or meta
    done = store.sample_ids(store_uri, name)
    todo = [r for r in pool if r["sample_id"] not in done]
    passes, tokens = 0, 0
    if todo:
        if reused:  # a table that takes no rows (an older schema version) is refused now, not at the first write
            fragments.check_identity(store.dataset(store_uri, name), name, meta)
        longest = check_lengths(todo, cfg.engine.max_model_len, target=target)
        check_fit(target, meta, longest, cfg.engine.dtype)  # before the engine starts
        vocab_size = target_facts(target, trust_remote_code=trust_remote_code)["vocab_size"]
        check_token_ids(todo, target, vocab_size=vocab_size, trust_remote_code=trust_remote_code)
        earlier_turns = _turn_spans(target, todo, policy.rendered_kwargs(store_uri),
                                    trust_remote_code=trust_remote_code)
        budget = max(1, int(cfg.write_buffer_mb * (1 << 20)))
        writer = FeatureWriter(store_uri, name, meta, budget=budget)
        lineage = {**(lineage or {}), "feature_set_id": meta.feature_set_id, "code_version": code_version(),
                   "bytes_per_token": bytes_per_token(meta)}
        with Capturer(target, meta.layer_ids, meta.last_layer_id, cfg.engine,
                      trust_remote_code=trust_remote_code) as cap, \
                tqdm(total=len(todo), desc="featurestore: capture", unit="sample") as bar:
            # One stream over everything missing, in order: the engine computes the next captures
            # while this process encodes, writes and commits; the window (featurestore.batch_size
            # samples, write_buffer_mb bytes) bounds what is in flight, as fixed batches did.
            seqs = [c["prompt_token_ids"] + c["response_token_ids"] for c in todo]
            results = contextlib.closing(cap.stream(seqs, max_in_flight=cfg.batch_size, budget_bytes=budget,
                                                    bytes_per_token=captured_bytes_per_token(meta)))
            with results as stream:  # closed on any error: what is still queued is aborted
                for i, (conv, (aux, last)) in enumerate(zip(todo, stream), 1):
                    if dtype_name(aux) != meta.dtype:
                        raise StoreError(f"engine produced {dtype_name(aux)}, table is {meta.dtype}: "
                                         "set featurestore.engine.dtype")
                    row = feature_row(conv, aux, last, meta, spans=earlier_turns(conv))
                    del aux, last
                    tokens += row["num_tokens"]
                    writer.add(row)
                    if i % cfg.commit_every == 0 or i == len(todo):  # the same commit boundaries as before
                        faults.delay("featurestore.before_commit")  # tests: hold the fragments-written window
                        writer.commit(lineage)
                        bar.update((i - 1) % cfg.commit_every + 1)
            passes = cap.num_forward_passes
    table = store.read(store_uri, name, columns=["domain", "num_tokens", "num_loss_tokens"]) \
        if store.exists(store_uri, name) else None
    per_domain = collections.Counter(table.column("domain").to_pylist()) if table is not None else {}
    return {
        "feature_set_id": meta.feature_set_id, "layer_ids": list(meta.layer_ids),
        "last_layer_id": meta.last_layer_id, "dtype": meta.dtype, "storage": meta.storage,
        "table": name, "reused": bool(reused and not todo),
        "captured": len(todo), "target_forward_passes": passes, "captured_tokens": tokens,
        # hidden-state bytes stored per token (aux layers + last; the encoding's own, e.g. fp8 scales)
        "bytes_per_token": bytes_per_token(meta), "captured_hidden_bytes": tokens * bytes_per_token(meta),
        "longest_sample_tokens": max((len(c["prompt_token_ids"]) + len(c["response_token_ids"]) for c in todo),
                                     default=0),
        "samples_per_domain": dict(sorted(per_domain.items())),
        "features_table_version": store.latest_version(store_uri, name) if table is not None else None,
        "seconds": round(time.time() - t0, 2),
    }


def check_fit(target: str, meta: S.FeatureMeta, tokens: int, engine_dtype: str) -> None:
    """Refuse (``memfit``) a capture whose longest conversation cannot fit memory, before the engine
    starts; a hub target (no local config) is not estimated."""
    memfit.check_engine(target, tokens=tokens, engine_dtype=engine_dtype,
                        capture_layers=len(meta.layer_ids) + 1, stored_bytes_per_token=bytes_per_token(meta),
                        key="the manifest's compose.target_tokens (or generation.max_tokens)")


def check_lengths(convs: list[dict], max_model_len: int, *, target: str | None = None) -> int:
    """The longest conversation's token count; refuses, naming the row, a conversation of no token
    (vLLM refuses an empty prompt only once its engine is up) or one the engine cannot hold with the
    one token each capture generates (``target``: named when that one token is past its positions)."""
    longest, row = 0, None
    for conv in convs:
        n = len(conv["prompt_token_ids"]) + len(conv["response_token_ids"])
        if n == 0:
            raise StoreError(f"prompts row {conv['sample_id']}: no token (empty prompt and response): the prompts "
                             "table is damaged; re-run `ingest build` into a new store")
        if n > longest:
            longest, row = n, conv["sample_id"]
    if longest + 1 > max_model_len:
        raise ConfigError(f"featurestore.engine.max_model_len: {max_model_len} is too small for prompts row {row} "
                          f"({longest} tokens; capture needs {longest + 1}): raise it"
                          + _past_positions(target, longest))
    return longest


def _past_positions(target: str | None, tokens: int) -> str:
    """What to add to the refusal when a conversation fills every position of ``target`` (ingest
    generated it up to an engine's max_model_len of all of them): vLLM refuses a max_model_len past
    them unless told, yet the one position more holds only the token capture samples, which no
    layer computes (no hidden state is taken there)."""
    if target is None or not (Path(target) / "config.json").is_file():
        return ""
    found = max_positions(read_config(target))  # a linear rotary factor counted, as vLLM (and ingest) count it
    if found is None or found[0] != tokens:
        return ""
    return (f"; {tokens + 1} is past the {tokens} positions of run.target {target}, which vLLM allows with "
            "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 in the environment: the position past them only holds the one "
            "token capture samples, never run through the model")


def check_token_ids(convs: list[dict], target: str, *, vocab_size: int | None,
                    trust_remote_code: bool = False) -> None:
    """Refuse, before the engine starts, a conversation holding a token id the target cannot take
    (tokenized for another model): vLLM refused it only once its engine was up, with a traceback.
    vLLM's bound: the larger of the model's vocabulary and the tokenizer's (which may hold more ids,
    e.g. multimodal placeholders), so the tokenizer is loaded only for an id past ``vocab_size``.
    ``vocab_size`` None (not in the config): not checked."""
    if not vocab_size:
        return
    bound = vocab_size
    for conv in convs:
        for key in ("prompt_token_ids", "response_token_ids"):
            ids = conv[key]
            if not ids:
                continue
            if max(ids) >= bound == vocab_size:
                bound = max(vocab_size, len(load_tokenizer(target, trust_remote_code=trust_remote_code)))
            if not 0 <= min(ids) <= max(ids) < bound:
                bad = next(t for t in ids if not 0 <= t < bound)
                raise StoreError(f"prompts row {conv['sample_id']}: {key} holds token id {bad}, outside the "
                                 f"vocabulary of run.target {target} (0..{bound - 1}): the conversation was "
                                 "tokenized for another model; ingest it with this target (a new store)")


def _messages(conv: dict) -> list[dict]:
    """A prompts row's ``messages_json`` as a list of message objects; a damaged one is one
    :class:`StoreError` naming the row."""
    text = conv.get("messages_json") or "[]"
    try:
        msgs = json.loads(text)
    except ValueError:
        msgs = None
    if not isinstance(msgs, list) or not all(isinstance(m, dict) for m in msgs):
        raise StoreError(f"prompts row {conv['sample_id']}: messages_json is not a JSON list of messages "
                         f"({short_text(text)}): the prompts table is damaged; re-run `ingest build` into a "
                         "new store")
    return msgs


def stop_ids(target: str) -> list[int]:
    """The token ids a local target's generation_config.json stops at (``eos_token_id``: an id or a
    list), which vLLM stops at too; none for a hub id or a file without them (ingest checked the file)."""
    path = Path(target) / "generation_config.json"
    try:
        ids = json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
    except (ValueError, OSError, AttributeError):
        return []
    ids = ids if isinstance(ids, list) else [ids]
    return [i for i in ids if isinstance(i, int) and not isinstance(i, bool)]


def _turn_spans(target: str, convs: list[dict], rendered: list[dict], *, trust_remote_code: bool = False):
    """A function conv -> loss spans of its earlier assistant turns (the tokenizer is loaded only
    when some conversation has more than one assistant turn). The template is rendered with the
    kwargs ingest recorded (``rendered``, latest first; a reasoning mode changes the tokens), the
    first that reproduces the stored prompt wins; no record: the template's defaults."""
    options = [*reversed(rendered)] + ([{}] if {} not in rendered else [])
    def multi(c: dict) -> list[dict] | None:
        """The conversation's messages if it has more than one assistant turn, else None."""
        msgs = _messages(c)
        return msgs if sum(m.get("role") == "assistant" for m in msgs) > 1 else None

    multi_turn = {c["sample_id"]: msgs for c in convs if (msgs := multi(c)) is not None}
    if not multi_turn:
        return lambda conv: ()
    tok = load_tokenizer(target, trust_remote_code=trust_remote_code)
    end_ids = stop_ids(target)
    if not tok.chat_template:  # off-policy, a base model: transformers' ValueError on each render, mid-capture
        log.warning("run.target %s has no chat template to locate earlier answers with: %d multi-turn "
                    "conversation(s) are trained on their last answer only", target, len(multi_turn))
        return lambda conv: ()

    def spans(conv: dict):
        msgs = multi_turn.get(conv["sample_id"])
        if msgs is None:
            return ()
        prompt = list(conv["prompt_token_ids"])
        found = next((f for kw in options
                      if (f := turns.assistant_spans(tok, msgs, prompt, kw, end_ids=end_ids)) is not None), None)
        if found is None:
            log.warning("%s: the chat template does not reproduce the prompt; training on the last "
                        "answer only", conv["sample_id"])
        return found or ()

    return spans
