"""Training curves where people look: TensorBoard event files, and W&B or trackio when named.

Rank 0 turns each ``metrics.jsonl`` record (every ``train.log_every_steps`` steps) into a few named
scalars (:func:`scalars`) and hands them, at the global step, to every sink of ``train.track``:
TensorBoard (torch's ``SummaryWriter``, which writes through the ``tensorboard`` package's event
file writer), and the tracker the recipe names. Each served AL of checkpoint selection goes the same
way. Other ranks get a :class:`Tracking` with no sinks.

Resume: the event folder mirrors ``metrics.jsonl``. A fresh start removes its event files; a resume
from the state at step N rewrites them without the records past N (a killed run may have logged
past its last state), so every reader, TensorBoard's own and the data server's, sees each step
once. A start-over sets the folder aside with the previous state (:func:`books`). A tracker cannot
be rewound: each start is a new run of the tracker, the resumed one named ``<name>-resumed-<N>``
and grouped with the first, its points at the same global steps.
Trade-off: the trackers and TensorBoard are imported only when used (they are optional or heavy);
whether they are installed is checked before any work (:func:`require`), with ``importlib``'s
finder, which imports nothing.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from eaglenest.errors import ConfigError
from eaglenest.paths import make_dir
from eaglenest.train.config import TrackConfig

log = logging.getLogger(__name__)

EVENTS = "events.out.tfevents."
#: The pip line that installs each optional sink.
PIP = {"tensorboard": "pip install tensorboard", "wandb": "pip install wandb", "trackio": "pip install trackio"}


def require(cfg: TrackConfig) -> None:
    """One-line ConfigError (exit 2) when a sink the recipe names is not installed."""
    if cfg.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError(f"train.track.tensorboard: the tensorboard package is not installed "
                          f"({PIP['tensorboard']}, or set train.track.tensorboard=false)")
    if cfg.tracker != "none" and importlib.util.find_spec(cfg.tracker) is None:
        raise ConfigError(f"train.track.tracker={cfg.tracker}: the {cfg.tracker} package is not installed "
                          f"({PIP[cfg.tracker]}, or pip install 'eaglenest[track]')")


def books(cfg: TrackConfig, outdir: Path, *, taken: set[str]) -> tuple[Path, ...]:
    """The event folder, when it is a folder of its own in ``outdir`` (``train.track.dir`` a plain name
    none of ``taken``): it goes aside with the run's state at a start-over and comes back if that run
    resumes, as metrics.jsonl does (eaglenest.train.state.settle). Elsewhere it is left where it is."""
    logdir = outdir / cfg.dir
    if cfg.tensorboard and logdir.parent == outdir and cfg.dir not in taken | {"", ".", ".."}:
        return (logdir,)
    return ()


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """Tag -> value for one metrics.jsonl record (docs/trackers.md says what each means)."""
    out = {"train/loss": record["loss"], "train/lr": record["lr"], "train/epoch": record["epoch"],
           "perf/tokens_per_s": record["tokens_per_second"], "perf/data_stall": record["stall_fraction"]}
    out.update({f"acc/pos{i}": a for i, a in enumerate(record["step_acc"])})
    return {k: float(v) for k, v in out.items()}


class Tracking:
    """The sinks of one run on this rank (none off rank 0): ``log(scalars, step)`` and ``close()``."""

    def __init__(self, sinks: list[Any]):
        self.sinks = sinks

    @classmethod
    def open(cls, cfg: TrackConfig, outdir: Path, *, resume_step: int, active: bool, workdir: str,
             config: dict[str, Any]) -> "Tracking":
        if not active:
            return cls([])
        sinks: list[Any] = []
        try:
            if cfg.tensorboard:
                sinks.append(_TensorBoard(outdir / cfg.dir, resume_step=resume_step))
            group = cfg.run_name or Path(os.path.abspath(workdir)).name or "eaglenest"
            name = group if not resume_step else f"{group}-resumed-{resume_step}"
            if cfg.tracker == "wandb":
                sinks.append(_Wandb(cfg, outdir, name=name, group=group, config=config))
            elif cfg.tracker == "trackio":
                sinks.append(_Trackio(cfg, name=name, group=group, config=config))
        except BaseException:
            cls(sinks).close()
            raise
        return cls(sinks)

    def log(self, values: dict[str, float], step: int) -> None:
        for sink in self.sinks:
            sink.log(values, step)

    def close(self) -> None:
        """Close every sink. Called while an exception unwinds (train/loop.py closes the trackers from
        its exit stack: a non-finite loss, Ctrl-C), the tracker's run is marked failed, not finished."""
        failed = sys.exc_info()[1] is not None
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            sink.close(failed=failed)


class _TensorBoard:
    def __init__(self, logdir: Path, *, resume_step: int):
        from torch.utils.tensorboard import SummaryWriter

        make_dir(logdir, "train.track.dir", error=ConfigError)  # /sys/tb, a file: one line
        cut_events(logdir, resume_step)
        self.writer = SummaryWriter(str(logdir))
        log.info("TensorBoard event files in %s (tensorboard --logdir %s)", logdir, logdir)

    def log(self, values: dict[str, float], step: int) -> None:
        for tag, v in values.items():
            self.writer.add_scalar(tag, v, global_step=step)
        self.writer.flush()  # curves show while training runs; a SIGKILL loses nothing logged

    def close(self, *, failed: bool = False) -> None:
        self.writer.close()


def cut_events(logdir: Path, step: int) -> None:
    """Remove the event records past ``step`` from ``logdir``'s event files (all of them for 0).

    Read with TensorBoard's own loader (a file cut short by a kill ends at its last whole record)
    and written back record for record, through a temporary name and a rename."""
    files = sorted(logdir.glob(f"{EVENTS}*"))
    if not files:
        return
    if not step:
        for f in files:
            f.unlink()
        return
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.summary.writer.record_writer import RecordWriter

    for f in files:
        records = list(RawEventFileLoader(str(f)).Load())
        keep = [r for r in records if Event.FromString(r).step <= step]
        size, whole = f.stat().st_size, sum(len(r) + 16 for r in records)
        if len(keep) == len(records) and size == whole:
            continue  # nothing past ``step`` and no torn tail (a TFRecord frames its data in 16 bytes)
        if size > whole:  # a tail torn by a kill, or a damaged file: say what is dropped
            log.warning("%s: %d of its %d bytes after its %d whole record(s) are not readable (cut short by a "
                        "kill, or damaged); the curves keep what could be read", f, size - whole, size, len(records))
        if not records and size:  # nothing readable at all: keep the bytes beside it, out of TensorBoard's way
            shutil.copyfile(f, logdir / f"unreadable-{f.name.replace('tfevents', 'events')}.bak")
        tmp = logdir / ".cut.tmp"  # TensorBoard reads every file whose name holds "tfevents"; not this one
        with open(tmp, "wb") as out:
            writer = RecordWriter(out)
            for r in keep:
                writer.write(r)
            writer.flush()
        os.replace(tmp, f)


class _Wandb:
    def __init__(self, cfg: TrackConfig, outdir: Path, *, name: str, group: str, config: dict[str, Any]):
        import wandb

        try:
            self.run = wandb.init(project=cfg.project, name=name, group=group, config=config, mode=cfg.mode,
                                  dir=str(outdir), settings=wandb.Settings(console="off"))
        except Exception as exc:  # not logged in, no network: one line, naming the way out
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise ConfigError(f"train.track.tracker=wandb: wandb.init failed ({first}); "
                              "run `wandb login` or set train.track.mode=offline") from None

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self, *, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)  # non-zero: W&B shows the run as failed


class _Trackio:
    """trackio's local store is its own (``TRACKIO_DIR``, default ``$HF_HOME/trackio``); it prints
    its notices on stdout, moved to stderr here so stdout keeps the command's result line."""

    def __init__(self, cfg: TrackConfig, *, name: str, group: str, config: dict[str, Any]):
        import trackio

        self.trackio = trackio
        with contextlib.redirect_stdout(sys.stderr):
            self.run = trackio.init(project=cfg.project, name=name, group=group, config=config)

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self, *, failed: bool = False) -> None:  # trackio's finish takes no status
        with contextlib.redirect_stdout(sys.stderr):
            if self.trackio.context_vars.current_run.get() is self.run:
                self.trackio.finish()  # also clears trackio's current run
            else:
                self.run.finish()
