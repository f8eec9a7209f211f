"""SpecForge's offline EAGLE-3 features, out of and into the store (SpecForge 0.2.0).

The layout ``scripts/prepare_hidden_states.py`` writes and ``OfflineManifestReader`` /
``OfflineEagle3Dataset`` read (any ``*.ckpt`` / ``*.ckpt.gz`` under the directory)::

    DIR/rows_<g>-<g+2000>/data_<i>.ckpt     torch.save of {input_ids int64 [T], loss_mask int64 [T],
                                            hidden_state [1, T, H], aux_hidden_state [1, T, n_aux * H]}
    DIR/vocab_mapping.pt                    torch.save of {"d2t": int64 [N], "t2d": bool [V]}
                                            (``model.vocab_mapping_path``)

Two conventions differ from eaglenest's and are converted here:

* ``hidden_state`` is SGLang's logits-processor input: the last layer **after** the target's final
  RMSNorm (SpecForge's ``TargetHead`` applies only ``lm_head``). Export applies the final norm
  (the target's ``model.norm.weight`` and ``rms_norm_eps``, in float32, cast once); import divides by
  the norm weight, which gives a tensor whose final norm is the dump's (RMSNorm is scale-invariant),
  equal logits up to ``eps`` and rounding, not the original bytes. An eaglenest export also stores the
  unnormed tensor as ``eaglenest_last_hidden`` (ignored by SpecForge), so its import is bit-exact.
* Layer ids: SpecForge names the aux layers ``[1, L//2-1, L-4]`` (``aux_hidden_state_layer_ids``;
  SGLang captures the input of layer id+1): eaglenest's vLLM id ``j`` is SpecForge's ``j - 1``.

Trade-off: ``.ckpt`` files are pickles; import reads them with ``torch.load(weights_only=True)``
(tensors and plain containers only, no code), memory-mapped so pass 1 reads no hidden states.
"""

from __future__ import annotations

import gzip
import io
import os
import re
import zipfile
from pathlib import Path

import numpy as np
from tqdm import tqdm

from eaglenest.errors import ConfigError, SchemaError, StoreError
from eaglenest.featurestore.interop import sink
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
from eaglenest.target import (ZERO_CENTRED_NORM, language_config, local_dir, open_weights, read_config,
                              weight_files)

FORMAT = "specforge"
GROUP = 2000  # files per rows_<g>-<g+GROUP> folder, as prepare_hidden_states.py
KEYS = ("input_ids", "loss_mask", "hidden_state", "aux_hidden_state")
PRENORM_KEY = "eaglenest_last_hidden"
_NORM_KEYS = ("model.norm.weight", "model.language_model.norm.weight", "language_model.model.norm.weight")


def _rel(i: int) -> str:
    g = i // GROUP * GROUP
    return f"rows_{g}-{g + GROUP}/data_{i}.ckpt"


def final_norm(target: str, key: str = ""):
    """(weight float32 [H], eps) of the target's final RMSNorm, read from its safetensors (1 + the stored
    weight for a zero-centred norm: ``target.ZERO_CENTRED_NORM``)."""
    root = local_dir(target)
    cfg = language_config(read_config(root))
    if str(cfg.get("model_type", "")).startswith("gemma"):
        raise ConfigError(f"run.target: {target} is a Gemma model: its final norm scales by (1 + weight), which "
                          "the SpecForge conversion does not model")
    files = weight_files(root, why="; SpecForge's hidden_state is after the target's final norm, which needs "
                                   "its weight")
    name = key or next((k for k in _NORM_KEYS if k in files), "")
    if name not in files:
        raise ConfigError(f"run.target: cannot find the final norm in {target} (tried {', '.join(_NORM_KEYS)}); "
                          "name it with run.target_keys.norm")
    with open_weights(files[name]) as f:
        weight = f.get_tensor(name).float()
    if str(cfg.get("model_type")) in ZERO_CENTRED_NORM:  # its norm scales by (1 + weight)
        weight = weight + 1.0
    eps = cfg.get("rms_norm_eps", 1e-6)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise ConfigError(f"run.target: {target}'s config has rms_norm_eps {eps!r}, expected a positive number")
    return weight, float(eps)


def check_norm(weight, hidden: int, target: str, owner: str) -> None:
    """The final norm's weight is one value per hidden unit: another tensor (``run.target_keys.norm``
    naming the embedding, another model) is refused in one line, not broadcast or failed on mid-way."""
    if tuple(weight.shape) != (hidden,):
        raise SchemaError(f"run.target {target}: final norm of shape {list(weight.shape)}, the {owner}'s hidden "
                          f"size is {hidden}: is it the {owner}'s target (and run.target_keys.norm its final norm)?")


def apply_norm(last, weight, eps: float):
    """The target's final RMSNorm of ``last`` [T, H], in float32, cast once to ``last``'s dtype."""
    x = last.float()
    return (x * (x.pow(2).mean(-1, keepdim=True) + eps).rsqrt() * weight).to(last.dtype)


def export(src: Source, out: str | Path, *, draft_vocab_size: int | None = None, target: str | None = None,
           norm_key: str = "", config: dict | None = None) -> dict:
    """Write ``src`` in SpecForge's offline layout at ``out`` (module docstring); the export record."""
    import torch

    if 0 in src.meta.layer_ids:
        raise SchemaError("layer id 0 (the embedding output) has no SpecForge name (its ids are vLLM id - 1)")
    target = target or src.meta.target
    weight, eps = final_norm(target, norm_key)
    check_norm(weight, src.meta.hidden_size, target, "table")
    vocab = target_vocab_size(target) if draft_vocab_size else None
    if vocab is not None:
        check_draft_vocab(draft_vocab_size, vocab)  # before a file is written
    width = len(src.meta.layer_ids) * src.meta.hidden_size
    with staged_export(src, out, purpose="featurestore export") as tmp:
        with open(tmp / SAMPLES, "w") as lines:
            for i, row in enumerate(tqdm(iter_samples(src), total=src.rows, desc="specforge features",
                                         unit="sample")):
                T = row["num_tokens"]
                path = tmp / _rel(i)
                path.parent.mkdir(exist_ok=True)
                save_torch({"input_ids": torch.from_numpy(row["input_ids"].astype(np.int64)),
                            "loss_mask": torch.from_numpy(row["loss_mask"].astype(np.int64)),
                            "hidden_state": apply_norm(row["last"], weight, eps).unsqueeze(0),
                            "aux_hidden_state": row["aux"].reshape(T, width).unsqueeze(0).contiguous(),
                            PRENORM_KEY: row["last"].unsqueeze(0)}, path)
                lines.write(sample_line(i, _rel(i), row))
        mapping = None
        if vocab is not None:
            d2t, t2d = vocab_mapping(loss_token_counts(src), draft_vocab_size, vocab)
            save_torch({"d2t": torch.from_numpy(d2t), "t2d": torch.from_numpy(t2d)}, tmp / "vocab_mapping.pt")
            mapping = {"draft_vocab_size": draft_vocab_size, "target_vocab_size": vocab, "file": "vocab_mapping.pt"}
        record = export_record(src, FORMAT, vocab_mapping=mapping, final_norm={"target": str(target), "eps": eps},
                               specforge_aux_hidden_state_layer_ids=[i - 1 for i in src.meta.layer_ids])
        finish_export(tmp, src, record, config=config)
    return record


# --- import ---------------------------------------------------------------------------------------

def _walk(src: Path) -> list[Path]:
    """Every ``.ckpt`` / ``.ckpt.gz`` under ``src``, through folders that are symbolic links too (a dump
    stitched from several disks; ``rglob`` skipped them without a word), each real folder once."""
    found, seen = [], set()
    for root, dirs, names in os.walk(src, followlinks=True):
        real = os.path.realpath(root)
        if real in seen:  # a link back to a folder already walked (a cycle, or two links to one folder)
            dirs.clear()
            continue
        seen.add(real)
        # a dangling link (a file never downloaded) is a feature file that does not open, not no file
        found += [Path(root) / n for n in names if n.endswith((".ckpt", ".ckpt.gz"))]
    return sorted(found)


def _files(src: Path) -> list[tuple[int, Path]]:
    """(index, path) of every feature file, by index (``data_<i>``; others after, by path)."""
    found = _walk(src)
    out, seen = [], {}
    for n, p in enumerate(found):
        _check_utf8_name(p)
        m = re.fullmatch(r"data_(\d+)\.ckpt(\.gz)?", p.name)
        i = int(m.group(1)) if m else 10**12 + n
        if i in seen:
            raise StoreError(f"{p}: sample index {i} is also {seen[i]}; nothing was imported")
        seen[i] = p
        out.append((i, p))
    if not out:
        raise StoreError(f"--src {src}: no .ckpt or .ckpt.gz feature files under it")
    return sorted(out)


def _check_utf8_name(path: Path) -> None:
    """Refuse a feature file whose path is not UTF-8 (Python holds the bad bytes as lone surrogates,
    which torch cannot open and no message or table column can hold), naming it with the bytes escaped."""
    raw = os.fsencode(path)
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise StoreError(f"{raw.decode('utf-8', 'backslashreplace')}: the file's path is not UTF-8 (byte "
                         f"0x{raw[exc.start]:02x}); rename it; nothing was imported") from None


def _why(exc: Exception, path: Path) -> str:
    """Why a feature file did not load, in a few words: an empty file (a copy cut off before its first
    byte) says so, where torch's EOFError says nothing."""
    if path.is_file() and path.stat().st_size == 0:
        return "the file is empty, 0 bytes: a partial copy?"
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}" if str(exc) else type(exc).__name__


def _load(path: Path) -> dict:
    import torch

    try:
        if path.name.endswith(".gz"):
            with gzip.open(path, "rb") as f:
                data = torch.load(io.BytesIO(f.read()), map_location="cpu", weights_only=True)
        else:  # torch.save's zip format is memory-mapped; the legacy format (not a zip) cannot be
            data = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except Exception as exc:  # torch raises many kinds (pickle, zip, EOF) for a bad file
        raise StoreError(f"{path}: unreadable feature file ({_why(exc, path)}); nothing was imported") from None
    if not isinstance(data, dict):
        raise SchemaError(f"{path}: holds a {type(data).__name__}, expected a dict of tensors")
    return data


def _parts(data: dict, where: str, vocab: int | None) -> tuple:
    """(input_ids int64 numpy [T], loss_mask [T], hidden_state [T, H], aux [T, n*H], eaglenest_last_hidden
    [T, H] or None) of one file, checked: tensors, integer token ids in the vocabulary, ``T > 0``, shapes
    and dtypes (pass 1 refuses a bad file with this before anything is written)."""
    import torch

    missing = [k for k in KEYS if k not in data]
    if missing:
        raise SchemaError(f"{where}: missing key(s) {missing} (SpecForge files hold {list(KEYS)})")
    for k in KEYS + ((PRENORM_KEY,) if PRENORM_KEY in data else ()):
        if not isinstance(data[k], torch.Tensor):
            raise SchemaError(f"{where}: key '{k}' holds a {type(data[k]).__name__}, expected a tensor")
    ids, mask = data["input_ids"].reshape(-1), data["loss_mask"].reshape(-1)
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise SchemaError(f"{where}: key 'input_ids' is {ids.dtype}, expected integer token ids")
    tok = sink.check_tokens(ids.numpy(), vocab, where)
    hs, aux = data["hidden_state"], data["aux_hidden_state"]
    hs = hs[0] if hs.dim() == 3 and hs.shape[0] == 1 else hs
    aux = aux[0] if aux.dim() == 3 and aux.shape[0] == 1 else aux
    T = len(tok)
    if hs.dim() != 2 or hs.shape[0] != T or aux.dim() != 2 or aux.shape[0] != T or mask.numel() != T:
        raise SchemaError(f"{where}: shapes input_ids {list(ids.shape)}, loss_mask {list(mask.shape)}, hidden_state "
                          f"{list(data['hidden_state'].shape)}, aux_hidden_state {list(data['aux_hidden_state'].shape)}"
                          f"; expected [T], [T], [1, T, H], [1, T, n_aux * H]")
    H = hs.shape[1]
    if H == 0 or aux.shape[1] % H or aux.shape[1] == 0:
        raise SchemaError(f"{where}: aux_hidden_state width {aux.shape[1]} is not a multiple of H = {H}")
    sink.dtype_of(hs, where)
    if aux.dtype != hs.dtype:
        raise SchemaError(f"{where}: aux_hidden_state is {aux.dtype}, hidden_state {hs.dtype}")
    if mask.dtype.is_complex or not bool(((mask == 0) | (mask == 1)).all()):
        raise SchemaError(f"{where}: loss_mask holds values other than 0/1")
    pre = data.get(PRENORM_KEY)
    if pre is not None:
        pre = pre[0] if pre.dim() == 3 and pre.shape[0] == 1 else pre
        if tuple(pre.shape) != (T, H):
            raise SchemaError(f"{where}: key '{PRENORM_KEY}' has shape {list(data[PRENORM_KEY].shape)}, expected "
                              f"[1, {T}, {H}] (as hidden_state)")
        if pre.dtype != hs.dtype:
            raise SchemaError(f"{where}: key '{PRENORM_KEY}' is {pre.dtype}, hidden_state {hs.dtype}")
    return tok, mask.to(torch.uint8).numpy(), hs, aux, pre


def _check_complete(files: list[tuple[int, Path]], record: dict | None, samples: dict, src: Path) -> None:
    """An eaglenest export lists its files (``eaglenest_samples.jsonl``) and rows: a partial copy is refused."""
    have = {i: p.relative_to(src).as_posix() for i, p in files}
    listed = sorted(samples.items())
    missing = [d["file"] for i, d in listed if have.get(i) not in (d["file"], d["file"] + ".gz")]
    if missing:
        raise StoreError(f"--src {src}: {len(missing)} of {len(listed)} files listed in {SAMPLES} are missing "
                         f"(first: {missing[0]}; a partial copy?); nothing was imported")
    extra = [p for i, p in have.items() if samples and i not in samples]
    if extra:
        raise StoreError(f"{src / extra[0]}: not listed in {SAMPLES} (files of another dump?); nothing was imported")
    sink.check_rows(record, samples, len(files), src, "feature files")


def import_dump(src_dir: str | Path, uri: str, name: str, *, target: str, layer_ids=(), domain: str = "imported",
                norm_key: str = "", off_policy: bool = False, budget_bytes: int = 128 << 20,
                trust_remote_code: bool = False, storage: str = "raw") -> dict:
    """Bring a SpecForge feature directory (module docstring) into table ``name`` as one new version."""
    sink.check_table(name)
    sink.check_domain(domain, "--domain")
    sink.check_storage(storage)
    if 0 in tuple(layer_ids or ()):
        raise ConfigError("featurestore.layer_ids: layer id 0 (the embedding output) has no SpecForge name (its aux "
                          "layers are vLLM ids >= 1, SpecForge's id + 1); give the dump's layers")
    src = sink.require_dir(src_dir, FORMAT)
    record, samples = sink.read_record(src, FORMAT)
    sink.check_target(record, target, off_policy=off_policy)
    sink.check_width(record, target, trust_remote_code=trust_remote_code)
    files = _files(src)
    _check_complete(files, record, samples, src)
    vocab = sink.target_vocab(target, record, trust_remote_code=trust_remote_code)
    first, ids, prenorm = None, [], True
    for i, path in tqdm(files, desc="checking specforge dump", unit="sample"):
        tok, _, hs, aux, pre = _parts(_load(path), str(path), vocab)
        shape = (aux.shape[1] // hs.shape[1], hs.shape[1], sink.dtype_of(hs, str(path)))
        if first is None:
            first = shape
        elif shape != first:
            raise SchemaError(f"{path}: [n_aux, H, dtype] = {list(shape)}, the dump's first file has {list(first)}; "
                              "nothing was imported")
        prenorm = prenorm and pre is not None
        strings = sink.string_columns(samples, i, tok, domain=domain, source=f"{FORMAT}:{path.relative_to(src)}")
        ids.append((strings["sample_id"], str(path)))
    sink.check_ids(ids, store.sample_ids(uri, name), name)
    n_aux, H, dtype = first
    if record is not None:
        meta = sink.as_raw(sink.record_meta(record, src / EXPORT_RECORD), FORMAT)
        if (len(meta.layer_ids), meta.hidden_size, meta.dtype) != (n_aux, H, dtype):
            raise SchemaError(f"--src {src}: files hold [n_aux, H, dtype] = {[n_aux, H, dtype]}, but "
                              f"{EXPORT_RECORD} says {[len(meta.layer_ids), meta.hidden_size, meta.dtype]}")
    else:
        meta = sink.import_meta(fmt=FORMAT, target=target, layer_ids=layer_ids, n_aux=n_aux, hidden=H, dtype=dtype,
                                ids=[s for s, _ in ids], dump_digest=sink.dump_digest([p for _, p in files], src),
                                trust_remote_code=trust_remote_code)
    if 0 in meta.layer_ids:
        raise ConfigError("featurestore.layer_ids: layer id 0 (the embedding output) has no SpecForge name; give the "
                          "dump's layers (vLLM ids >= 1)")
    weight = None if prenorm else final_norm(target, norm_key)[0]
    if weight is not None:
        check_norm(weight, meta.hidden_size, target, "dump")
    if weight is not None and not bool((weight != 0).all()):
        raise SchemaError(f"run.target {target}: its final norm weight has zeros; the unnormed last hidden state "
                          "cannot be recovered from SpecForge's hidden_state")
    version = sink.commit_rows(uri, name, meta, _rows(files, src, samples, domain, meta, weight, vocab),
                               total=len(files), lineage={
                                   "imported_from": str(src.resolve()), "format": FORMAT,
                                   "last_hidden": "exact" if prenorm else "hidden_state / final norm weight",
                                   "export_of": None if record is None else {
                                       k: record.get(k) for k in ("table", "table_version", "feature_set_id")}},
                               budget_bytes=budget_bytes, desc="importing specforge dump", ids=ids)
    return {"table": name, "version": version, "rows": len(files), "feature_set_id": meta.feature_set_id,
            "layer_ids": list(meta.layer_ids), "dtype": meta.dtype, "last_hidden_exact": prenorm}


def _rows(files, src: Path, samples: dict, domain: str, meta, weight, vocab):
    for i, path in files:
        tok, mask, hs, aux, pre = _parts(_load(path), str(path), vocab)
        T = len(tok)
        if weight is None:
            last = pre
        else:  # RMSNorm(hs / w) * w == hs up to eps: a scaled copy of the unnormed state (module docstring)
            last = (hs.float() / weight).to(hs.dtype)
        strings = sink.string_columns(samples, i, tok, domain=domain, source=f"{FORMAT}:{path.relative_to(src)}")
        yield sink.feature_row(strings, tok, mask, aux.reshape(T, len(meta.layer_ids), meta.hidden_size), last, meta,
                               str(path))
