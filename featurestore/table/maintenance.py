"""Keeping a table healthy: per-file checksums, ``verify``, ``compact`` and ``gc``.

Checksums (written by :func:`eaglenest.featurestore.table.integrity.record_checksums`): Lance data
files carry no content checksum, so a flipped bit in a tensor column reads back silently. Each
committed data file gets a CRC-32 sidecar, ``<table>.lance/_eaglenest_crc/
<file>.crc``, written (atomically) when its fragment is committed or produced by compaction. CRC-32
rather than sha256: it is there to catch disk/transfer corruption, not tampering, and it runs at
several GB/s on data still in the page cache, so writes stay at disk speed. Data files are
immutable in Lance, so a sidecar never goes stale; ``gc`` removes those of deleted files.

``verify`` checks, at one version: the schema, row counts (manifest vs what each fragment reads),
every data file's CRC against its sidecar (a file without one is reported as unchecked), that every
fragment decodes, and a NaN/inf scan of the tensor columns. Problems name the fragment and file.

Object stores (docs/storage.md): no CRC sidecars are written there (computing one would download
every data file just uploaded; the store checks its own uploads and holds objects redundantly), so
``verify`` lists their data files as unchecked by CRC and checks everything else.
"""

from __future__ import annotations

import collections
import datetime as dt
import logging
import numbers
import re
import shutil
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from eaglenest.errors import StoreError
from eaglenest.featurestore import schema as S
from eaglenest.featurestore.table import base, fragments, integrity, lease, objects
from eaglenest.featurestore.table.integrity import CRC_DIR, data_path, record_checksums

log = logging.getLogger(__name__)


def crc_file(path: Path) -> str:
    """CRC-32 of a file as 8 hex digits (one reused 8 MiB buffer: ``integrity.crc_and_stat``)."""
    return integrity.crc_and_stat(path)[0]


def verify(uri: str, name: str, *, version: int | str | None = None) -> dict:
    """Check a table version; returns a report whose ``problems`` list is empty when healthy."""
    problems, unchecked = [], []
    try:
        ds = base.dataset(uri, name, version, allow_rolled_back=True)
        meta = S.feature_meta(ds.schema) if base.is_features(name) else None
    except Exception as exc:  # a corrupt manifest, schema or feature metadata is a finding, not a crash
        return {"table": name, "ok": False, "problems": [f"cannot open: {base.lance_line(exc)[:300]}"]}
    if version is None and (rolled := base.rolled_back(uri, name, ds.version)):
        problems.append(rolled)
    # Pinned while every byte is read: a compact and a gc meanwhile would delete this version's files
    # under the scan, reported as missing or unreadable (a table that is fine, called damaged).
    with lease.pin(uri, name, ds.version, purpose="featurestore verify"):
        return _check_version(uri, name, ds, meta, problems, unchecked)


def _check_version(uri: str, name: str, ds, meta: S.FeatureMeta | None, problems: list[str],
                   unchecked: list[str]) -> dict:
    """:func:`verify`'s report on the opened version ``ds``: every data file, row and sample id."""
    remote = objects.is_remote(uri)
    rows = 0
    for frag in ds.get_fragments():
        fid = frag.fragment_id
        for df in frag.data_files():
            if remote:
                if not objects.exists(objects.join(base.table_uri(uri, name), "data", df.path)):
                    problems.append(f"fragment {fid}: data file {df.path} is missing")
                else:
                    unchecked.append(df.path)
                continue
            table_dir = base.table_path(uri, name)
            path = data_path(table_dir, df.path)
            if not path.is_file():
                problems.append(f"fragment {fid}: data file {df.path} is missing")
                continue
            try:
                want = integrity.read_sidecar(table_dir / CRC_DIR, Path(df.path).name)
            except ValueError as exc:  # there but unreadable or garbled: as the read paths refuse it
                problems.append(f"fragment {fid}: data file {df.path}: {exc}")
                continue
            if want is None:
                unchecked.append(df.path)
            elif crc_file(path) != want:
                problems.append(f"fragment {fid}: data file {df.path} fails its checksum (corrupt)")
        try:
            got, found = _scan_fragment(frag, meta)
        except Exception as exc:
            problems.append(f"fragment {fid}: unreadable ({base.lance_line(exc)[:200]})")
            continue
        if got != frag.metadata.physical_rows - (frag.metadata.num_deletions or 0):
            problems.append(f"fragment {fid}: {got} rows read, manifest says "
                            f"{frag.metadata.physical_rows}")
        rows += got
        problems += [f"fragment {fid}: {p}" for p in found]
    if rows != ds.count_rows():
        problems.append(f"row count: fragments read {rows}, table reports {ds.count_rows()}")
    try:
        ids = ds.to_table(columns=["sample_id"]).column("sample_id").to_pylist()
    except (OSError, ValueError) as exc:  # a fragment that does not read is reported above
        ids = []
        problems.append(f"sample_id: not checked for duplicates ({base.lance_line(exc)[:200]})")
    dup = sorted({i for i, n in collections.Counter(ids).items() if n > 1})
    if dup:
        problems.append(f"sample_id: {len(dup)} id(s) stored more than once, {len(ids) - len(set(ids))} extra "
                        f"row(s) (e.g. {', '.join(dup[:3])})")
    return {"table": name, "version": ds.version, "rows": rows, "fragments": len(ds.get_fragments()),
            "unchecked_files": unchecked, "problems": problems, "ok": not problems}


#: About how many bytes of rows ``verify`` holds at once (a compacted fragment can be the whole table).
SCAN_BYTES = 32 << 20


def _scan_rows(frag, meta: S.FeatureMeta | None) -> int:
    """Rows per batch of a fragment's scan: about :data:`SCAN_BYTES` of its largest row's tensors."""
    if meta is None:
        return 4096
    tokens = frag.to_table(columns=["num_tokens"]).column("num_tokens").to_numpy()
    if not len(tokens):
        return 1
    largest = S.value_bytes(meta, np.array([max(int(tokens.max()), 1)]), len(meta.layer_ids) + 1)[0]
    return max(1, int(SCAN_BYTES // largest))


def _scan_fragment(frag, meta: S.FeatureMeta | None) -> tuple[int, list[str]]:
    """(rows read, problems) of one fragment, decoded batch by batch (one batch in memory, not the
    fragment): rows whose sizes disagree, and NaN/inf in the tensor columns."""
    rows, problems, first_bad = 0, [], None
    nonfinite = {col: [0, []] for col in S.TENSOR_COLUMNS}
    for batch in frag.to_batches(batch_size=_scan_rows(frag, meta), batch_readahead=1,
                                 io_buffer_size=2 * SCAN_BYTES, **base.BYTES):
        rows += batch.num_rows
        if meta is None:
            continue
        tbl = pa.Table.from_batches([batch])
        first_bad = first_bad or S.row_problem(tbl, meta)
        for col, seen in nonfinite.items():
            bad = np.array([S.value_nonfinite(b, meta) for b in tbl.column(col).to_pylist()], dtype=bool)
            seen[0] += int(bad.sum())
            seen[1] += tbl.column("sample_id").filter(bad).to_pylist()[:5 - len(seen[1])]
    if first_bad:
        problems.append(first_bad)
    for col, (n, ids) in nonfinite.items():
        if n:
            problems.append(f"{n} row(s) with NaN/inf in {col} (e.g. {ids})")
    return rows, problems


def compact(uri: str, name: str, *, target_rows_per_fragment: int = 1 << 20) -> dict:
    """Rewrite small fragments into larger ones (a new version; old versions still read), under
    the table's writer lease. Every data file is first held to its checksum
    (:func:`integrity.checked_dataset`): compacting a damaged file would rewrite its bad bytes under
    a fresh, valid CRC, and a later ``gc`` would delete the intact original."""
    base.must_exist(uri, name, "compact")
    with lease.hold(uri, name, purpose="featurestore compact", wait_s=lease.MAINTENANCE_WAIT_S):
        ds = integrity.checked_dataset(uri, name)
        before = len(ds.get_fragments())
        with base.unreadable(uri, name, ds.version):
            metrics = ds.optimize.compact_files(target_rows_per_fragment=target_rows_per_fragment)
        ds = base.dataset(uri, name, allow_rolled_back=True)
        base.record_head(uri, name, ds.version)
        record_checksums(uri, name, ds.get_fragments())
    return {"table": name, "version": ds.version, "fragments_before": before,
            "fragments_after": len(ds.get_fragments()), "fragments_removed": metrics.fragments_removed,
            "fragments_added": metrics.fragments_added}


#: Uncommitted data files younger than this are never deleted by ``gc`` (hours).
GRACE_HOURS = 1.0
#: ``gc --older-than-hours`` beyond this (100 years) is taken as this: no version is older, and
#: Lance and ``timedelta`` overflow on values not far above it.
MAX_HOURS = 100 * 365.25 * 24
TMP_SUFFIX = re.compile(r"\.tmp\d+$")
#: A small side file's temporary (``objects.write_text``: ``<file>.tmp<pid>-<thread>``): the head record's,
#: gc's lineage record's, left in the table's directory by a writer killed between the write and the rename.
SIDE_TMP = re.compile(r"\.json\.tmp\d+-\d+$")


def gc(uri: str, name: str, *, older_than_hours: float, grace_hours: float = GRACE_HOURS) -> dict:
    """Drop untagged versions older than ``older_than_hours`` (tagged ones and the latest stay),
    their unreferenced data files, uncommitted data files (``data/*.lance`` of no version, as Lance
    names them; no other file there is touched) older than ``grace_hours``, and stale
    CRC sidecars. Runs under the table's writer lease, so never while a capture or ingest that may
    still commit its written fragments is live; the grace period also protects fragments that a
    writer outside eaglenest's leases (a bare ``write_fragment`` caller) has not committed yet.
    A rolled-back table is refused: its lost version's files are the only copy left."""
    hours = (older_than_hours, grace_hours)  # a string or a bool ("24", True) is no number of hours
    if not all(isinstance(h, numbers.Real) and not isinstance(h, bool) and 0 <= h < float("inf")  # NaN fails
               for h in hours):
        raise StoreError(f"featurestore gc: --older-than-hours and --grace-hours must be finite and >= 0 "
                         f"numbers (got {older_than_hours!r} and {grace_hours!r})")
    base.must_exist(uri, name, "gc")
    with lease.hold(uri, name, purpose="featurestore gc", wait_s=lease.MAINTENANCE_WAIT_S), \
            lease.hold(uri, name, purpose="featurestore gc", wait_s=lease.MAINTENANCE_WAIT_S, kind="tags"):
        ds = _intact_latest(uri, name)
        listed = base.version_list(ds, uri, name)
        before = [v["version"] for v in listed]
        # A version a live training run reads (lease.pin) stays, and so does every newer one:
        # Lance removes versions by age, so the cut-off moves back to the oldest pinned version.
        pinned = lease.pinned_versions(uri, name)
        if objects.is_remote(uri):
            log.warning("gc of table '%s' in %s: reader pins do not exist on object storage (docs/storage.md), "
                        "so a training run reading a version older than %s h loses it", name, uri, older_than_hours)
        stamps = {int(v["version"]): v["timestamp"] for v in listed}
        # The lineage of every version that may go (a minute's margin), kept first: their rows stay in later
        # versions, and the on-policy guard reads which target generated them from it.
        cut = dt.datetime.now(dt.timezone.utc) - _max_age(older_than_hours, pinned, stamps)
        fragments.keep_lineage(uri, name, ds, [v for v, t in stamps.items()
                                               if v != ds.version and _utc(t) < cut + dt.timedelta(minutes=1)])
        # delete_unverified=False: Lance deletes only files some removed version referenced. It
        # would delete files of no version (uncommitted) at any age with True: swept below instead.
        # The pins are listed again, and no new one is made until Lance has removed (lease.pin waits): a
        # reader that pinned since the first listing keeps its version, one that pins now is told gc runs.
        # The age is measured again here: the pinned version has aged while the lineage was written.
        with lease.hold(uri, name, purpose="featurestore gc", wait_s=lease.MAINTENANCE_WAIT_S, kind="pins"):
            pinned = lease.pinned_versions(uri, name)
            stats = ds.cleanup_old_versions(older_than=_max_age(older_than_hours, pinned, stamps),
                                            delete_unverified=False, error_if_tagged_old_versions=False)
        ds = base.dataset(uri, name)
        live = referenced_files(uri, name, ds)
        data_dir = objects.join(base.table_uri(uri, name), "data")
        cutoff = time.time() - min(grace_hours, MAX_HOURS) * 3600
        swept, swept_bytes = 0, 0
        for e in objects.listdir(data_dir):  # local directory or object-store prefix alike
            # Lance's own rule for files of no version: only ``data/*.lance`` is its (a user's notes are not)
            if e.is_file and e.name.endswith(".lance") and e.name not in live and e.mtime_s is not None \
                    and e.mtime_s < cutoff:
                try:
                    objects.delete(objects.join(data_dir, e.name))
                except FileNotFoundError:
                    continue
                swept += 1
                swept_bytes += e.size
        crc_dir = None if objects.is_remote(uri) else base.table_path(uri, name) / CRC_DIR
        stale = [p for p in crc_dir.glob("*") if p.name.split(".lance")[0] + ".lance" not in live] \
            if crc_dir is not None and crc_dir.is_dir() else []
        for p in stale:
            p.unlink(missing_ok=True)
        litter = [] if objects.is_remote(uri) else killed_writer_litter(uri, name, crc_dir, cutoff)
        for p in litter:
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        after = [v["version"] for v in base.version_list(ds, uri, name)]
    return {"table": name, "versions_before": before, "versions_after": after,
            "bytes_removed": stats.bytes_removed + swept_bytes, "old_versions_removed": stats.old_versions,
            "uncommitted_files_removed": swept, "checksums_removed": len(stale),
            "temporary_files_removed": len(litter),
            "pinned_versions_kept": sorted(pinned)}


def _max_age(older_than_hours: float, pinned: set[int], stamps: dict) -> dt.timedelta:
    """The age past which ``gc`` removes a version: ``older_than_hours``, or more so that the oldest
    pinned version stays. Measured from now, so read it just before Lance compares (it takes ages, not
    times): a pinned version one second inside the age when measured is gone after a slow second."""
    older_than = dt.timedelta(hours=min(older_than_hours, MAX_HOURS))
    if pinned & set(stamps):
        oldest = min(stamps[p] for p in pinned if p in stamps)
        now = dt.datetime.now(oldest.tzinfo) if oldest.tzinfo else dt.datetime.now()
        older_than = max(older_than, now - oldest + dt.timedelta(seconds=1))
    return older_than


def _intact_latest(uri: str, name: str):
    """The latest version for ``gc``, every data file held to its checksum first: after a ``compact``
    the old versions' files are the only intact copy of rows whose new file is damaged, and ``gc``
    would delete them. A rolled-back or damaged table (or tag file) is refused with one line, nothing removed."""
    try:
        ds = integrity.checked_dataset(uri, name)
        base.tag_list(ds, uri, name)  # the tagged versions gc keeps: unreadable, it cannot tell which
        return ds
    except StoreError as exc:
        raise StoreError(f"{exc}; gc removed nothing") from None


def _utc(stamp: dt.datetime) -> dt.datetime:
    """A version's timestamp as an aware UTC time (Lance's are naive local times)."""
    return stamp.astimezone(dt.timezone.utc)


def killed_writer_litter(uri: str, name: str, crc_dir: Path | None, cutoff: float) -> list[Path]:
    """Temporary files a killed writer left (a half-written checksum ``*.crc.tmp<pid>``, head or lineage
    record ``*.json.tmp<pid>-<thread>``, a table create's ``.eaglenest/tmp/<name>.*.lance``), older than
    the grace cut-off: a live writer's are newer."""
    found = []
    if crc_dir is not None and crc_dir.is_dir():
        found += [p for p in crc_dir.iterdir() if TMP_SUFFIX.search(p.name)]
    table_dir = base.table_path(uri, name)
    found += [p for p in table_dir.iterdir() if p.is_file() and SIDE_TMP.search(p.name)]
    tmp_dir = Path(objects.local(uri)) / ".eaglenest" / "tmp"
    if tmp_dir.is_dir():
        found += list(tmp_dir.glob(f"{name}.*.lance"))
    old = []
    for p in found:
        try:
            if p.lstat().st_mtime < cutoff:
                old.append(p)
        except FileNotFoundError:
            continue
    return old


def referenced_files(uri: str, name: str, ds=None) -> set[str]:
    """Names of the data files some remaining version of the table references."""
    ds = ds or base.dataset(uri, name, allow_rolled_back=True)
    return {Path(df.path).name for v in base.version_list(ds, uri, name)
            for f in base.dataset(uri, name, v["version"]).get_fragments() for df in f.data_files()}


def require_ok(report: dict) -> None:
    if not report["ok"]:
        problems = report["problems"]
        more = f"; and {len(problems) - 5} more (the JSON report above lists them all)" if len(problems) > 5 else ""
        raise StoreError(f"verify '{report['table']}': " + "; ".join(problems[:5]) + more)
