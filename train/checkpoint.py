"""Draft checkpoints: ``draft.safetensors`` (trainable weights + d2t/t2d) and ``checkpoint.json``.

The frozen target embeddings are not stored (they are the target's; :func:`load_checkpoint`
takes them from the target directory when asked). ``checkpoint.json`` holds the draft's Llama
config (with ``draft_vocab_size``, ``target_hidden_size``, ``eagle_aux_layer_ids`` in vLLM's
convention and the 3.1 flags), the features table version it was trained on, the step and the
last metrics: everything :mod:`eaglenest.serve.export` needs without re-reading the store.
Both files are written through a temporary name and a rename, weights first. The pair is tied
by ``weights_sha256`` (a digest of the tensors), stored in the weights' safetensors header and in
``checkpoint.json``: :func:`read_info` (which serve export and :func:`load_checkpoint` go through)
refuses weights of another save, as a kill between the two renames leaves them; a re-run of
``train run`` writes the pair again. Checkpoints written before the digest existed are read unchecked.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save
from transformers import LlamaConfig

from eaglenest.errors import StoreError
from eaglenest.paths import pid_alive, read_json_object
from eaglenest.provenance import write_json_atomic
from eaglenest.train.dflash import DFlashDraft, is_dflash
from eaglenest.train.model import Eagle3Draft
from eaglenest.train.target import load_target_tensors

FORMAT = "eaglenest-draft/1"
WEIGHTS = "draft.safetensors"
INFO = "checkpoint.json"
#: The weights' temporary name, followed by the saving process's id.
TMP_PREFIX = f".{WEIGHTS}.tmp"


def save_checkpoint(outdir: str | Path, model: Eagle3Draft, *, info: dict[str, Any]) -> Path:
    """Write weights and ``checkpoint.json`` (``info`` plus format and draft config) to ``outdir``."""
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().clone() for k, v in model.trainable_state_dict().items()}
    digest = weights_digest(tensors)
    sweep_weight_temps(outdir)
    tmp = outdir / f"{TMP_PREFIX}{os.getpid()}"
    try:
        tmp.write_bytes(sorted_metadata(save(tensors, metadata={"format": FORMAT, "weights_sha256": digest})))
        os.replace(tmp, outdir / WEIGHTS)
    finally:  # a full disk mid-write leaves no partial copy of the weights behind
        tmp.unlink(missing_ok=True)
    record = dict(info)
    record["format"] = FORMAT
    record["weights_sha256"] = digest
    record["draft_config"] = model.config.to_dict()
    write_json_atomic(outdir / INFO, record)
    return outdir


def sweep_weight_temps(outdir: Path) -> None:
    """Remove the weights' temporary files of saves whose process is gone (a kill mid-save): each is
    a whole draft's size, and each killed save would leave another."""
    for path in outdir.glob(f"{TMP_PREFIX}*"):
        pid = path.name[len(TMP_PREFIX):]
        if pid.isdigit() and not pid_alive(int(pid)):
            path.unlink(missing_ok=True)


def sorted_metadata(blob: bytes) -> bytes:
    """The safetensors file ``blob`` with its ``__metadata__`` keys in sorted order: safetensors writes
    them in hash-map order, which varies between processes, so the same weights would not give the
    same bytes. The header is re-encoded as compactly as safetensors writes it, padded to its length."""
    n = int.from_bytes(blob[:8], "little")
    head = json.loads(blob[8:8 + n])
    if not isinstance(head.get("__metadata__"), dict):
        return blob
    head["__metadata__"] = dict(sorted(head["__metadata__"].items()))
    text = json.dumps(head, separators=(",", ":"), ensure_ascii=False).encode()
    assert len(text) <= n, "a re-encoded safetensors header is never longer"
    return blob[:8] + text.ljust(n) + blob[8 + n:]


def weights_digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over the tensors' names, dtypes, shapes and bytes (deterministic: the same weights, the same digest)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def read_info(ckpt_dir: str | Path) -> dict[str, Any]:
    p = Path(ckpt_dir) / INFO
    if not p.is_file():
        raise StoreError(f"{ckpt_dir}: no {INFO} (not a draft checkpoint; run `train run` first)")
    info = read_json_object(p, error=StoreError, then="the checkpoint is damaged: train again (`train run`)")
    if info.get("format") != FORMAT:
        raise StoreError(f"{p}: format {info.get('format')!r}, this eaglenest reads {FORMAT}")
    want = info.get("weights_sha256")
    if want is not None:  # a checkpoint from before the digest has none
        w = Path(ckpt_dir) / WEIGHTS
        try:
            with safe_open(str(w), framework="pt") as f:
                have = (f.metadata() or {}).get("weights_sha256")
        except Exception as exc:  # missing, truncated or not safetensors
            raise StoreError(f"{w}: cannot read the draft weights ({type(exc).__name__}); the checkpoint is "
                             "damaged: train again (`train run`)") from None
        if have != want:
            raise StoreError(f"{w}: these weights are not the ones {INFO} describes (a save was interrupted); "
                             "train again (`train run` writes the pair anew)")
    return info


def load_checkpoint(ckpt_dir: str | Path, *, target_dir: str | Path | None = None
                    ) -> tuple[Eagle3Draft | DFlashDraft, dict[str, Any]]:
    """Rebuild the draft from a checkpoint; embeddings from ``target_dir`` if given, else zeros."""
    info = read_info(ckpt_dir)
    cfg = LlamaConfig.from_dict(info["draft_config"])
    model = DFlashDraft(cfg) if is_dflash(cfg) else Eagle3Draft(cfg)  # train.family=dflash: its own model
    state = load_file(str(Path(ckpt_dir) / WEIGHTS))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith("embed_tokens.")]
    if missing or unexpected:
        raise StoreError(f"{ckpt_dir}: weights do not match the config (missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]})")
    if target_dir is not None:
        with torch.no_grad():
            model.embed_tokens.weight.copy_(load_target_tensors(target_dir, keys=info.get("target_keys"),
                                                                only=("embed",))["embed"])
    return model, info
