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
import json
import re
from pathlib import Path

import numpy as np
from tqdm import tqdm

from eaglenest.errors import ConfigError, SchemaError, StoreError
from eaglenest.featurestore import schema as S
from eaglenest.featurestore.interop import sink
from eaglenest.featurestore.interop.source import (
    SAMPLES,
    Source,
    export_record,
    finish_export,
    iter_samples,
    loss_token_counts,
    sample_line,
    staged_export,
    target_vocab_size,
    vocab_mapping,
)
from eaglenest.featurestore.table import store
from eaglenest.target import language_config, read_config

FORMAT = "specforge"
GROUP = 2000  # files per rows_<g>-<g+GROUP> folder, as prepare_hidden_states.py
KEYS = ("input_ids", "loss_mask", "hidden_state", "aux_hidden_state")
PRENORM_KEY = "eaglenest_last_hidden"
_NORM_KEYS = ("model.norm.weight", "model.language_model.norm.weight", "language_model.model.norm.weight")


def _rel(i: int) -> str:
    g = i // GROUP * GROUP
    return f"rows_{g}-{g + GROUP}/data_{i}.ckpt"


def final_norm(target: str, key: str = ""):
    """(weight float32 [H], eps) of the target's final RMSNorm, read from its safetensors."""
    from safetensors import safe_open

    root = Path(target)
    cfg = language_config(read_config(root))
    if str(cfg.get("model_type", "")).startswith("gemma"):
        raise ConfigError(f"run.target: {target} is a Gemma model: its final norm scales by (1 + weight), which "
                          "the SpecForge conversion does not model")
    index = root / "model.safetensors.index.json"
    if index.is_file():
        files = {k: root / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    elif (root / "model.safetensors").is_file():
        with safe_open(str(root / "model.safetensors"), framework="pt") as f:
            files = {k: root / "model.safetensors" for k in f.keys()}
    else:
        raise ConfigError(f"run.target: {target} has no model.safetensors(.index.json); SpecForge's hidden_state "
                          "is after the target's final norm, which needs its weight")
    name = key or next((k for k in _NORM_KEYS if k in files), "")
    if name not in files:
        raise ConfigError(f"run.target: cannot find the final norm in {target} (tried {', '.join(_NORM_KEYS)}); "
                          "name it with run.target_keys.norm")
    with safe_open(str(files[name]), framework="pt") as f:
        weight = f.get_tensor(name).float()
    return weight, float(cfg.get("rms_norm_eps", 1e-6))


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
    if weight.shape != (src.meta.hidden_size,):
        raise SchemaError(f"run.target {target}: final norm of shape {list(weight.shape)}, the table's hidden size "
                          f"is {src.meta.hidden_size}: is it the table's target?")
    with staged_export(src, out, purpose="featurestore export") as tmp:
        with open(tmp / SAMPLES, "w") as lines:
            for i, row in enumerate(tqdm(iter_samples(src), total=src.rows, desc="specforge features",
                                         unit="sample")):
                T = row["num_tokens"]
                path = tmp / _rel(i)
                path.parent.mkdir(exist_ok=True)
                torch.save({"input_ids": torch.from_numpy(row["input_ids"].astype(np.int64)),
                            "loss_mask": torch.from_numpy(row["loss_mask"].astype(np.int64)),
                            "hidden_state": apply_norm(row["last"], weight, eps).unsqueeze(0),
                            "aux_hidden_state": row["aux"].reshape(T, -1).unsqueeze(0).contiguous(),
                            PRENORM_KEY: row["last"].unsqueeze(0)}, path)
                lines.write(sample_line(i, _rel(i), row))
        mapping = None
        if draft_vocab_size:
            vocab = target_vocab_size(target)
            d2t, t2d = vocab_mapping(loss_token_counts(src), draft_vocab_size, vocab)
            torch.save({"d2t": torch.from_numpy(d2t), "t2d": torch.from_numpy(t2d)}, tmp / "vocab_mapping.pt")
            mapping = {"draft_vocab_size": draft_vocab_size, "target_vocab_size": vocab, "file": "vocab_mapping.pt"}
        record = export_record(src, FORMAT, vocab_mapping=mapping, final_norm={"target": str(target), "eps": eps},
                               specforge_aux_hidden_state_layer_ids=[i - 1 for i in src.meta.layer_ids])
        finish_export(tmp, src, record, config=config)
    return record


# --- import ---------------------------------------------------------------------------------------

def _files(src: Path) -> list[tuple[int, Path]]:
    """(index, path) of every feature file, by index (``data_<i>``; others after, by path)."""
    found = sorted(p for p in src.rglob("*") if p.name.endswith((".ckpt", ".ckpt.gz")) and p.is_file())
    out, seen = [], {}
    for n, p in enumerate(found):
        m = re.fullmatch(r"data_(\d+)\.ckpt(\.gz)?", p.name)
        i = int(m.group(1)) if m else 10**12 + n
        if i in seen:
            raise StoreError(f"{p}: sample index {i} is also {seen[i]}; nothing was imported")
        seen[i] = p
        out.append((i, p))
    if not out:
        raise StoreError(f"--src {src}: no .ckpt or .ckpt.gz feature files under it")
    return sorted(out)


def _load(path: Path) -> dict:
    import torch

    try:
        if path.name.endswith(".gz"):
            with gzip.open(path, "rb") as f:
                data = torch.load(io.BytesIO(f.read()), map_location="cpu", weights_only=True)
        else:
            data = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # torch raises many kinds (pickle, zip, EOF) for a bad file
        raise StoreError(f"{path}: unreadable feature file ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0][:200] if str(exc) else ''}); nothing was imported") from None
    if not isinstance(data, dict):
        raise SchemaError(f"{path}: holds a {type(data).__name__}, expected a dict of tensors")
    return data


def _parts(data: dict, where: str) -> tuple:
    """(input_ids, loss_mask, hidden_state [T, H], aux [T, n*H]) of one file, checked."""
    missing = [k for k in KEYS if k not in data]
    if missing:
        raise SchemaError(f"{where}: missing key(s) {missing} (SpecForge files hold {list(KEYS)})")
    ids, mask = data["input_ids"].reshape(-1), data["loss_mask"].reshape(-1)
    hs, aux = data["hidden_state"], data["aux_hidden_state"]
    hs = hs[0] if hs.dim() == 3 and hs.shape[0] == 1 else hs
    aux = aux[0] if aux.dim() == 3 and aux.shape[0] == 1 else aux
    T = ids.numel()
    if hs.dim() != 2 or hs.shape[0] != T or aux.dim() != 2 or aux.shape[0] != T or mask.numel() != T:
        raise SchemaError(f"{where}: shapes input_ids {list(ids.shape)}, loss_mask {list(mask.shape)}, hidden_state "
                          f"{list(data['hidden_state'].shape)}, aux_hidden_state {list(data['aux_hidden_state'].shape)}"
                          f"; expected [T], [T], [1, T, H], [1, T, n_aux * H]")
    if aux.shape[1] % hs.shape[1] or aux.shape[1] == 0:
        raise SchemaError(f"{where}: aux_hidden_state width {aux.shape[1]} is not a multiple of H = {hs.shape[1]}")
    if aux.dtype != hs.dtype:
        raise SchemaError(f"{where}: aux_hidden_state is {aux.dtype}, hidden_state {hs.dtype}")
    return ids, mask, hs, aux


def import_dump(src_dir: str | Path, uri: str, name: str, *, target: str, layer_ids=(), domain: str = "imported",
                norm_key: str = "", off_policy: bool = False, budget_bytes: int = 128 << 20,
                trust_remote_code: bool = False) -> dict:
    """Bring a SpecForge feature directory (module docstring) into table ``name`` as one new version."""
    src = sink.require_dir(src_dir, FORMAT)
    record, samples = sink.read_record(src)
    sink.check_target(record, target, off_policy=off_policy)
    files = _files(src)
    first, ids, prenorm = None, [], True
    for i, path in tqdm(files, desc="checking specforge dump", unit="sample"):
        data = _load(path)
        tok, mask, hs, aux = _parts(data, str(path))
        if not np.isin(mask.numpy(), (0, 1)).all():
            raise SchemaError(f"{path}: loss_mask holds values other than 0/1")
        shape = (aux.shape[1] // hs.shape[1], hs.shape[1], sink.dtype_of(hs, str(path)))
        if first is None:
            first = shape
        elif shape != first:
            raise SchemaError(f"{path}: [n_aux, H, dtype] = {list(shape)}, the dump's first file has {list(first)}; "
                              "nothing was imported")
        prenorm = prenorm and PRENORM_KEY in data
        strings = sink.string_columns(samples, i, tok.numpy(), domain=domain, source=f"{FORMAT}:{path.relative_to(src)}")
        ids.append((strings["sample_id"], str(path)))
    sink.check_ids(ids, store.sample_ids(uri, name), name)
    n_aux, H, dtype = first
    if record is not None:
        meta = sink.as_raw(S.FeatureMeta.from_json(json.dumps(record["feature_meta"])), FORMAT)
        if (len(meta.layer_ids), meta.hidden_size, meta.dtype) != (n_aux, H, dtype):
            raise SchemaError(f"--src {src}: files hold [n_aux, H, dtype] = {[n_aux, H, dtype]}, but "
                              f"eaglenest_export.json says {[len(meta.layer_ids), meta.hidden_size, meta.dtype]}")
    else:
        meta = sink.import_meta(fmt=FORMAT, target=target, layer_ids=layer_ids, n_aux=n_aux, hidden=H, dtype=dtype,
                                ids=[s for s, _ in ids], dump_digest=sink.dump_digest([p for _, p in files], src),
                                trust_remote_code=trust_remote_code)
    weight = None if prenorm else final_norm(target, norm_key)[0]
    if weight is not None and not bool((weight != 0).all()):
        raise SchemaError(f"run.target {target}: its final norm weight has zeros; the unnormed last hidden state "
                          "cannot be recovered from SpecForge's hidden_state")
    version = sink.commit_rows(uri, name, meta, _rows(files, src, samples, domain, meta, weight), total=len(files),
                               lineage={"imported_from": str(src.resolve()), "format": FORMAT,
                                        "last_hidden": "exact" if prenorm else "hidden_state / final norm weight",
                                        "export_of": None if record is None else {
                                            k: record.get(k) for k in ("table", "table_version", "feature_set_id")}},
                               budget_bytes=budget_bytes, desc="importing specforge dump")
    return {"table": name, "version": version, "rows": len(files), "feature_set_id": meta.feature_set_id,
            "layer_ids": list(meta.layer_ids), "dtype": meta.dtype, "last_hidden_exact": prenorm}


def _rows(files, src: Path, samples: dict, domain: str, meta, weight):
    for i, path in files:
        data = _load(path)
        tok, mask, hs, aux = _parts(data, str(path))
        T = tok.numel()
        if weight is None:
            last = data[PRENORM_KEY].reshape(T, -1)
        else:  # RMSNorm(hs / w) * w == hs up to eps: a scaled copy of the unnormed state (module docstring)
            last = (hs.float() / weight).to(hs.dtype)
        strings = sink.string_columns(samples, i, tok.numpy(), domain=domain, source=f"{FORMAT}:{path.relative_to(src)}")
        yield sink.feature_row(strings, tok.numpy().astype(np.int64), mask.numpy().astype(np.uint8),
                               aux.reshape(T, len(meta.layer_ids), meta.hidden_size), last, meta, str(path))
