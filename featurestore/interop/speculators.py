"""speculators' offline training data, out of and into the store (speculators 0.9.0).

The layout speculators' trainer reads (``speculators.train.data.ArrowDataset`` with its default
``hs_connectors.FileTransfer``; files made by ``speculators prepare-data`` and
``generate-offline-data``)::

    DIR/                       a datasets ``save_to_disk`` directory, torch format, one row per
                               sample: input_ids (int64 list), loss_mask (int64 list), seq_len
    DIR/hidden_states/hs_<i>.safetensors
                               sample i: token_ids int64 [T] and hidden_states [T, n_aux + 1, H]
                               (vLLM's extract_hidden_states: the aux layers in order, then the last
                               layer, before the final norm), in the target dtype; hs_connectors'
                               FP8 connector writes float8_e4m3fn with hidden_states_scales
                               float32 [T, 1, 1], which import dequantizes to bfloat16 as its
                               FP8Transfer does (export writes the table dtype)
    DIR/token_freq.pt          {token id: count} over loss tokens (``save_token_frequency_distribution``)
    DIR/d2t-<N>.npy, t2d-<N>.npy   the draft vocabulary for ``--draft-vocab-size N`` (train/cli.py
                               ``parse_vocab_mappings`` picks them up from the data path)

Layer ids: speculators uses vLLM's convention (``target_layer_ids``, default ``[2, n//2, n-3]``,
models/utils.py), the same as eaglenest, so ``layer_ids_vllm`` in ``eaglenest_export.json`` is what
``--target-layer-ids`` takes. eaglenest's ``last_hidden`` is vLLM layer ``L``: the same tensor.
Trade-off: ``token_freq.pt`` is a pickle (``torch.save``) because that is what speculators reads;
import never loads it (it only reads safetensors and Arrow).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from tqdm import tqdm

from eaglenest.errors import SchemaError, StoreError
from eaglenest.featurestore.interop import hf, sink
from eaglenest.featurestore.interop.source import (
    EXPORT_RECORD,
    SAMPLES,
    Source,
    check_draft_vocab,
    export_record,
    finish_export,
    iter_samples,
    loss_token_counts,
    sample_line,
    save_torch,
    staged_export,
    target_vocab_size,
    vocab_mapping,
)
from eaglenest.featurestore.table import store

FORMAT = "speculators"
HS_DIR = "hidden_states"
#: hs_connectors' ``FP8HiddenStatesConnector`` stores ``hidden_states`` as float8_e4m3fn with this
#: per-token float32 scale ``[T, 1, 1]`` (``hs_connectors/fp8_utils.py``).
FP8_SCALES = "hidden_states_scales"


def _hs_name(i: int) -> str:
    return f"{HS_DIR}/hs_{i}.safetensors"


def _token_rows(src: Source):
    for row in iter_samples(src, tensors=False):
        yield {"input_ids": row["input_ids"].astype(np.int64), "loss_mask": row["loss_mask"].astype(np.int64),
               "seq_len": int(row["num_tokens"])}


def export(src: Source, out: str | Path, *, draft_vocab_size: int | None = None, target: str | None = None,
           config: dict | None = None) -> dict:
    """Write ``src`` in speculators' layout at ``out`` (module docstring); returns the export record."""
    import datasets
    import torch
    from safetensors.torch import save_file

    vocab = target_vocab_size(target or src.meta.target) if draft_vocab_size else None
    if vocab is not None:
        check_draft_vocab(draft_vocab_size, vocab)  # before a file is written
    with staged_export(src, out, purpose="featurestore export") as tmp:
        (tmp / HS_DIR).mkdir()
        with open(tmp / SAMPLES, "w") as lines:
            for i, row in enumerate(tqdm(iter_samples(src), total=src.rows, desc="speculators hidden states",
                                         unit="sample")):
                hidden = torch.cat([row["aux"], row["last"][:, None, :]], dim=1).contiguous()
                ids = torch.from_numpy(row["input_ids"].astype(np.int64))
                save_file({"token_ids": ids, "hidden_states": hidden}, str(tmp / _hs_name(i)),
                          metadata={"eaglenest_sample_id": row["sample_id"]})
                lines.write(sample_line(i, _hs_name(i), row))
        features = datasets.Features({"input_ids": datasets.List(datasets.Value("int64")),
                                      "loss_mask": datasets.List(datasets.Value("int64")),
                                      "seq_len": datasets.Value("int64")})
        fingerprint = f"eaglenest-{src.meta.feature_set_id}-{src.version}"
        if src.rows:
            ds = datasets.Dataset.from_generator(_token_rows, features=features, gen_kwargs={"src": src},
                                                 cache_dir=str(tmp / ".hf_cache"), writer_batch_size=1000,
                                                 fingerprint=fingerprint)
            ds.set_format("torch")
            ds.save_to_disk(str(tmp))
            del ds
            shutil.rmtree(tmp / ".hf_cache", ignore_errors=True)
        else:  # an empty version: save_to_disk writes no shard (load_from_disk then fails); hf's writer
            # gives one empty shard, a loadable empty dataset, as the hf and specforge exports do
            hf.write_dataset_dir(iter(()), features, tmp, max_shard_size="500MB", writer_batch_size=1000,
                                 fingerprint=fingerprint)
            state = json.loads((tmp / "state.json").read_text())
            (tmp / "state.json").write_text(json.dumps({**state, "_format_type": "torch"}, indent=2, sort_keys=True))
        counts = loss_token_counts(src)
        save_torch(counts, tmp / "token_freq.pt")
        mapping = None
        if vocab is not None:
            d2t, t2d = vocab_mapping(counts, draft_vocab_size, vocab)
            np.save(tmp / f"d2t-{draft_vocab_size}.npy", d2t)
            np.save(tmp / f"t2d-{draft_vocab_size}.npy", t2d)
            mapping = {"draft_vocab_size": draft_vocab_size, "target_vocab_size": vocab,
                       "d2t": f"d2t-{draft_vocab_size}.npy", "t2d": f"t2d-{draft_vocab_size}.npy"}
        record = export_record(src, FORMAT, vocab_mapping=mapping, hidden_states_layers_vllm=[
            *src.meta.layer_ids, src.meta.last_layer_id], speculators_target_layer_ids=list(src.meta.layer_ids))
        finish_export(tmp, src, record, config=config)
    return record


# --- import ---------------------------------------------------------------------------------------

def _check_header(path: Path, T: int, where: str) -> tuple:
    """(n_aux, H, dtype, token_ids) of one hs file, from its header (no hidden-state bytes read)."""
    from safetensors import safe_open

    if not path.is_file():
        raise StoreError(f"{where}: missing (a partial dump?); nothing was imported")
    try:
        with safe_open(str(path), framework="pt") as f:
            keys = set(f.keys())
            if not {"token_ids", "hidden_states"} <= keys:
                raise SchemaError(f"{where}: holds {sorted(keys)}, expected token_ids and hidden_states")
            hs = f.get_slice("hidden_states")
            shape, dtype = tuple(hs.get_shape()), hs.get_dtype()
            scales = f.get_slice(FP8_SCALES) if FP8_SCALES in keys else None
            scales = None if scales is None else (scales.get_dtype(), list(scales.get_shape()))
            token_ids = f.get_tensor("token_ids")
            if token_ids.dtype.is_floating_point or token_ids.dtype.is_complex:
                raise SchemaError(f"{where}: token_ids are {token_ids.dtype}, expected integer token ids")
    except SchemaError:
        raise
    except Exception as exc:  # safetensors' own header errors (SafetensorError), I/O errors
        raise StoreError(f"{where}: unreadable safetensors file ({str(exc).splitlines()[0][:200]}); "
                         "nothing was imported") from None
    if len(shape) != 3 or shape[0] != T or shape[1] < 2:
        raise SchemaError(f"{where}: hidden_states shape {list(shape)}, expected [{T}, n_aux + 1, H] "
                          f"({T} tokens in the dataset row)")
    if scales is not None or dtype == "F8_E4M3":  # FP8HiddenStatesConnector's file: dequantized on import
        if dtype != "F8_E4M3" or scales != ("F32", [T, 1, 1]):
            raise SchemaError(f"{where}: hidden_states {dtype} with {FP8_SCALES} {scales}, expected F8_E4M3 with "
                              f"F32 [{T}, 1, 1] (one scale per token, as hs_connectors' FP8 connector writes)")
        return shape[1] - 1, shape[2], "bfloat16", token_ids
    names = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
    if dtype not in names:
        raise SchemaError(f"{where}: hidden states are {dtype}; eaglenest stores BF16, F16 or F32 (or F8_E4M3 with "
                          f"{FP8_SCALES}, dequantized)")
    return shape[1] - 1, shape[2], names[dtype], token_ids


def _hidden_states(path: Path):
    """One file's ``hidden_states``; an FP8 file dequantized as hs_connectors' ``FP8Transfer`` does by
    default (``fp8.to(bfloat16) * scale.to(bfloat16)``): the tensor speculators' trainer would read."""
    import torch
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    hs = tensors["hidden_states"]
    if FP8_SCALES in tensors:
        hs = hs.to(torch.bfloat16) * tensors[FP8_SCALES].to(torch.bfloat16)
    return hs


def import_dump(src_dir: str | Path, uri: str, name: str, *, target: str, layer_ids=(), domain: str = "imported",
                off_policy: bool = False, budget_bytes: int = 128 << 20, trust_remote_code: bool = False,
                storage: str = "raw") -> dict:
    """Bring a speculators data directory (module docstring) into table ``name`` as one new version."""
    import datasets

    sink.check_table(name)
    sink.check_domain(domain, "--domain")
    sink.check_storage(storage)
    src = sink.require_dir(src_dir, FORMAT)
    record, samples = sink.read_record(src, FORMAT)  # first: an export of another format is named as such
    try:
        data = datasets.load_from_disk(str(src)).with_format(None)
    except (FileNotFoundError, ValueError, OSError, IndexError, KeyError, TypeError, AttributeError) as exc:
        # datasets' kinds, for a directory that is not its own or holds JSON of the wrong shape
        if isinstance(exc, IndexError) and _no_data_files(src):  # save_to_disk of an empty dataset
            raise StoreError(f"--src {src}: the dump holds no samples; nothing was imported") from None
        text = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise StoreError(f"--src {src}: not a datasets save_to_disk directory ({text}); speculators keeps "
                         f"input_ids and loss_mask there{_parquet_hint(src)}") from None
    if not isinstance(data, datasets.Dataset):
        raise SchemaError(f"--src {src}: holds a {type(data).__name__}, expected one dataset (speculators' layout)")
    missing = {"input_ids", "loss_mask"} - set(data.column_names)
    if missing:
        raise SchemaError(f"--src {src}: the dataset lacks column(s) {sorted(missing)}")
    if len(data) == 0:
        raise StoreError(f"--src {src}: the dump holds no samples; nothing was imported")
    sink.check_target(record, target, off_policy=off_policy)
    sink.check_width(record, target, trust_remote_code=trust_remote_code)
    sink.check_rows(record, samples, len(data), src, "dataset rows")
    _check_listed(samples, len(data), src)
    vocab = sink.target_vocab(target, record, trust_remote_code=trust_remote_code)
    # Pass 1: every file present, readable, shaped and typed alike, token ids equal to the row's.
    first, ids, files = None, [], []
    for i in tqdm(range(len(data)), desc="checking speculators dump", unit="sample"):
        row, where = data[i], f"{src / _hs_name(i)}"
        input_ids = sink.check_tokens(row["input_ids"], vocab, f"{src}: dataset row {i}")
        mask = np.asarray(row["loss_mask"])
        n_aux, H, dtype, token_ids = _check_header(src / _hs_name(i), len(input_ids), where)
        if token_ids.shape != input_ids.shape or not np.array_equal(token_ids.numpy(), input_ids):
            raise SchemaError(f"{where}: token_ids differ from the dataset row {i}'s input_ids")
        if mask.shape != input_ids.shape or mask.dtype.kind not in "biuf" or not np.isin(mask, (0, 1)).all():
            raise SchemaError(f"{src}: dataset row {i}: loss_mask must be {len(input_ids)} values of 0/1")
        if first is None:
            first = (n_aux, H, dtype)
        elif (n_aux, H, dtype) != first:
            raise SchemaError(f"{where}: [n_aux, H, dtype] = {[n_aux, H, dtype]}, the dump's first file has "
                              f"{list(first)}; nothing was imported")
        strings = sink.string_columns(samples, i, input_ids, domain=domain, source=f"{FORMAT}:{_hs_name(i)}")
        ids.append((strings["sample_id"], where))
        files.append(src / _hs_name(i))
    sink.check_ids(ids, store.sample_ids(uri, name), name)
    n_aux, H, dtype = first
    meta = _meta(record, n_aux, H, dtype, target, layer_ids, [s for s, _ in ids], files, src, trust_remote_code)
    version = sink.commit_rows(uri, name, meta, _rows(data, src, samples, domain, meta, vocab), total=len(data),
                               lineage={"imported_from": str(src.resolve()), "format": FORMAT,
                                        "export_of": _export_of(record)},
                               budget_bytes=budget_bytes, desc="importing speculators dump", ids=ids)
    return {"table": name, "version": version, "rows": len(data), "feature_set_id": meta.feature_set_id,
            "layer_ids": list(meta.layer_ids), "dtype": meta.dtype}


def _check_listed(samples: dict[int, dict], rows: int, src: Path) -> None:
    """Each sample line (an eaglenest export's) names a row of the dataset and that row's file: a line
    naming another row would leave a row without its sample id, source and split."""
    for i, d in sorted(samples.items()):
        if i >= rows:
            raise SchemaError(f"{src / SAMPLES}: sample index {i} is not a row of the dataset (0..{rows - 1})")
        if d["file"] != _hs_name(i):
            raise SchemaError(f"{src / SAMPLES}: sample index {i} names file {d['file']!r}, expected "
                              f"{_hs_name(i)!r}")


def _parquet_hint(src: Path) -> str:
    """What to do with a dataset pushed to the Hub (parquet shards, as ``snapshot_download`` fetches it)
    instead of saved with ``save_to_disk``: rows i and ``hs_<i>`` pair up only in one known order."""
    shards = sorted(src.glob("*.parquet")) or sorted(src.glob("data/*.parquet"))
    if not shards:
        return ""
    where = shards[0].parent.relative_to(src) / "*.parquet"
    return (f"; it holds parquet shards ({where}: a dataset pushed to the Hub): load them with "
            "datasets.load_dataset('parquet', data_files=..., split='train') and save_to_disk the result into --src")


def _no_data_files(src: Path) -> bool:
    try:
        return json.loads((src / "state.json").read_text()).get("_data_files") == []
    except (OSError, ValueError, AttributeError):
        return False


def _meta(record, n_aux, H, dtype, target, layer_ids, ids, files, src, trust_remote_code):
    if record is not None:
        meta = sink.record_meta(record, src / EXPORT_RECORD)
        if (len(meta.layer_ids), meta.hidden_size, meta.dtype) != (n_aux, H, dtype):
            raise SchemaError(f"--src {src}: files hold [n_aux, H, dtype] = {[n_aux, H, dtype]}, but "
                              f"{EXPORT_RECORD} says {[len(meta.layer_ids), meta.hidden_size, meta.dtype]}")
        return sink.as_raw(meta, FORMAT)
    return sink.import_meta(fmt=FORMAT, target=target, layer_ids=layer_ids, n_aux=n_aux, hidden=H, dtype=dtype,
                            ids=ids, dump_digest=sink.dump_digest(files, src), trust_remote_code=trust_remote_code)


def _export_of(record: dict | None):
    return None if record is None else {k: record.get(k) for k in ("table", "table_version", "feature_set_id")}


def _rows(data, src: Path, samples: dict, domain: str, meta, vocab):
    for i in range(len(data)):
        row = data[i]
        input_ids = sink.check_tokens(row["input_ids"], vocab, f"{src}: dataset row {i}")
        hs = _hidden_states(src / _hs_name(i))
        strings = sink.string_columns(samples, i, input_ids, domain=domain, source=f"{FORMAT}:{_hs_name(i)}")
        yield sink.feature_row(strings, input_ids, np.asarray(row["loss_mask"], dtype=np.uint8), hs[:, :-1],
                               hs[:, -1], meta, str(src / _hs_name(i)))
