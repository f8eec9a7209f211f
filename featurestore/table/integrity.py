"""The trainer's integrity check: every data file of a pinned version matches its CRC-32 sidecar.

Lance data files carry no content checksum, so a flipped byte in a tensor value reads back as a
silently different feature. :func:`record_checksums` writes each committed data file's
CRC-32 (``<table>.lance/_eaglenest_crc/<file>.crc``); :func:`check_version` makes the training
read path hold every data file of the version it reads to that CRC before the first read.

Recomputing every CRC on every run would read the whole table twice (CRC-32 runs at ~1.7 GiB/s
on one core here, about a cold read's speed), and a CRC per value checked on each ``pread`` would
cost about as much per epoch. So a successful CRC is cached in a **stamp** beside the sidecar
(``<file>.stamp``): the data file's size, ``st_mtime_ns``, ``st_ctime_ns`` and inode at the
moment its bytes were checksummed, and that CRC. A file whose ``stat`` equals its stamp (and
whose stamp CRC equals the sidecar) is trusted at the cost of one ``stat`` and two tiny reads;
anything else is read in full and compared with the sidecar, and a match writes a fresh stamp.
Measured: 0.1-0.3% of a cold read's time with stamps (``bench/featurestore_read.py --integrity``).

Why this is as strong as recomputing the CRC (for changes made through the filesystem): the
kernel sets a file's ctime to "now" on every ``write``, ``truncate``, mmap write, ``utime`` and
``chmod``, and no system call sets it back; a copy (``cp -a``, ``shutil.copytree``, rsync) or a
replacement is a new inode with a new ctime. A stamp is written only when the ctime it records
is *strictly older than a probe* taken before the file was stat'ed and read (the mtime of a file
just created in the same directory: the filesystem's own clock, which is monotonic). Any later
change then gets a ctime at least the probe's, hence different, even with coarse (per-tick)
timestamps: a write in the same tick as the commit cannot hide (the "racy git" problem; such a
file gets no stamp and is fully checked once). The read itself is bracketed by two ``fstat``-s;
a file that changed meanwhile gets no stamp either.
The verbs that read rows (``show``, ``checkout``, ``diff``, ``compact``, ``query``, ``export``) hold
their version to the same check first (:func:`checked_dataset`): a damaged file is never printed,
exported, or rewritten by ``compact`` under a fresh CRC (which would launder it).
Checked once, when a version is opened for training: a file damaged later, mid-run, is seen by the
next run (or as a short read / Lance error, which name the fragment too).
What it does not see: corruption beneath the filesystem after the stamp was written (media bit rot
the disk does not report, raw-device writes), or a system clock stepped back over a later write.
``featurestore verify`` re-reads every byte for those (run it on a schedule for long-lived stores).

Decisions: a missing data file, a size unlike its stamp's, or a CRC unlike its sidecar's raise
:class:`StoreError` naming the fragment and file (exit code 2 in the CLI). A data file **without
a sidecar** (tables committed before checksums existed, or a commit interrupted between Lance's
commit and the sidecar) is read unchecked with one warning per table version giving the count:
refusing would leave such a table untrainable with no repair path, and ``featurestore verify``
lists those files. A sidecar that is there but cannot be read (a directory, no permission) or holds
no CRC-32 is refused naming it (:func:`read_sidecar`), and ``verify`` reports it the same way.
A read-only store keeps its successful checks in this process's memory only.
Data files are immutable in Lance, so a stamp never has to be invalidated, only replaced.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import tempfile
import time
import zlib
from pathlib import Path

from eaglenest.config import short_text
from eaglenest.errors import StoreError
from eaglenest.featurestore.table import objects
from eaglenest.featurestore.table.base import dataset, table_path

log = logging.getLogger(__name__)

CRC_DIR = "_eaglenest_crc"
VERIFY_HINT = "run `featurestore verify` for a full report"
#: What a sidecar holds: the CRC-32 as 8 lowercase hex digits (:func:`crc_and_stat`).
CRC_TEXT = re.compile(r"[0-9a-f]{8}")

#: Successful checks of a read-only store: (path, stat key) -> CRC; valid in this process only.
_MEMORY: dict[tuple[str, tuple], str] = {}
_WARNED: set[tuple[str, int]] = set()


@dataclasses.dataclass(frozen=True)
class Stamp:
    """What a data file looked like when its bytes had the CRC ``crc``."""

    size: int
    mtime_ns: int
    ctime_ns: int
    ino: int
    crc: str

    @classmethod
    def of(cls, st: os.stat_result, crc: str) -> "Stamp":
        return cls(st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, crc)

    def matches(self, st: os.stat_result) -> bool:
        return (self.size, self.mtime_ns, self.ctime_ns, self.ino) == \
            (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


@dataclasses.dataclass
class Report:
    """One :func:`check_version`: data files trusted by stamp, re-read in full, without a sidecar."""

    files: int = 0
    trusted: int = 0
    rechecked: int = 0
    unchecked: list[str] = dataclasses.field(default_factory=list)


def _key(st: os.stat_result) -> tuple:
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino


def crc_and_stat(path: Path) -> tuple[str, os.stat_result | None]:
    """CRC-32 (hex) of ``path``, and its ``fstat`` if the file did not change during the read
    (else None). One reused buffer: a fresh 8 MiB bytes per block cost ~1.8x in page faults."""
    crc, buf = 0, bytearray(8 << 20)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        before = os.fstat(f.fileno())
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
        after = os.fstat(f.fileno())
    return f"{crc:08x}", (before if _key(before) == _key(after) else None)


def fs_now_ns(folder: Path) -> int | None:
    """The filesystem's clock now: the mtime of a file created in ``folder`` (None: not writable)."""
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".probe")
    except OSError:
        return None
    try:
        return os.fstat(fd).st_mtime_ns
    finally:
        os.close(fd)
        try:
            os.unlink(tmp)
        except FileNotFoundError:  # a concurrent ``gc`` sweeping the directory
            pass


def stamp_path(crc_dir: Path, file_name: str) -> Path:
    return crc_dir / f"{file_name}.stamp"


def read_stamp(crc_dir: Path, file_name: str) -> Stamp | None:
    try:
        return Stamp(**json.loads(stamp_path(crc_dir, file_name).read_text()))
    except (OSError, ValueError, TypeError):  # missing or garbled: the file is re-read
        return None


def write_stamp(crc_dir: Path, file_name: str, stamp: Stamp, *, probe_ns: int | None) -> bool:
    """Write ``stamp`` atomically if it is safe to trust later: its ctime strictly older than
    ``probe_ns`` (see the module docstring). Returns whether it was written."""
    if probe_ns is None or stamp.ctime_ns >= probe_ns:
        return False
    target = stamp_path(crc_dir, file_name)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    try:
        tmp.write_text(json.dumps(dataclasses.asdict(stamp), sort_keys=True))
        os.replace(tmp, target)
    except OSError:
        tmp.unlink(missing_ok=True)
        return False
    return True


def data_path(table_dir: Path, rel: str) -> Path:
    """A data file of a local table, from its path in the manifest."""
    return table_dir / "data" / rel


def record_checksums(uri: str, name: str, fragments) -> None:
    """Write the CRC sidecar of every data file of ``fragments`` (FragmentMetadata or LanceFragment),
    and the stamp that lets the trainer trust it by ``stat`` (:func:`check_version`).

    Called on every commit (``fragments.commit_fragments``) and after ``compact``. Object stores
    get no sidecars: computing one would download every data file just uploaded; the store checks
    its own uploads and holds objects redundantly (docs/storage.md)."""
    if objects.is_remote(uri):
        return
    table_dir = table_path(uri, name)
    crc_dir = table_dir / CRC_DIR
    crc_dir.mkdir(parents=True, exist_ok=True)
    probe_ns = fs_now_ns(crc_dir)  # before any file is stat'ed: see write_stamp
    for frag in fragments:
        files = frag.files if hasattr(frag, "files") else frag.data_files()  # FragmentMetadata | LanceFragment
        for df in files:
            target = crc_dir / f"{Path(df.path).name}.crc"
            if target.exists():
                continue
            crc, st = crc_and_stat(data_path(table_dir, df.path))
            tmp = target.with_name(target.name + f".tmp{os.getpid()}")
            tmp.write_text(crc)
            os.replace(tmp, target)
            if st is not None:  # the trainer's check then costs one stat
                write_stamp(crc_dir, Path(df.path).name, Stamp.of(st, crc), probe_ns=probe_ns)


def read_sidecar(crc_dir: Path, file_name: str) -> str | None:
    """The CRC-32 recorded for a data file; None when it has no sidecar (the documented unchecked
    case). A sidecar that is there but cannot be read (a directory, no permission) or holds no
    CRC-32 is a :class:`ValueError` naming it: ``verify`` reports it, the read paths refuse."""
    path = crc_dir / f"{file_name}.crc"
    try:
        text = path.read_text(encoding="ascii").strip()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"its checksum sidecar {path} cannot be read "
                         f"({getattr(exc, 'strerror', None) or type(exc).__name__})") from None
    if not CRC_TEXT.fullmatch(text):
        raise ValueError(f"its checksum sidecar {path} holds no CRC-32 (garbled: {short_text(text, 40)!r})")
    return text


def checked_dataset(uri: str, name: str, version: int | str | None = None, **kw):
    """:func:`base.dataset`, with every data file of the opened version held to its sidecar
    (:func:`check_version`; one ``stat`` per stamped file): what the verbs that read rows use
    (``show``, ``checkout``, ``diff``, ``compact``, ``query``, ``export``), so a damaged file is
    refused with one line naming it, never read back, copied out or rewritten with a fresh CRC."""
    ds = dataset(uri, name, version, **kw)
    check_version(ds, table=name)
    return ds


def check_version(ds, *, table: str | None = None) -> Report:
    """Hold every data file of ``ds`` (a pinned Lance version of a local table) to its sidecar.

    Trusted by stamp: one ``stat``; otherwise one full read. Raises :class:`StoreError` naming the
    fragment and file for a missing file, a size changed since its checksum, or a CRC mismatch."""
    report = Report()
    if objects.is_remote(str(ds.uri)):  # object storage: no sidecars there (record_checksums)
        what = f"table '{table or str(ds.uri).rstrip('/').rsplit('/', 1)[-1].removesuffix('.lance')}' v{ds.version}"
        log.info("%s is on an object store: its data files carry no CRC sidecar and are not checked here "
                 "(docs/storage.md)", what)
        return report
    table_dir = Path(str(ds.uri))
    what = f"table '{table or table_dir.name.removesuffix('.lance')}' v{ds.version}"
    if not table_dir.is_dir():
        log.warning("%s: not a local directory, data files not checked", what)
        return report
    crc_dir = table_dir / CRC_DIR
    probe_ns: int | None = None
    probed = False
    for frag in ds.get_fragments():
        for df in frag.data_files():
            report.files += 1
            path, name = table_dir / "data" / df.path, Path(df.path).name
            where = f"{what}: fragment {frag.fragment_id}, data file {path}"
            try:
                st = os.stat(path)
            except FileNotFoundError:
                raise StoreError(f"{where} is missing; {VERIFY_HINT}") from None
            try:
                want = read_sidecar(crc_dir, name)
            except ValueError as exc:
                raise StoreError(f"{where}: {exc}; {VERIFY_HINT}") from None
            if want is None:
                report.unchecked.append(df.path)
                continue
            stamp = read_stamp(crc_dir, name)
            if stamp is not None and stamp.crc == want:
                if stamp.matches(st):
                    report.trusted += 1
                    continue
                if stamp.size != st.st_size:  # data files are immutable: a new size is damage
                    raise StoreError(f"{where} is {st.st_size} bytes, {stamp.size} when its checksum was "
                                     f"recorded (truncated or overwritten); {VERIFY_HINT}")
            if _MEMORY.get((str(path), _key(st))) == want:
                report.trusted += 1
                continue
            if not probed:  # before the first re-read's fstat (see write_stamp)
                probe_ns, probed = fs_now_ns(crc_dir), True
            wall_ns = time.time_ns()
            try:
                got, st_read = crc_and_stat(path)
            except OSError as exc:  # EIO, permissions: still one line naming the file
                raise StoreError(f"{where} cannot be read ({exc}); {VERIFY_HINT}") from None
            report.rechecked += 1
            if got != want:
                raise StoreError(f"{where} fails its checksum (crc32 {got}, recorded {want}): its bytes "
                                 f"changed since it was committed; {VERIFY_HINT}")
            if st_read is not None and not write_stamp(crc_dir, name, Stamp.of(st_read, got), probe_ns=probe_ns) \
                    and probe_ns is None and st_read.st_ctime_ns < wall_ns - 1_000_000_000:
                _MEMORY[(str(path), _key(st_read))] = got  # read-only store; 1 s margin: wall vs fs clock
    if report.unchecked and (str(table_dir), int(ds.version)) not in _WARNED:
        _WARNED.add((str(table_dir), int(ds.version)))
        log.warning("%s: %d of %d data files have no checksum sidecar and are read unchecked "
                    "(committed before checksums, or a commit interrupted before recording them); "
                    "`featurestore verify` lists them", what, len(report.unchecked), report.files)
    log.info("%s: %d data files checked (%d by stamp, %d re-read, %d without a checksum)", what,
             report.files, report.trusted, report.rechecked, len(report.unchecked))
    return report


def fragment_files(ds, fragment_id: int) -> list[str]:
    """Paths (or object-store URIs: ``s3://b/t.lance/data/x``, not ``s3:/b/...``) of a fragment's data
    files (for error messages)."""
    for frag in ds.get_fragments():
        if frag.fragment_id == fragment_id:
            return [objects.join(str(ds.uri), "data", df.path) for df in frag.data_files()]
    return []


def fragments_of_offsets(ds, offsets) -> list[int]:
    """The fragment ids holding dataset offsets ``offsets`` (``take`` indices), for error messages."""
    return sorted(_offsets_by_fragment(ds, offsets))


def _offsets_by_fragment(ds, offsets) -> dict[int, list[int]]:
    """fragment id -> the offsets of ``offsets`` it holds."""
    import numpy as np

    frags = ds.get_fragments()
    offsets = [int(o) for o in offsets]
    ends = np.cumsum([f.count_rows() for f in frags])
    at = np.searchsorted(ends, np.asarray(offsets, dtype=np.int64), side="right")
    out: dict[int, list[int]] = {}
    for k, offset in zip(at, offsets):
        if k < len(frags):
            out.setdefault(frags[int(k)].fragment_id, []).append(offset)
    return out


def _failing_takes(ds, offsets, columns) -> list[int]:
    """Of the fragments holding ``offsets``, those whose rows fail to ``take`` again (``columns``): a take
    over several fragments fails as a whole, and only the damaged ones are to be named."""
    bad = []
    for frag, offs in sorted(_offsets_by_fragment(ds, offsets).items()):
        try:
            ds.take(offs, columns=columns)
        except Exception:  # noqa: BLE001 - whatever Lance raises for a damaged file
            bad.append(frag)
    return bad


def _failing_fragments(ds) -> list[int]:
    """Fragments whose small columns fail to read (slow path, only after an error)."""
    bad = []
    for frag in ds.get_fragments():
        try:
            frag.to_table(columns=["num_tokens"])
        except Exception:
            bad.append(frag.fragment_id)
    return bad


def read_error(ds, offsets, exc: BaseException, *, columns: list[str] | None = None) -> StoreError:
    """A Lance/Arrow error while taking rows ``offsets`` of ``columns`` (None: while scanning the table) as
    a one-line :class:`StoreError` that names the fragment(s) and their data files: of the rows' fragments,
    those that fail a take of their own rows (the healthy ones of the same take are not named)."""
    try:
        frags = _failing_fragments(ds) if offsets is None else fragments_of_offsets(ds, offsets)
        if offsets is not None and len(frags) > 1:
            frags = _failing_takes(ds, offsets, columns) or frags
        named = "; ".join(f"fragment {f}, data file {', '.join(fragment_files(ds, f))}" for f in frags)
    except Exception:  # the manifest itself may be what is broken
        named = ""
    first = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
    return StoreError(f"table '{Path(str(ds.uri)).name.removesuffix('.lance')}' v{ds.version}: reading rows "
                      f"failed in {named or 'a fragment'} ({type(exc).__name__}: {first}); {VERIFY_HINT}")
