"""Hostile pass over the maintenance verbs (qa12): hours given as a string or a bool to ``gc``, and ``verify``
on a table whose last commit lost a data file (its report is one readable line per problem)."""

from __future__ import annotations

import tempfile

import pytest

from eaglenest.errors import StoreError
from eaglenest.featurestore.table import maintenance, store, versions

import fs_helpers as H  # on sys.path via conftest


@pytest.mark.parametrize("hours", [{"older_than_hours": "24"}, {"grace_hours": "1"}, {"older_than_hours": True},
                                   {"older_than_hours": None}])
def test_gc_refuses_hours_that_are_not_numbers_in_one_line(tmp_path, hours):
    """``gc(older_than_hours="24")`` (hours read from an environment variable) raised Python's TypeError from a
    comparison, and ``True`` was taken as one hour: each is refused like a negative number, nothing removed."""
    uri, m = str(tmp_path / "s"), H.meta()
    made = [store.append(uri, store.FEATURES, H.table([f"a{i}"], m), meta=m) for i in range(2)]
    with pytest.raises(StoreError, match="must be finite and >= 0 numbers"):
        maintenance.gc(uri, store.FEATURES, **{"older_than_hours": 0.0, "grace_hours": 1.0, **hours})
    assert [v["version"] for v in store.dataset(uri, store.FEATURES).versions()] == [1, *made]


def test_verify_of_a_commit_whose_data_file_is_gone_names_it_without_lance_source_paths():
    """A commit interrupted after its manifest (the data file never landed, or was deleted): ``verify`` names the
    fragment and file, and its lines carry no Lance Rust source locations (``.../lance-io/src/local.rs:273:40``).
    A short store path (not pytest's long one), so that the location is inside the 200 characters kept."""
    with tempfile.TemporaryDirectory(dir="/tmp") as short:
        _verify_missing_file(f"{short}/s")


def _verify_missing_file(uri: str) -> None:
    m = H.meta()
    for i in range(2):
        store.append(uri, store.FEATURES, H.table([f"a{i}"], m), meta=m)
    frag = store.dataset(uri, store.FEATURES).get_fragments()[-1]
    (store.table_path(uri, store.FEATURES) / "data" / frag.data_files()[0].path).unlink()
    report = maintenance.verify(uri, store.FEATURES)
    assert not report["ok"]
    assert any(f"fragment {frag.fragment_id}: data file" in p and "is missing" in p for p in report["problems"])
    assert all(".rs:" not in p for p in report["problems"]), report["problems"]


@pytest.mark.parametrize("verb", ["gc", "compact", "restore", "tag", "untag"])
def test_a_maintenance_verb_on_a_mistyped_store_path_creates_nothing(tmp_path, verb):
    """From Python, ``gc``/``compact``/``restore``/tag changes on a store path that does not exist (a typo)
    took the table's lease first, which made ``<path>/.eaglenest/leases/`` (a new, empty store) before the
    table was found missing. Refused in one line, and the path is still not there."""
    typo = tmp_path / "stroe"
    calls = {"gc": lambda: maintenance.gc(str(typo), store.FEATURES, older_than_hours=0),
             "compact": lambda: maintenance.compact(str(typo), store.FEATURES),
             "restore": lambda: versions.restore(str(typo), store.FEATURES, 1),
             "tag": lambda: versions.set_tag(str(typo), store.FEATURES, "good", None),
             "untag": lambda: versions.delete_tag(str(typo), store.FEATURES, "good")}
    with pytest.raises(StoreError, match=f"no table 'features' in store {typo}"):
        calls[verb]()
    assert not typo.exists() and list(tmp_path.iterdir()) == []
