"""Full training state for exact resume: weights, optimizer, scheduler, data position, RNG.

Layout (``<outdir>/state/``)::

    step_00000040/            torch.distributed.checkpoint (DCP) of {"model", "optim"}: sharded
                              per rank under FSDP2, one shard for a plain process
    step_00000040/trainer.json  step (= data position: the global batch plan is a pure function of
                              seed and config, so ``step`` batches are skipped), scheduler state,
                              the open logging window, the run fingerprint
    step_00000040/rng-<rank>.safetensors   each rank's torch RNG state
    latest.json               {"step": 40, "dir": "step_00000040"}, written last

A state is written into ``step_X.tmp`` and renamed, then ``latest.json`` is replaced atomically:
a SIGKILL at any moment leaves the previous state intact. Every rank writes its files into the
directory rank 0 created and renames, so across nodes ``state/`` must be on one shared filesystem
(docs/training.md, "Multi-node"); rank 0 alone reads ``latest.json`` and tells the others. The fingerprint (features version, store,
target, seed and every train key that changes the trajectory) must match to resume; otherwise
the resume is refused naming what differs. Frozen target embeddings are not stored.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from eaglenest.errors import ConfigError
from eaglenest.provenance import write_json_atomic
from eaglenest.train.config import RENAMED, TrainConfig

log = logging.getLogger(__name__)

LATEST = "latest.json"
#: Train keys (dotted, below ``train``) that do not change the loss trajectory (a resume may change them).
FREE_KEYS = frozenset({"output_subdir", "log_every_steps", "num_threads", "prefetch_batches", "table_version",
                       "state.resume", "state.every_steps", "state.keep", "select.every_steps",
                       "select.prompts_per_domain", "select.split", "stream.depth", "stream.devices",
                       "track.tensorboard", "track.dir", "track.tracker", "track.project", "track.run_name",
                       "track.mode"})


def train_keys(train: dict[str, Any]) -> dict[str, Any]:
    """``train`` (a config as a dict) as dotted keys, nested sections flattened (``stream.depth``).
    A fingerprint saved before the sections existed names some keys flat (``stream_transport``):
    they are read under their new names (:data:`eaglenest.train.config.RENAMED`), so it still matches."""
    out: dict[str, Any] = {}
    for k, v in train.items():
        if isinstance(v, dict):
            out.update({f"{k}.{name}": x for name, x in train_keys(v).items()})
        else:
            out[RENAMED.get(k, k)] = v
    return out


def fingerprint(cfg, *, table_version: int, store_uri: str, target: str, seed: int,
                table: str = "features") -> dict[str, Any]:
    keys = {k: v for k, v in train_keys(dataclasses.asdict(cfg)).items() if k not in FREE_KEYS}
    fp = {"features_version": int(table_version), "store_uri": str(store_uri), "target": str(target),
          "seed": int(seed), "train": keys}
    if table != "features":  # the default table stays out, so states saved before still match
        fp["features_table"] = table
    return fp


def _diff(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    out = []
    for k in sorted(set(saved) | set(now)):
        if k == "train":
            continue
        if saved.get(k) != now.get(k):
            out.append(f"{k} {saved.get(k)!r} -> {now.get(k)!r}")
    # A train key added after the state was saved counts as its default there: such states still match.
    defaults = train_keys(dataclasses.asdict(TrainConfig()))
    nt = train_keys(now.get("train", {}))
    st = {**{k: defaults[k] for k in nt if k in defaults},
          **{k: v for k, v in train_keys(saved.get("train", {})).items() if k not in FREE_KEYS}}
    out += [f"train.{k} {st.get(k)!r} -> {nt.get(k)!r}" for k in sorted(set(st) | set(nt))
            if st.get(k) != nt.get(k)]
    return out


def _dcp_state(objective, opt) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(objective, opt, options=StateDictOptions(ignore_frozen_params=True))
    return {"model": msd, "optim": osd}


def save_state(state_dir: Path, *, step: int, objective, opt, sched, dist, fp: dict[str, Any],
               extra: dict[str, Any], keep: int) -> Path:
    """Write the full state at ``step`` (a collective: every rank calls it)."""
    import torch.distributed.checkpoint as dcp

    name = f"step_{step:08d}"
    final, tmp = state_dir / name, state_dir / f"{name}.tmp"
    if dist.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    with warnings.catch_warnings():  # "assuming ... a single process": intended without torchrun
        warnings.filterwarnings("ignore", message=".*single process.*")
        dcp.save(_dcp_state(objective, opt), checkpoint_id=str(tmp))
    save_file({"torch": torch.get_rng_state()}, str(tmp / f"rng-{dist.rank}.safetensors"))
    dist.barrier()
    if dist.is_main:
        sd = sched.state_dict()
        sd.pop("lr_lambdas", None)
        write_json_atomic(tmp / "trainer.json", {"step": step, "world_size": dist.world_size,
                                                 "scheduler": sd, "fingerprint": fp, **extra})
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        write_json_atomic(state_dir / LATEST, {"step": step, "dir": name})
        old = sorted(p for p in state_dir.glob("step_*") if p.is_dir() and p.name != name
                     and not p.name.endswith(".tmp"))
        for p in old[:max(0, len(old) - (keep - 1))]:
            shutil.rmtree(p, ignore_errors=True)
    dist.barrier()
    return final


def read_latest(state_dir: Path) -> dict[str, Any] | None:
    """trainer.json of the latest complete state, or None."""
    p = state_dir / LATEST
    if not p.is_file():
        return None
    latest = json.loads(p.read_text(encoding="utf-8"))
    info = json.loads((state_dir / latest["dir"] / "trainer.json").read_text(encoding="utf-8"))
    info["path"] = str(state_dir / latest["dir"])
    return info


def resolve(info: dict[str, Any] | None, fp: dict[str, Any], state_dir: Path) -> dict[str, Any] | None:
    """The state to resume from, or None to start over.

    Same fingerprint: resume (a finished run then has nothing left to do). A FINISHED run of another
    recipe or table version: start over (nothing is lost; a re-run of a pipeline stage). An
    UNFINISHED one: refused, naming the differences, since starting over would discard it.
    """
    if info is None:
        return None
    diff = _diff(info["fingerprint"], fp)
    if not diff:
        return info
    if info.get("finished"):
        log.info("state in %s is a finished run of another recipe/table (%s): starting over",
                 state_dir, "; ".join(diff[:3]))
        return None
    if diff:
        raise ConfigError(f"cannot resume from {state_dir} (step {info['step']}): it was made with a "
                          f"different recipe or table version ({'; '.join(diff[:4])}); "
                          f"set train.state.resume=never to start over")


def load_state(info: dict[str, Any], *, objective, opt, sched, dist) -> None:
    """Restore weights, optimizer, scheduler and this rank's RNG from ``info['path']`` in place."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    path = Path(info["path"])
    state = _dcp_state(objective, opt)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*")
        dcp.load(state, checkpoint_id=str(path))
    set_state_dict(objective, opt, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=StateDictOptions(ignore_frozen_params=True, strict=False))
    sd = dict(info["scheduler"])
    sd["lr_lambdas"] = [None] * len(sched.lr_lambdas)  # a lambda is code, rebuilt from the config
    sched.load_state_dict(sd)
    rng = path / f"rng-{dist.rank}.safetensors"
    if rng.is_file():
        torch.set_rng_state(load_file(str(rng))["torch"])
    log.info("resumed from %s at step %d", path, info["step"])
