"""Bringing a checked dump into a features table: one new version, all of it or nothing.

An import runs in two passes. The first reads only what is cheap (file list, headers, shapes,
dtypes, token ids, loss masks) and refuses a bad or partial dump, naming the file, before a byte is
written. The second decodes the hidden states and writes rows through
:class:`~eaglenest.featurestore.capture.writer.FeatureWriter` (fragments every
``featurestore.write_buffer_mb``, so memory stays bounded) and makes **one** commit at the end,
under the table's writer lease: a failure in between (a non-finite value, a full disk) leaves the
table at its previous version, the written fragments being uncommitted garbage for
``featurestore gc``. Trade-off: the first pass reads the small tensors twice.

The feature metadata comes from the dump when eaglenest exported it (``eaglenest_export.json``:
the original ``FeatureMeta``, so a round trip is bit-exact), else from the recipe's target and
``featurestore.layer_ids`` and the dump's own shapes and dtype.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from pathlib import Path
from typing import Iterable

import numpy as np
from tqdm import tqdm

from eaglenest.errors import ConfigError, SchemaError, StoreError
from eaglenest.featurestore import schema as S
from eaglenest.featurestore.capture.build import target_facts
from eaglenest.featurestore.capture.engine import resolve_layer_ids
from eaglenest.featurestore.capture.identity import identity_hash, weights_hash
from eaglenest.featurestore.capture.writer import FeatureWriter
from eaglenest.featurestore.interop.source import EXPORT_RECORD, SAMPLES, STRING_COLUMNS
from eaglenest.featurestore.table import lease, store
from eaglenest.provenance import code_version

log = logging.getLogger(__name__)

_DTYPES = {"torch.bfloat16": "bfloat16", "torch.float16": "float16", "torch.float32": "float32"}


def dtype_of(tensor, where: str) -> str:
    name = _DTYPES.get(str(tensor.dtype))
    if name is None:
        raise SchemaError(f"{where}: hidden states are {tensor.dtype}; eaglenest stores bfloat16, float16 or "
                          "float32")
    return name


def read_record(src: Path) -> tuple[dict | None, dict[int, dict]]:
    """The dump's ``eaglenest_export.json`` and per-index sample lines (empty for a foreign dump)."""
    rec_path, lines_path = src / EXPORT_RECORD, src / SAMPLES
    record = json.loads(rec_path.read_text()) if rec_path.is_file() else None
    samples: dict[int, dict] = {}
    if lines_path.is_file():
        for line in lines_path.read_text().splitlines():
            if line.strip():
                d = json.loads(line)
                samples[int(d["index"])] = d
    return record, samples


def string_columns(samples: dict[int, dict], index: int, input_ids: np.ndarray, *, domain: str,
                   source: str) -> dict:
    """The row's string columns: as exported by eaglenest, else ``<domain>-<sha256 of the token ids>``
    (the shape of eaglenest's own content-hash ids) and the dump file as ``source``."""
    if index in samples:
        return {k: samples[index][k] for k in STRING_COLUMNS}
    digest = hashlib.sha256(np.ascontiguousarray(input_ids, dtype="<i4").tobytes()).hexdigest()[:16]
    return {"sample_id": f"{domain}-{digest}", "domain": domain, "source": source, "split": "train",
            "mode": "chat", "gen_params_id": ""}


def check_ids(ids: list[tuple[str, str]], existing: set[str], name: str) -> None:
    """Refuse a sample id twice in the dump or already in the table, naming the files."""
    seen: dict[str, str] = {}
    for sid, where in ids:
        if sid in seen:
            raise StoreError(f"{where}: sample id {sid} is also {seen[sid]} (duplicate samples in the dump); "
                             "nothing was imported")
        if sid in existing:
            raise StoreError(f"{where}: sample id {sid} is already in table '{name}'; import into a new "
                             "table (featurestore.table=NAME); nothing was imported")
        seen[sid] = where


def check_target(record: dict | None, target: str, *, off_policy: bool) -> None:
    """A dump that records its target's weights hash must match ``run.target`` (when local)."""
    comps = json.loads((record or {}).get("feature_meta", {}).get("identity") or "{}")
    have = comps.get("weights_sha256")
    if not have or not Path(target).is_dir():
        return
    want = weights_hash(target)
    if have != want:
        msg = (f"the dump was captured from target {comps.get('target')} (weights sha256 {have[:12]}), not "
               f"run.target {target} ({want[:12]})")
        if not off_policy:
            raise StoreError(msg + "; set run.target to that target, or run.off_policy=true")
        log.warning("%s; importing anyway (run.off_policy=true)", msg)


def import_meta(*, fmt: str, target: str, layer_ids, n_aux: int, hidden: int, dtype: str, ids: list[str],
                dump_digest: str, trust_remote_code: bool = False) -> S.FeatureMeta:
    """Feature metadata for a foreign dump: the target's shapes, checked against the dump's."""
    facts = target_facts(target, trust_remote_code=trust_remote_code)
    layer_ids = resolve_layer_ids(layer_ids, facts["num_layers"])
    if len(layer_ids) != n_aux:
        raise SchemaError(f"the dump holds {n_aux} aux layers, featurestore.layer_ids gives {len(layer_ids)} "
                          f"({list(layer_ids)}, vLLM convention); set featurestore.layer_ids to the dump's layers")
    if hidden != facts["hidden_size"]:
        raise SchemaError(f"the dump's hidden size is {hidden}, run.target {target} has {facts['hidden_size']}: "
                          "set run.target to the dump's target")
    comps = {"target": str(target), "weights_sha256": weights_hash(target), "layer_ids": list(layer_ids),
             "last_layer_id": facts["num_layers"], "capture_point": f"import:{fmt}",
             "prompt_pool": hashlib.sha256("\n".join(sorted(ids)).encode()).hexdigest(), "dump": dump_digest,
             "dtype": dtype, "storage": "raw", "schema_version": S.SCHEMA_VERSION}
    return S.FeatureMeta(target=str(target), layer_ids=tuple(layer_ids), last_layer_id=facts["num_layers"],
                         hidden_size=hidden, dtype=dtype, storage="raw", feature_set_id=identity_hash(comps),
                         identity=json.dumps(comps, sort_keys=True))


def dump_digest(files: list[Path], root: Path) -> str:
    """sha256 over the dump's (relative path, size) list: names the dump in the identity."""
    h = hashlib.sha256()
    for p in files:
        h.update(f"{p.relative_to(root)}\0{p.stat().st_size}\n".encode())
    return h.hexdigest()


def feature_row(strings: dict, input_ids: np.ndarray, loss_mask: np.ndarray, aux, last, meta: S.FeatureMeta,
                where: str) -> dict:
    """One features row from decoded tensors (torch, the table dtype), refusing non-finite values."""
    import torch

    for what, t in (("aux", aux), ("last", last)):
        if not bool(torch.isfinite(t).all()):
            raise SchemaError(f"{where}: {what} hidden states hold NaN or inf; nothing was imported")
    return {**strings, "num_tokens": int(len(input_ids)), "num_loss_tokens": int(loss_mask.sum()),
            "input_ids": input_ids.astype(np.int32), "loss_mask": loss_mask.astype(np.uint8),
            "aux_hidden": S.encode_value(S.to_numpy(aux.contiguous()), meta),
            "last_hidden": S.encode_value(S.to_numpy(last.contiguous()), meta)}


def commit_rows(uri: str, name: str, meta: S.FeatureMeta, rows: Iterable[dict], *, total: int,
                lineage: dict, budget_bytes: int, desc: str) -> int:
    """Write ``rows`` as fragments and commit them once, under the writer lease; the new version."""
    with lease.hold(uri, name, purpose="featurestore import", wait_s=lease.MAINTENANCE_WAIT_S):
        if store.exists(uri, name):
            have = S.feature_meta(store.dataset(uri, name).schema)
            if have != meta:
                raise SchemaError(f"table '{name}' holds another feature set ({have.feature_set_id}, layers "
                                  f"{list(have.layer_ids)}, {have.dtype}) than the dump ({meta.feature_set_id}, "
                                  f"layers {list(meta.layer_ids)}, {meta.dtype}); import into a new table "
                                  "(featurestore.table=NAME)")
        writer = FeatureWriter(uri, name, meta, budget=budget_bytes)
        for row in tqdm(rows, total=total, desc=desc, unit="sample"):
            writer.add(row)
        version = writer.commit({**lineage, "code_version": code_version(), "feature_set_id": meta.feature_set_id})
    if version is None:
        raise StoreError("the dump holds no samples; nothing was imported")
    return version


def require_dir(src: str | Path, fmt: str) -> Path:
    src = Path(src)
    if not src.is_dir():
        raise ConfigError(f"--src {src}: not a directory (a {fmt} hidden-state dump)")
    return src


def as_raw(meta: S.FeatureMeta, fmt: str) -> S.FeatureMeta:
    """An exported ``fp8_e4m3`` table comes back dequantized: stored ``raw``, a feature set of its own."""
    if meta.storage == "raw":
        return meta
    comps = {**meta.identity_components, "storage": "raw", "capture_point": f"import:{fmt}"}
    return dataclasses.replace(meta, storage="raw", feature_set_id=identity_hash(comps),
                               identity=json.dumps(comps, sort_keys=True))
