"""An export pins its table version after opening it: a gc that ran in between (it removed the version) is
named in one line before the export starts; one that runs once the pin is held keeps the version."""

from __future__ import annotations

import contextlib

import pyarrow as pa
import pytest

import interop_helpers as I
from eaglenest.errors import StoreError
from eaglenest.featurestore import schema as S
from eaglenest.featurestore.interop import hf, source, specforge, speculators
from eaglenest.featurestore.table import lease, maintenance, store

#: Each export's progress bar: shown once the export has started reading rows.
PROGRESS = {hf: "hf export", specforge: "specforge features", speculators: "speculators hidden states"}


@pytest.fixture
def two_versions(tmp_path):
    """A table (in a folder with a space) with a 5-row version ``v`` and a later one, its tiny target."""
    target = I.tiny_target(tmp_path / "target")
    uri = str(tmp_path / "store dir")
    m = I.make_table(uri, target)
    v = store.latest_version(uri, "features")
    store.append(uri, "features", pa.Table.from_pylist(I.rows(["late-1"], m), schema=S.features_schema(m)), meta=m)
    return uri, target, tmp_path, v


def _gc(uri):
    maintenance.compact(uri, "features")
    return maintenance.gc(uri, "features", older_than_hours=0, grace_hours=0)["versions_after"]


def _pin_with(monkeypatch, before=None, after=None):
    """``lease.pin`` with ``before`` run just before the real pin is taken and ``after`` just after."""
    real = lease.pin

    @contextlib.contextmanager
    def pin(*args, **kw):
        before and before()
        with real(*args, **kw):
            after and after()
            yield

    monkeypatch.setattr(lease, "pin", pin)


def _export(module, src, out, target):
    return module.export(src, out, **({} if module is hf else {"target": target}))


@pytest.mark.parametrize("module", [hf, specforge, speculators], ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_a_version_gc_removed_between_open_and_pin_is_one_line_before_the_export_starts(two_versions, monkeypatch,
                                                                                        capfd, module):
    uri, target, tmp, v = two_versions
    src = source.open_source(uri, "features", v)
    kept = []
    _pin_with(monkeypatch, before=lambda: kept.extend(_gc(uri)))
    capfd.readouterr()
    with pytest.raises(StoreError) as info:
        _export(module, src, tmp / "out", target)
    assert kept and v not in kept  # the interleaving happened: version v was gone when the pin was taken
    text = str(info.value)
    assert "\n" not in text and f"no longer has version {v}: it was garbage-collected" in text, text
    assert ".lance" not in text and "Not found" not in text, text  # no Lance message about missing files
    # refused before the export started (no progress bar), nothing left at --out or beside it
    assert PROGRESS[module] not in capfd.readouterr().err
    assert not (tmp / "out").exists() and not [p for p in tmp.iterdir() if p.name.startswith(".out.partial-")]


def test_a_gc_once_the_pin_is_held_keeps_the_version(two_versions, monkeypatch):
    uri, target, tmp, v = two_versions
    src = source.open_source(uri, "features", v)
    kept = []
    _pin_with(monkeypatch, after=lambda: kept.extend(_gc(uri)))
    record = _export(speculators, src, tmp / "out", target)
    assert v in kept and record["table_version"] == v and record["rows"] == 5
    assert len((tmp / "out" / source.SAMPLES).read_text().splitlines()) == 5
    assert v not in _gc(uri)  # unpinned once the export is done: the next gc removes it
