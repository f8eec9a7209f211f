"""Hostile use of the sample reader: its version removed by gc while it reads."""

from __future__ import annotations

import pytest

from eaglenest.errors import StoreError
from eaglenest.featurestore import schema as S
from eaglenest.featurestore.read.reader import SampleReader
from eaglenest.featurestore.table import maintenance, store
from fs_helpers import meta, table


@pytest.mark.parametrize("read", ["take", "iter_samples"])
def test_a_version_gc_removed_under_an_open_reader_says_so(tmp_path, read):
    """A reader of a version (no pin: on object storage pins do not exist) whose version a compact and a gc
    removed: its next read said "reading rows failed in fragment 0 ... (OSError: Not found: ...); run
    `featurestore verify`", and verify finds nothing wrong with the table."""
    uri, m = str(tmp_path / "store"), meta()
    versions = [store.append(uri, store.FEATURES, table([f"s{k}{j}" for j in range(2)], m, seed=k), meta=m)
                for k in range(3)]
    v = versions[1]  # 4 rows
    with SampleReader(store.dataset(uri, store.FEATURES, v)) as reader:
        assert [s.num_tokens for s in reader.read([0, 1])] == [4, 5]
        maintenance.compact(uri, store.FEATURES)
        kept = maintenance.gc(uri, store.FEATURES, older_than_hours=0, grace_hours=0)["versions_after"]
        assert v not in kept
        with pytest.raises(StoreError) as info:
            reader.take(3) if read == "take" else list(reader.iter_samples([2, 3]))
    assert str(info.value) == (f"table 'features' v{v} was garbage-collected while it was being read (`featurestore "
                               f"gc`; the versions kept are {min(kept)}..{max(kept)}): tag the version to keep it, "
                               "or read a kept one")


def test_a_damaged_file_of_a_kept_version_is_still_a_read_error(tmp_path):
    """The gc message only where the version is gone: a data file missing from a version the table
    still has is the read error naming the fragment and file, as before."""
    uri, m = str(tmp_path / "store"), meta()
    store.append(uri, store.FEATURES, table(["a", "b"], m), meta=m)
    ds = store.dataset(uri, store.FEATURES)
    with SampleReader(ds, integrity="off") as reader:
        (data_file,) = (tmp_path / "store" / "features.lance" / "data").iterdir()
        data_file.unlink()
        with pytest.raises(StoreError, match=rf"table 'features' v{ds.version}: reading rows failed in fragment 0, "
                                             rf"data file .*{data_file.name} .*featurestore verify"):
            reader.take(1)


def test_a_blob_read_from_an_object_store_that_fails_is_one_line(s3):
    """Values in a bucket are read through Lance's blob reader, on the reader's threads, after the
    group's descriptors were taken: a version gc removed in between (on object storage nothing pins a
    read version), or an object gone from a kept one, was a raw ValueError 'Not found: ...'."""
    uri, m = s3.uri("qa5-blobs"), meta()
    versions = [store.append(uri, store.FEATURES, table([f"s{k}{j}" for j in range(2)], m, seed=k), meta=m)
                for k in range(3)]
    with SampleReader(store.dataset(uri, store.FEATURES, versions[1])) as reader:
        # Every fragment's tensor columns are mapped (an empty map would pass the check below vacuously),
        # none to a local file: the blob reader's path.
        assert len(reader._files) == len(reader.ds.get_fragments()) == 2, reader._files
        assert all(files.keys() == set(S.TENSOR_COLUMNS) for files in reader._files.values()), reader._files
        assert all(v is None for files in reader._files.values() for v in files.values())
        group = reader._group([1])  # descriptors taken, values not read yet
        maintenance.compact(uri, store.FEATURES)
        kept = maintenance.gc(uri, store.FEATURES, older_than_hours=0, grace_hours=0)["versions_after"]
        with pytest.raises(StoreError, match=rf"^table 'features' v{versions[1]} was garbage-collected while it was "
                                             r"being read"):
            reader._from_row(group, 0, 1)
    with SampleReader(store.dataset(uri, store.FEATURES, max(kept)), integrity="off") as reader:
        group = reader._group([0])
        key = next(k for k in s3.objects("qa5-blobs/features.lance/data/") if k.endswith(".lance"))
        s3.client().delete_object(Bucket=s3.bucket, Key=key)
        with pytest.raises(StoreError, match=rf"^table 'features' v{max(kept)}: reading rows failed in fragment \d+, "
                                             r"data file .*featurestore verify"):
            reader._from_row(group, 0, 0)
