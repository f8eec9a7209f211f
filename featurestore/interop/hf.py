"""A features table version as a Hugging Face ``datasets`` directory (``datasets.load_from_disk``).

Columns: the row's string columns, ``num_tokens``, ``num_loss_tokens``, ``input_ids`` (int32
list), ``loss_mask`` (uint8 list) and, with ``with_tensors``, ``aux_hidden``
(``Array3D(shape=(None, n_aux, H))``) and ``last_hidden`` (``Array2D(shape=(None, H))``). float32
and float16 tables keep their dtype bit for bit; bfloat16 (which Arrow has no type for) is widened
to float32, exactly (every bf16 value is a float32; narrowing back gives the same bits);
``fp8_e4m3`` tables are dequantized to float32. ``eaglenest_export.json`` records which.

Streaming: ``Dataset.from_generator`` over Lance batches of a few rows, written by datasets in
batches of ``writer_batch_size`` rows to Arrow files in a scratch cache inside the export, then
``save_to_disk`` (shards of ``max_shard_size``) and the cache removed. Memory stays at a few rows;
the price is a second copy on disk while the export runs.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from tqdm import tqdm

from eaglenest.featurestore.interop.source import (
    STRING_COLUMNS,
    Source,
    export_record,
    finish_export,
    iter_samples,
    staged_export,
)

FORMAT = "hf"


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


def export(src: Source, out: str | Path, *, with_tensors: bool = False, max_shard_size: str = "500MB",
           config: dict | None = None) -> dict:
    """Write ``src`` as a ``datasets`` directory at ``out``; returns the export record."""
    import datasets

    with staged_export(src, out, purpose="featurestore export") as tmp:
        cache = tmp / ".hf_cache"
        ds = datasets.Dataset.from_generator(
            _rows, features=features(src, with_tensors=with_tensors), cache_dir=str(cache),
            gen_kwargs={"src": src, "with_tensors": with_tensors}, writer_batch_size=8 if with_tensors else 1000,
            fingerprint=f"eaglenest-{src.meta.feature_set_id}-{src.version}-{int(with_tensors)}")
        ds.save_to_disk(str(tmp), max_shard_size=max_shard_size)
        del ds
        shutil.rmtree(cache, ignore_errors=True)
        record = export_record(src, FORMAT, with_tensors=with_tensors,
                               tensor_dtype=_tensor_dtype(src) if with_tensors else None)
        finish_export(tmp, src, record, config=config)
    return record
