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

import contextlib
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

from eaglenest.errors import ConfigError, StoreError
from eaglenest.provenance import write_json_atomic
from eaglenest.train.config import RENAMED, TrainConfig

log = logging.getLogger(__name__)

LATEST = "latest.json"
#: A start-over moves the previous complete state here (beside ``state/``) until the new run has
#: written its first state: a run killed before that still has it (and a re-run of its recipe resumes it).
PREVIOUS_SUFFIX = ".previous"
#: Inside the set-aside folder: the run's books (metrics.jsonl, ...) set aside with its state (:func:`settle`).
BOOKS = "books"
#: Train keys (dotted, below ``train``) that do not change the loss trajectory (a resume may change them). The
#: chunk sizes bound memory and change only the order of fp32 sums, as ``num_threads`` does: lowering them is
#: the way to resume a run killed for memory.
FREE_KEYS = frozenset({"output_subdir", "log_every_steps", "num_threads", "prefetch_batches", "table_version",
                       "attn_chunk_tokens", "target_chunk_tokens",
                       "state.resume", "state.every_steps", "state.keep", "select.every_steps",
                       "select.prompts_per_domain", "select.split", "stream.depth", "stream.devices",
                       "track.tensorboard", "track.dir", "track.tracker", "track.project", "track.run_name",
                       "track.mode"})
#: In a fingerprint with ``train.num_steps`` set: the steps the run trains (num_steps, or fewer when
#: ``train.num_epochs`` runs out first). Equal, a changed ``num_epochs`` changes nothing it trains.
PLAN_STEPS = "plan_steps"
#: Train keys compared as the run resolves them, at the fingerprint's top: ``train.seed`` null is
#: ``run.seed`` (a state saved with one spelling resumes under the other; another seed is refused there).
RESOLVED_KEYS = frozenset({"seed"})
#: In a fingerprint: {dotted train key: its value as the run resolves it} for keys with several spellings
#: of one value (``train.sliding_window`` "auto" is the longest sample; ``train.row_tokens`` 0 is
#: ``pack_tokens``; a ``train.draft.*`` size 0 is the target's rule; ``train.num_steps`` 0 is every epoch's
#: steps, and more than those is those). Compared instead of the spelling,
#: so a state saved with one spelling resumes under another; a state saved before compares the spelling.
RESOLVED = "resolved"
#: Train keys (dotted; a trailing dot: a whole section) the family does not read (docs/training.md, "Draft
#: families"): they do not change its trajectory either.
UNREAD_BY_FAMILY = {"eagle3": ("peagle.", "dflash."), "peagle": ("dflash.", "ttt_steps"),
                    "dflash": ("peagle.", "ttt_steps")}
#: Likewise per ``train.source``: the table source never reads the capture stream's settings.
UNREAD_BY_SOURCE = {"table": ("stream.",)}


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


def read_by_family(keys: dict[str, Any], family: str, source: str = "table") -> dict[str, Any]:
    """Dotted train ``keys`` without those ``family`` and ``source`` do not read."""
    unread = UNREAD_BY_FAMILY.get(family, ()) + UNREAD_BY_SOURCE.get(source, ())
    return {k: v for k, v in keys.items() if not any(k == u or (u.endswith(".") and k.startswith(u)) for u in unread)}


def same_place(where: Any) -> Any:
    """A local path as its resolved absolute path (``assets/t``, ``/abs/assets/t/`` and a symlink to it
    compare equal); a hub id or a URI (``s3://...``), which is no local path, stays as written."""
    if not isinstance(where, str) or not where or "://" in where or not os.path.exists(where):
        return where
    return os.path.realpath(where)


def fingerprint(cfg, *, table_version: int, store_uri: str, target: str, seed: int,
                table: str = "features", resolved: dict[str, Any] | None = None) -> dict[str, Any]:
    """What must match to resume. ``resolved``: train keys as the run resolves them (:data:`RESOLVED`)."""
    keys = read_by_family({k: v for k, v in train_keys(dataclasses.asdict(cfg)).items()
                           if k not in FREE_KEYS | RESOLVED_KEYS},
                          cfg.family, cfg.source)
    fp = {"features_version": int(table_version), "store_uri": same_place(str(store_uri)),
          "target": same_place(str(target)), "seed": int(seed), "train": keys}
    if table != "features":  # the default table stays out, so states saved before still match
        fp["features_table"] = table
    if resolved:
        fp[RESOLVED] = dict(resolved)
    return fp


def _diff(saved: dict[str, Any], now: dict[str, Any], moved: tuple[str, str] | None = None) -> list[str]:
    """The differences between two fingerprints, one line each. ``moved``: (where the state was saved,
    where it is now): a store at the same place relative to its state (both moved together: a workdir
    copied or renamed) is the same store."""
    out = []
    for k in sorted(set(saved) | set(now)):
        if k in ("train", RESOLVED) or (k == PLAN_STEPS and (k not in saved or k not in now)):
            continue  # a state saved before PLAN_STEPS compares its train keys alone
        if k in ("store_uri", "target") and same_place(saved.get(k)) == same_place(now.get(k)):
            continue  # states saved before paths were resolved: the same folder spelled otherwise
        if k == "store_uri" and moved and _moved_with(saved.get(k), now.get(k), *moved):
            continue
        if saved.get(k) != now.get(k):
            out.append(f"{k} {saved.get(k)!r} -> {now.get(k)!r}")
    # A train key added after the state was saved counts as its default there: such states still match.
    defaults = train_keys(dataclasses.asdict(TrainConfig()))
    # Keys the family trained now does not read are left out on both sides (a changed family is itself
    # a difference).
    nt = train_keys(now.get("train", {}))
    family, source = nt.get("family", "eagle3"), nt.get("source", "table")
    nt = read_by_family(nt, family, source)
    st = read_by_family({**{k: defaults[k] for k in nt if k in defaults},
                         **{k: v for k, v in train_keys(saved.get("train", {})).items()
                            if k not in FREE_KEYS | RESOLVED_KEYS}},
                        family, source)
    if nt.get("num_steps") and PLAN_STEPS in saved and saved[PLAN_STEPS] == now.get(PLAN_STEPS):
        st.pop("num_epochs", None)  # the same steps of the same plan: the epochs past them are not read
        nt.pop("num_epochs", None)
    sr, nr = saved.get(RESOLVED) or {}, now.get(RESOLVED) or {}
    for k in set(sr) & set(nr):  # compared as resolved: "auto" and the number it resolves to are one window
        st[k], nt[k] = sr[k], nr[k]
    out += [f"train.{k} {st.get(k)!r} -> {nt.get(k)!r}" for k in sorted(set(st) | set(nt))
            if st.get(k) != nt.get(k)]
    return out


def _moved_with(saved: Any, now: Any, saved_at: str, now_at: str) -> bool:
    """Whether local store ``now`` is where ``saved`` was, relative to the state (saved at ``saved_at``,
    now at ``now_at``) that moved with it."""
    if not all(isinstance(x, str) and x and "://" not in x for x in (saved, now, saved_at)):
        return False
    return os.path.relpath(saved, saved_at) == os.path.relpath(same_place(now), now_at)


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
    with warnings.catch_warnings(), _interruptions_unwrapped():
        warnings.filterwarnings("ignore", message=".*single process.*")  # intended without torchrun
        dcp.save(_dcp_state(objective, opt), checkpoint_id=str(tmp))
    save_file({"torch": torch.get_rng_state()}, str(tmp / f"rng-{dist.rank}.safetensors"))
    dist.barrier()
    if dist.is_main:
        sd = sched.state_dict()
        sd.pop("lr_lambdas", None)
        write_json_atomic(tmp / "trainer.json", {"step": step, "world_size": dist.world_size,
                                                 "scheduler": sd, "fingerprint": fp,
                                                 "state_dir": os.path.realpath(state_dir), **extra})
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        write_json_atomic(state_dir / LATEST, {"step": step, "dir": name})
        shutil.rmtree(previous_dir(state_dir), ignore_errors=True)  # the new run has a state of its own now
        old = sorted(p for p in state_dir.glob("step_*") if p.is_dir() and p.name != name
                     and not p.name.endswith(".tmp"))
        for p in old[:max(0, len(old) - (keep - 1))]:
            shutil.rmtree(p, ignore_errors=True)
    dist.barrier()
    return final


@contextlib.contextmanager
def _interruptions_unwrapped():
    """Re-raise a Ctrl-C or SIGTERM (a KeyboardInterrupt: eaglenest.launch.Terminated) that torch's DCP
    caught in its readers or writers and wrapped in a CheckpointException: the command then ends by
    that signal, not with a traceback, nor as a damaged state."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as exc:
        for failure, _ in exc.failures.values():
            if isinstance(failure, KeyboardInterrupt):
                raise failure from None
        raise


def previous_dir(state_dir: Path) -> Path:
    return state_dir.with_name(state_dir.name + PREVIOUS_SUFFIX)


def _damaged(path: Path, state_dir: Path, why: str) -> StoreError:
    return StoreError(f"{path}: damaged training state ({why}); set train.state.resume=never to start over, "
                      f"or delete {state_dir}")


def _read_object(path: Path, state_dir: Path) -> dict[str, Any]:
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise _damaged(path, state_dir, "missing") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise _damaged(path, state_dir, f"{type(exc).__name__}: {str(exc)[:80]}") from None
    if not isinstance(obj, dict):
        raise _damaged(path, state_dir, f"a JSON {type(obj).__name__}, not an object")
    return obj


def read_latest(state_dir: Path) -> dict[str, Any] | None:
    """trainer.json of the latest complete state, or None; that of the previous run set aside by a
    start-over (:func:`set_aside`) when ``state_dir`` has none yet. A damaged state: a one-line
    :class:`StoreError` naming the file and the ways out."""
    for where in (state_dir, previous_dir(state_dir)):
        p = where / LATEST
        if p.is_file():
            break
    else:
        return None
    latest = _read_object(p, where)
    name = latest.get("dir")
    if not isinstance(name, str) or not name or "/" in name or name.startswith("."):
        raise _damaged(p, where, f"'dir' is {name!r}, not a state folder name")
    info_path = where / name / "trainer.json"
    info = _read_object(info_path, where)
    if not isinstance(info.get("step"), int) or not isinstance(info.get("fingerprint"), dict) \
            or not isinstance(info.get("scheduler"), dict):
        raise _damaged(info_path, where, "no integer 'step', 'fingerprint' or 'scheduler' object")
    info["path"] = str(where / name)
    return info


def settle(state_dir: Path, info: dict[str, Any] | None, books: tuple[Path, ...] = ()) -> None:
    """Rank 0, once the state to resume from is chosen: ``info`` None (start over) sets the latest
    complete state aside in :func:`previous_dir` (deleted by the new run's first :func:`save_state`,
    so a kill before it loses nothing); a state resumed from the set-aside folder is moved back.
    ``books`` (files or folders beside the state that record its run: metrics, served-AL selection,
    the best snapshot) go aside and come back with it."""
    prev = previous_dir(state_dir)
    if info is not None:
        if Path(info["path"]).parent == prev:
            _move_books(prev / BOOKS, books, back=True)
            shutil.rmtree(state_dir, ignore_errors=True)
            os.replace(prev, state_dir)
        return
    if (state_dir / LATEST).is_file():  # complete: it replaces an older set-aside one
        shutil.rmtree(prev, ignore_errors=True)
        os.replace(state_dir, prev)
        _move_books(prev / BOOKS, books, back=False)
    else:  # nothing complete (a start-over killed before its first state): keep the set-aside one
        shutil.rmtree(state_dir, ignore_errors=True)


def _move_books(folder: Path, books: tuple[Path, ...], *, back: bool) -> None:
    """Move each of ``books`` into ``folder`` (by name), or back from it (replacing the killed start-over's)."""
    if not back:
        folder.mkdir(exist_ok=True)
    for book in books:
        src, dst = (folder / book.name, book) if back else (book, folder / book.name)
        if not src.exists():
            continue
        if dst.is_dir():
            shutil.rmtree(dst)
        os.replace(src, dst)
    if back:
        shutil.rmtree(folder, ignore_errors=True)


def resolve(info: dict[str, Any] | None, fp: dict[str, Any], state_dir: Path) -> dict[str, Any] | None:
    """The state to resume from, or None to start over.

    Same fingerprint: resume (a finished run then has nothing left to do). A FINISHED run of another
    recipe or table version: start over (nothing is lost; a re-run of a pipeline stage). An
    UNFINISHED one: refused, naming the differences, since starting over would discard it.
    """
    if info is None:
        return None
    moved = (info["state_dir"], os.path.realpath(state_dir)) if isinstance(info.get("state_dir"), str) else None
    diff = _diff(info["fingerprint"], fp, moved)
    if not diff:
        return info
    if info.get("finished"):
        log.info("state in %s is a finished run of another recipe/table (%s): starting over",
                 state_dir, "; ".join(diff[:3]))
        return None
    if diff:
        where = Path(info["path"]).parent if "path" in info else state_dir
        raise ConfigError(f"cannot resume from {where} (step {info['step']}): it was made with a "
                          f"different recipe or table version ({'; '.join(diff[:4])}); "
                          f"set train.state.resume=never to start over")


def load_state(info: dict[str, Any], *, objective, opt, sched, dist) -> None:
    """Restore weights, optimizer, scheduler and this rank's RNG from ``info['path']`` in place."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    path = Path(info["path"])
    state = _dcp_state(objective, opt)
    try:
        with warnings.catch_warnings(), _interruptions_unwrapped():
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
    except (Exception, CheckpointException) as exc:  # a truncated or foreign shard, a bad scheduler record
        first = (str(exc).strip().splitlines() or [""])[0][:120]
        raise _damaged(path, path.parent, f"cannot load it: {type(exc).__name__} {first}".strip()) from None
    log.info("resumed from %s at step %d", path, info["step"])
