"""Reading one features table version for an export, one sample at a time, and the export's frame.

Every export streams the version through Lance record batches of a few rows (a sample's hidden
states are tens of MB at real shapes), so memory stays at a few samples whatever the table size;
the version is pinned for the whole export (``featurestore gc`` keeps it). The output directory
is built beside its final place and renamed into it only when complete, so a killed export never
leaves a directory that looks finished. Trade-off: the export needs the free space of one copy
next to ``--out`` (a rename does not cross file systems).

Also here: the draft vocabulary the peers' trainers take (``d2t`` / ``t2d``), computed with
eaglenest's rule (docs/training.md; the same as speculators' ``build_vocab_mappings_from_distribution``):
the ``draft_vocab_size`` most frequent loss-token ids, ties by the smaller id, the smallest unseen
ids filling the rest; ``d2t[i] = draft_ids[i] - i`` (int64), ``t2d`` bool over the target vocabulary.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import io
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import numpy as np
from safetensors import SafetensorError

from eaglenest.config import short
from eaglenest.errors import ConfigError, StoreError
from eaglenest.featurestore import schema as S
from eaglenest.featurestore.table import integrity, lease, objects, store
from eaglenest.paths import orphans, pid_prefix, shown_path, user_path
from eaglenest.provenance import write_json_atomic, write_provenance
from eaglenest.target import language_config, read_config

log = logging.getLogger(__name__)

#: Written beside every export: the table version, feature set and layer ids it holds.
EXPORT_RECORD = "eaglenest_export.json"
#: One JSON line per exported sample (index, file, the row's string columns): what import restores.
SAMPLES = "eaglenest_samples.jsonl"
STRING_COLUMNS = ("sample_id", "domain", "source", "split", "mode", "gen_params_id")
TOKEN_COLUMNS = ("num_tokens", "num_loss_tokens", "input_ids", "loss_mask")
#: Lance rows per batch: with tensor columns one sample at a time (one read ahead), so memory is a
#: few samples whatever the table's size; token columns only, many.
BATCH_ROWS = 1
TOKEN_BATCH_ROWS = 256


@dataclasses.dataclass(frozen=True)
class Source:
    """One features table version, opened and validated."""

    uri: str
    name: str
    version: int
    meta: S.FeatureMeta
    rows: int


def open_source(uri: str, name: str, version: int | str | None = None) -> Source:
    if not store.is_features(name):
        raise StoreError(f"table '{name}' holds prompts, not features: export featurestore.table")
    # Exports feed other trainers: every data file of the version is held to its CRC first (one stat
    # per file once stamped), so a damaged store is refused with one line, not copied out.
    ds = integrity.checked_dataset(uri, name, version)
    return Source(uri, name, ds.version, S.feature_meta(ds.schema), ds.count_rows())


def torch_dtype(name: str):
    import torch

    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


def decode(blob, shape: tuple[int, ...], meta: S.FeatureMeta):
    """A stored value as a torch tensor of the table dtype: bit-exact for ``raw``; ``fp8_e4m3``
    values are dequantized (lossy at capture, docs/formats.md) and cast to the table dtype."""
    if meta.storage == "fp8_e4m3":
        return S.decode_fp8(blob, shape).to(torch_dtype(meta.dtype))
    return S.torch_from_blob(blob, shape, meta.dtype)


def iter_samples(src: Source, *, tensors: bool = True) -> Iterator[dict]:
    """Rows of the version in table order: string columns, ``input_ids`` (int32 numpy),
    ``loss_mask`` (uint8 numpy), counts, and (``tensors``) ``aux`` [T, n, H] / ``last`` [T, H]."""
    cols = list(STRING_COLUMNS + TOKEN_COLUMNS) + (list(S.TENSOR_COLUMNS) if tensors else [])
    n_aux, hidden = len(src.meta.layer_ids), src.meta.hidden_size
    for batch in store.iter_batches(src.uri, src.name, version=src.version, columns=cols,
                                    batch_size=BATCH_ROWS if tensors else TOKEN_BATCH_ROWS, bounded=tensors):
        c = {name: batch.column(name) for name in cols}
        for i in range(batch.num_rows):
            row = {k: c[k][i].as_py() for k in STRING_COLUMNS + ("num_tokens", "num_loss_tokens")}
            row["input_ids"] = c["input_ids"][i].values.to_numpy(zero_copy_only=False).astype(np.int32)
            row["loss_mask"] = c["loss_mask"][i].values.to_numpy(zero_copy_only=False).astype(np.uint8)
            if tensors:
                T = row["num_tokens"]
                row["aux"] = decode(c["aux_hidden"][i].as_buffer(), (T, n_aux, hidden), src.meta)
                row["last"] = decode(c["last_hidden"][i].as_buffer(), (T, hidden), src.meta)
            yield row


def loss_token_counts(src: Source) -> dict[int, int]:
    """{token id: count} over the loss-masked tokens of the version (token columns only)."""
    counts: collections.Counter = collections.Counter()
    for row in iter_samples(src, tensors=False):
        ids, n = np.unique(row["input_ids"][row["loss_mask"].astype(bool)], return_counts=True)
        counts.update(dict(zip(ids.tolist(), n.tolist())))
    return dict(counts)


#: Token ids are int32 in a features table: a larger vocabulary is no target's (and its ``t2d`` would not fit).
MAX_VOCAB = 1 << 31


def target_vocab_size(target: str) -> int:
    try:
        vocab = language_config(read_config(target))["vocab_size"]
    except (ConfigError, KeyError, TypeError, ValueError):
        raise ConfigError(f"run.target: {target} has no readable config.json with vocab_size; the vocabulary "
                          "mapping needs the target's vocabulary size (set run.target to the local target)") from None
    if isinstance(vocab, bool) or not isinstance(vocab, int) or not 0 < vocab <= MAX_VOCAB:
        raise ConfigError(f"run.target: {target}'s config has vocab_size {short(vocab)}, expected a positive integer "
                          f"up to {MAX_VOCAB} (token ids are int32); the vocabulary mapping is over it")
    return vocab


def check_draft_vocab(draft_vocab_size: int, target_vocab: int) -> None:
    """Called before an export writes anything (and again by :func:`vocab_mapping`)."""
    if not 0 < draft_vocab_size <= target_vocab:
        raise ConfigError(f"--draft-vocab-size (default train.draft_vocab_size): {draft_vocab_size} must be in "
                          f"1..{target_vocab} (the target's vocabulary size), or 0 for no vocabulary mapping")


def vocab_mapping(counts: dict[int, int], draft_vocab_size: int, target_vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """``(d2t int64 [draft_vocab_size], t2d bool [target_vocab])`` by eaglenest's rule (module docstring)."""
    check_draft_vocab(draft_vocab_size, target_vocab)
    bad = [t for t in (min(counts, default=0), max(counts, default=0)) if not 0 <= t < target_vocab]
    if bad:
        raise StoreError(f"token id {bad[0]} is outside the target's vocabulary 0..{target_vocab - 1}: "
                         "is run.target the table's target?")
    ranked = sorted(counts, key=lambda t: (-counts[t], t))[:draft_vocab_size]
    chosen = set(ranked)
    fill = (t for t in range(target_vocab) if t not in chosen)
    while len(ranked) < draft_vocab_size:
        ranked.append(next(fill))
    draft_ids = np.sort(np.asarray(ranked, dtype=np.int64))
    t2d = np.zeros(target_vocab, dtype=bool)
    t2d[draft_ids] = True
    return draft_ids - np.arange(draft_vocab_size, dtype=np.int64), t2d


def inside_store(path: str | Path, store_uri: str) -> bool:
    """Whether ``path`` is a local store's folder or lies inside it (a Lance table's folder, say)."""
    if objects.is_remote(store_uri):
        return False
    return Path(path).resolve().is_relative_to(Path(objects.local(store_uri)).resolve())


def check_out(out: Path, store_uri: str) -> None:
    """``out`` must be a new or empty directory outside a local store (not a Lance table's folder), not
    a dangling symbolic link nor a mount point (the export would be refused only once written)."""
    if inside_store(out, store_uri):
        raise ConfigError(f"--out {out}: inside the feature store ({store_uri}); give a directory outside it")
    if out.is_symlink() and not out.exists():
        raise ConfigError(f"--out {out}: a symbolic link to {os.readlink(out)}, which does not exist; give a new "
                          "directory")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: is a file; give a new directory")
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"--out {out}: exists and is not an empty directory; give a new directory")
    if out.is_dir() and os.path.ismount(out.resolve()):  # a container's volume: the final rename would fail
        raise ConfigError(f"--out {out}: a mount point; give a new directory inside it (the export is built "
                          "beside --out and renamed into place)")


def sweep_partials(out: Path) -> None:
    """Remove what killed exports to ``out`` left beside it (``.<out>.partial-<pid>-*`` of a pid that is gone)."""
    for stale in orphans(out.parent, f".{out.name}.partial-"):
        shutil.rmtree(stale, ignore_errors=True)
        log.info("removed %s, left by a killed export", shown_path(stale))


@contextlib.contextmanager
def staged_export(src: Source, out: str | Path, *, purpose: str) -> Iterator[Path]:
    """A fresh directory to build the export in, renamed to ``out`` when the block succeeds (removed
    when it fails); the source version is pinned meanwhile. ``out`` must not exist or be empty; a
    symbolic link to an empty directory is followed (the export is built beside and renamed onto that)."""
    if not str(out).strip():  # an unset shell variable: Path('') would be the working directory
        raise ConfigError("--out is empty; give a new directory")
    out = user_path(out, "--out", error=ConfigError, resolve=False)  # a name too long, a NUL, a loop: one line
    check_out(out, src.uri)
    if out.is_symlink():
        out = out.resolve()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        sweep_partials(out)
        tmp = Path(tempfile.mkdtemp(prefix=pid_prefix(f".{out.name}.partial-"), dir=out.parent))
    except OSError as exc:
        raise ConfigError(f"--out {out}: cannot create it ({exc.strerror or exc})") from None
    try:
        with lease.pin(src.uri, src.name, src.version, purpose=purpose):
            # A gc between the open (open_source) and the pin may have removed the version: opened again by its
            # number, it is now either kept for the export or named garbage-collected in one line, before the
            # export starts (as train's FeatureShards does).
            store.dataset(src.uri, src.name, src.version)
            yield tmp
        if out.exists():
            out.rmdir()
        os.rename(tmp, out)
    except (OSError, SafetensorError) as exc:  # safetensors' writer reports a full disk as its own error
        text = getattr(exc, "strerror", None) or (str(exc).splitlines() or [type(exc).__name__])[0][:200]
        raise StoreError(f"--out {out}: writing the export failed ({text}); nothing was left at --out") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def save_torch(obj, path: Path) -> None:
    """``torch.save`` of ``obj`` at ``path``, a write error (a full disk) raised as the ``OSError`` it is:
    torch's own file writer reports one as a ``RuntimeError`` without the cause ("iostream error"), so
    the file is serialized in memory (one sample's tensors) and written by Python."""
    import torch

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    with open(path, "wb") as f:
        f.write(buffer.getbuffer())


def export_record(src: Source, fmt: str, **extra) -> dict:
    """What an export holds: the table version (its provenance), feature set, layer ids and format."""
    return {
        "format": fmt, "store": src.uri, "table": src.name, "table_version": src.version, "rows": src.rows,
        "feature_set_id": src.meta.feature_set_id, "target": src.meta.target,
        "layer_ids_vllm": list(src.meta.layer_ids), "last_layer_id": src.meta.last_layer_id,
        "hidden_size": src.meta.hidden_size, "dtype": src.meta.dtype, "storage": src.meta.storage,
        "feature_meta": json.loads(src.meta.to_json()), **extra,
    }


def finish_export(tmp: Path, src: Source, record: dict, *, config: dict | None) -> None:
    """``eaglenest_export.json`` and ``provenance.json`` (naming the table version) in the export."""
    write_json_atomic(tmp / EXPORT_RECORD, record)
    write_provenance(tmp, config=config or {}, inputs={
        "store": src.uri, "table": src.name, "table_version": src.version,
        "feature_set_id": src.meta.feature_set_id}, extra={"export": {"format": record["format"]}})


def sample_line(index: int, path: str, row: dict) -> str:
    return json.dumps({"index": index, "file": path, **{k: row[k] for k in STRING_COLUMNS}}, sort_keys=True) + "\n"
