"""A features table version as a Hugging Face ``datasets`` directory (``datasets.load_from_disk``).

Columns: the row's string columns, ``num_tokens``, ``num_loss_tokens``, ``input_ids`` (int32
list), ``loss_mask`` (uint8 list) and, with ``with_tensors``, ``aux_hidden``
(``Array3D(shape=(None, n_aux, H))``) and ``last_hidden`` (``Array2D(shape=(None, H))``). float32
and float16 tables keep their dtype bit for bit; bfloat16 (which Arrow has no type for) is widened
to float32, exactly (every bf16 value is a float32; narrowing back gives the same bits);
``fp8_e4m3`` tables are dequantized to float32. ``eaglenest_export.json`` records which.

Streaming: rows come from Lance a few at a time and go straight into the directory's Arrow shards
through datasets' own ``ArrowWriter`` (``writer_batch_size`` rows per record batch: 1 with tensors),
a new shard past ``max_shard_size``; then the two small files ``load_from_disk`` reads
(``dataset_info.json``, from datasets' ``DatasetInfo``, and ``state.json``, the shard list). Memory
stays at a few rows whatever the table's size, and the export is written once. (The obvious route,
``Dataset.from_generator`` then ``save_to_disk``, holds ~100 MB batches in memory while it copies
its cache into the shards, and needs the table twice on disk: measured, and refused.) A row too long
for an ``Array3D`` value (int32 offsets: :data:`MAX_ARRAY_VALUES`) is refused before anything is written.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
from tqdm import tqdm

from eaglenest.errors import StoreError
from eaglenest.featurestore.interop.source import (
    STRING_COLUMNS,
    TOKEN_BATCH_ROWS,
    Source,
    export_record,
    finish_export,
    iter_samples,
    staged_export,
)
from eaglenest.featurestore.table import store

FORMAT = "hf"
#: Arrow list arrays address their values with int32 offsets, and datasets builds an ``Array3D`` value's
#: offsets as int32 (``numpy_to_pyarrow_listarray``): one row's ``aux_hidden`` (T x n_aux x H values, a
#: record batch of its own) holds at most this many, or the writer fails on that row, mid-export.
MAX_ARRAY_VALUES = (1 << 31) - 1


def _tensor_dtype(src: Source) -> str:
    return src.meta.dtype if src.meta.storage == "raw" and src.meta.dtype != "bfloat16" else "float32"


def features(src: Source, *, with_tensors: bool):
    import datasets

    cols = {k: datasets.Value("string") for k in STRING_COLUMNS}
    cols.update({"num_tokens": datasets.Value("int32"), "num_loss_tokens": datasets.Value("int32"),
                 "input_ids": datasets.List(datasets.Value("int32")),
                 "loss_mask": datasets.List(datasets.Value("uint8"))})
    if with_tensors:
        n, H, dt = len(src.meta.layer_ids), src.meta.hidden_size, _tensor_dtype(src)
        cols["aux_hidden"] = datasets.Array3D(shape=(None, n, H), dtype=dt)
        cols["last_hidden"] = datasets.Array2D(shape=(None, H), dtype=dt)
    return datasets.Features(cols)


def _rows(src: Source, with_tensors: bool):
    import torch

    dt = {"float32": torch.float32, "float16": torch.float16}[_tensor_dtype(src)]
    for row in tqdm(iter_samples(src, tensors=with_tensors), total=src.rows, desc="hf export", unit="sample"):
        out = {k: row[k] for k in STRING_COLUMNS + ("num_tokens", "num_loss_tokens", "input_ids", "loss_mask")}
        if with_tensors:
            out["aux_hidden"] = row["aux"].to(dt).numpy()
            out["last_hidden"] = row["last"].to(dt).numpy()
        yield out


def check_row_sizes(src: Source) -> None:
    """Refuse, before anything is written, a version whose longest row's ``aux_hidden`` would not fit an
    ``Array3D`` value (:data:`MAX_ARRAY_VALUES`), naming the row (token counts only are read)."""
    width = len(src.meta.layer_ids) * src.meta.hidden_size
    for batch in store.iter_batches(src.uri, src.name, version=src.version, columns=["sample_id", "num_tokens"],
                                    batch_size=TOKEN_BATCH_ROWS):
        tokens = batch.column("num_tokens").to_numpy(zero_copy_only=False).astype(np.int64)
        over = np.flatnonzero(tokens * width > MAX_ARRAY_VALUES)
        if over.size:
            i = int(over[0])
            raise StoreError(f"sample {batch.column('sample_id')[i].as_py()}: {tokens[i]} tokens x {width} aux values "
                             f"= {tokens[i] * width}, over the {MAX_ARRAY_VALUES} a datasets Array3D row holds (int32 "
                             "offsets); export it without --with-tensors, or as speculators (one file a sample)")


def _shard_bytes(max_shard_size: str | int) -> int:
    from datasets.utils.py_utils import convert_file_size_to_int

    return convert_file_size_to_int(max_shard_size)


def _row_bytes(row: dict) -> int:
    """About what ``row`` takes in Arrow (arrays by their bytes, lists at 4 bytes an item)."""
    return sum(v.nbytes if hasattr(v, "nbytes") else 4 * len(v) if isinstance(v, (list, tuple)) else
               len(str(v)) for v in row.values())


def write_dataset_dir(rows, feats, out: Path, *, max_shard_size: str | int, writer_batch_size: int,
                      fingerprint: str) -> int:
    """Write ``rows`` (dicts matching ``feats``) as a ``datasets.load_from_disk`` directory at ``out``;
    returns the number of rows."""
    import datasets
    from datasets.arrow_writer import ArrowWriter

    limit, parts, writer, total, size = _shard_bytes(max_shard_size), [], None, 0, 0

    def close() -> None:
        if writer is not None:
            writer.finalize()
            writer.close()

    for row in rows:
        if writer is None or size >= limit:
            close()
            parts.append(out / f"part-{len(parts):05d}.arrow")
            writer, size = ArrowWriter(features=feats, path=str(parts[-1]), writer_batch_size=writer_batch_size), 0
        writer.write(row)
        total += 1
        size += _row_bytes(row)
    if writer is None:  # an empty table still gives a loadable (empty) dataset
        parts.append(out / "part-00000.arrow")
        writer = ArrowWriter(features=feats, path=str(parts[-1]), writer_batch_size=writer_batch_size)
    close()
    names = [f"data-{i:05d}-of-{len(parts):05d}.arrow" for i in range(len(parts))]
    for part, name in zip(parts, names):
        part.rename(out / name)
    datasets.DatasetInfo(features=feats).write_to_directory(str(out))
    state = {"_data_files": [{"filename": n} for n in names], "_fingerprint": fingerprint, "_format_columns": None,
             "_format_kwargs": {}, "_format_type": None, "_output_all_columns": False, "_split": None}
    (out / "state.json").write_text(json.dumps(state, indent=2, sort_keys=True))
    return total


def export(src: Source, out: str | Path, *, with_tensors: bool = False, max_shard_size: str = "500MB",
           config: dict | None = None) -> dict:
    """Write ``src`` as a ``datasets`` directory at ``out``; returns the export record."""
    if with_tensors:
        check_row_sizes(src)
    with staged_export(src, out, purpose="featurestore export") as tmp:
        key = f"eaglenest-{src.meta.feature_set_id}-{src.version}-{int(with_tensors)}"
        write_dataset_dir(_rows(src, with_tensors), features(src, with_tensors=with_tensors), tmp,
                          max_shard_size=max_shard_size, writer_batch_size=1 if with_tensors else 1000,
                          fingerprint=hashlib.sha256(key.encode()).hexdigest()[:16])
        record = export_record(src, FORMAT, with_tensors=with_tensors,
                               tensor_dtype=_tensor_dtype(src) if with_tensors else None)
        finish_export(tmp, src, record, config=config)
    return record
