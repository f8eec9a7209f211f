"""Versions, tags and lineage of a store table: list, diff, checkout (inspect), restore.

Every commit is a Lance version. Lineage travels in the commit's transaction properties
(:mod:`eaglenest.featurestore.table.fragments`), so ``versions`` shows, per version, what was appended,
by which code, from which manifest, on top of which parent. A training run pins the version it read
(``train.table_version``); later appends make new versions and never change an old one.

``restore`` makes an old version the latest by writing a new version with its contents (Lance's
restore); history is kept, nothing is deleted.
"""

from __future__ import annotations

import collections
import logging

from eaglenest.errors import StoreError
from eaglenest.featurestore.table import base, fragments, integrity, lease

log = logging.getLogger(__name__)


def list_versions(uri: str, name: str) -> list[dict]:
    ds = base.dataset(uri, name, allow_rolled_back=True)  # listing is how a rollback is looked into
    tags = collections.defaultdict(list)
    for tag, info in base.tag_list(ds, uri, name).items():
        tags[int(info["version"])].append(tag)
    out = []
    for v in base.version_list(ds, uri, name):
        n = int(v["version"])
        out.append({"version": n, "timestamp": v["timestamp"].isoformat(timespec="seconds"),
                    "rows": int(v["metadata"].get("total_rows", 0)), "tags": sorted(tags.get(n, [])),
                    "lineage": fragments.lineage_of(ds, n)})
    return out


def set_tag(uri: str, name: str, tag: str, version: int | str | None) -> int:
    """Point ``tag`` at ``version`` (latest when None), under the table's tags lock (so ``gc``
    cannot drop the version between the check and the tag; a running capture does not block it).
    An existing tag is moved, with a warning naming both versions: the old one loses the tag's
    protection from ``gc``."""
    base.check_tag(tag)
    base.must_exist(uri, name, "tags")
    with lease.hold(uri, name, purpose="featurestore tags", wait_s=lease.MAINTENANCE_WAIT_S, kind="tags"):
        ds = base.dataset(uri, name, allow_rolled_back=version is not None)
        v = int(base.dataset(uri, name, version).version)
        old = base.tag_list(ds, uri, name).get(tag)
        try:
            if old is not None:
                ds.tags.update(tag, v)
            else:
                ds.tags.create(tag, v)
        except (OSError, ValueError) as exc:  # Lance's own ref rules, should names.TAG fall behind them
            raise StoreError(f"table '{name}': cannot set tag {tag!r} ({base.lance_line(exc)[:200]})") from None
    if old is not None and int(old["version"]) != v:
        log.warning("tag '%s' of table '%s' moved from version %s to version %d (version %s loses the tag's "
                    "protection from `featurestore gc`)", tag, name, old["version"], v, old["version"])
    return v


def delete_tag(uri: str, name: str, tag: str) -> None:
    base.check_tag(tag)
    base.must_exist(uri, name, "tags")
    with lease.hold(uri, name, purpose="featurestore tags", wait_s=lease.MAINTENANCE_WAIT_S, kind="tags"):
        ds = base.dataset(uri, name, allow_rolled_back=True)
        if tag not in base.tag_list(ds, uri, name):
            raise StoreError(f"table '{name}' has no tag '{tag}'")
        ds.tags.delete(tag)


def summary(uri: str, name: str, version: int | str | None = None) -> dict:
    """Row counts per domain/split, fragment count and lineage at one version (a read-only checkout)."""
    ds = integrity.checked_dataset(uri, name, version)
    with base.unreadable(uri, name, ds.version):
        t = ds.to_table(columns=["domain", "split"])
    counts = collections.Counter(zip(t.column("domain").to_pylist(), t.column("split").to_pylist()))
    return {"table": name, "version": ds.version, "rows": t.num_rows, "fragments": len(ds.get_fragments()),
            "counts": {f"{d}/{s}": n for (d, s), n in sorted(counts.items())},
            "lineage": fragments.lineage_of(ds, ds.version)}


def diff(uri: str, name: str, a: int | str, b: int | str) -> dict:
    """Sample ids added and removed going from version ``a`` to ``b``, with per-domain deltas."""
    def ids(v):
        integrity.checked_dataset(uri, name, v)
        t = base.read(uri, name, version=v, columns=["sample_id", "domain"])
        return dict(zip(t.column("sample_id").to_pylist(), t.column("domain").to_pylist()))

    old, new = ids(a), ids(b)
    added = sorted(set(new) - set(old))
    removed = sorted(set(old) - set(new))
    delta = collections.Counter(new[i] for i in added)
    delta.subtract(collections.Counter(old[i] for i in removed))
    return {"table": name, "from": base.dataset(uri, name, a).version, "to": base.dataset(uri, name, b).version,
            "added": len(added), "removed": len(removed), "added_ids": added[:20], "removed_ids": removed[:20],
            "per_domain": {d: n for d, n in sorted(delta.items()) if n}}


def restore(uri: str, name: str, version: int | str) -> int:
    """Make ``version`` the latest (a new version with its contents); returns the new version.

    Under the table's writer lease (a restore during a capture would drop rows the capture has
    committed while it goes on believing they are stored). On a rolled-back table this is how the
    loss is accepted: the new version becomes the recorded head."""
    base.must_exist(uri, name, "restore")
    with lease.hold(uri, name, purpose="featurestore restore", wait_s=lease.MAINTENANCE_WAIT_S):
        ds = base.dataset(uri, name, version)
        try:
            ds.restore()  # reads the latest manifest to number the new version
        except (OSError, ValueError) as exc:
            raise StoreError(f"table '{name}' in {uri}: cannot restore version {ds.version} "
                             f"({base.lance_line(exc)}); "
                             f"is the latest manifest under {name}.lance/_versions damaged? "
                             "`featurestore verify` checks it") from None
        new = int(base.dataset(uri, name, allow_rolled_back=True).version)
        base.record_head(uri, name, new, force=True)
    return new
