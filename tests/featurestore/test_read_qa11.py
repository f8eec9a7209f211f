"""The read path's inputs (hostile pass 11): a damaged fragment read with ``integrity="off"`` is named alone
(the healthy fragments of the same group were named beside it), and a version or row index that is not an
integer (``True``, ``1.5``) is refused in one line instead of read as ``1``."""

from __future__ import annotations

import os

import numpy as np
import pytest

import fs_helpers as H
from eaglenest.errors import StoreError
from eaglenest.featurestore.read.reader import SampleReader
from eaglenest.featurestore.table import store


@pytest.fixture()
def two_fragments(tmp_path):
    """A features table of two commits (fragments 0 and 1, five rows each): (uri, [(fragment id, data file)])."""
    uri, m = str(tmp_path / "store"), H.meta(hidden=32)
    for c in range(2):
        store.append(uri, store.FEATURES, H.table([f"c{c}s{i}" for i in range(5)], m, num_tokens=6, seed=c), meta=m)
    ds = store.dataset(uri, store.FEATURES)
    files = [(f.fragment_id, store.table_path(uri, store.FEATURES) / "data" / df.path)
             for f in ds.get_fragments() for df in f.data_files()]
    assert [fid for fid, _ in files] == [0, 1]
    return uri, files


def test_a_damaged_fragment_read_unchecked_is_named_without_the_healthy_ones(two_fragments):
    uri, [(good, good_file), (bad, bad_file)] = two_fragments
    os.truncate(bad_file, os.stat(bad_file).st_size // 2)
    with SampleReader(store.dataset(uri, store.FEATURES), integrity="off") as reader:
        with pytest.raises(StoreError) as err:
            list(reader.iter_samples([3, 4, 5, 6]))  # one group: rows of fragment 0 and of fragment 1
        msg = str(err.value)
        assert "\n" not in msg and f"fragment {bad}, data file {bad_file}" in msg, msg
        assert f"fragment {good}" not in msg and str(good_file) not in msg, msg
        # The healthy fragment still reads, through the same reader.
        assert [s.index for s in reader.iter_samples([0, 1, 4])] == [0, 1, 4]


@pytest.mark.parametrize("version", [True, False, 1.0, 2.5])
def test_a_version_that_is_not_a_number_or_a_tag_is_refused(two_fragments, version):
    uri, _ = two_fragments
    with pytest.raises(StoreError, match=rf"version {version!r} is not a version number or a tag") as err:
        store.dataset(uri, store.FEATURES, version)
    assert "\n" not in str(err.value) and "'features'" in str(err.value)


def test_a_numpy_integer_version_still_opens_that_version(two_fragments):
    uri, _ = two_fragments
    first = min(int(v["version"]) for v in store.dataset(uri, store.FEATURES).versions())
    assert store.dataset(uri, store.FEATURES, np.int64(first)).version == first


@pytest.mark.parametrize("index", [1.5, 2.0, True, "1", None])
def test_a_row_index_that_is_not_an_integer_is_refused(two_fragments, index):
    uri, _ = two_fragments
    with SampleReader(store.dataset(uri, store.FEATURES), integrity="off") as reader:
        says = rf"row {index!r} is not a row number \(an integer; the version has 10 rows: 0..9\)"
        with pytest.raises(StoreError, match=says):
            list(reader.iter_samples([0, index]))
        with pytest.raises(StoreError, match=r"is not a row number"):
            reader.take(index)
        with pytest.raises(StoreError, match=r"is not a row number"):
            reader.read([index])


@pytest.mark.parametrize("index", [-1, 10, 2**40])
def test_a_row_index_outside_the_version_is_refused(two_fragments, index):
    uri, _ = two_fragments
    with SampleReader(store.dataset(uri, store.FEATURES), integrity="off") as reader:
        with pytest.raises(StoreError, match=rf"row {index} is out of range \(the version has 10 rows: 0..9\)"):
            list(reader.iter_samples([index]))
        with pytest.raises(StoreError, match=rf"row {index} is out of range"):
            reader.take(index)
        # numpy integers are row numbers
        assert [s.index for s in reader.iter_samples(np.array([9, 0], dtype=np.int64))] == [9, 0]
