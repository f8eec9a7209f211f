"""The store on an object store when the store is not what the recipe says: a key prefix Lance
reads as URL syntax, a bucket that does not exist, an endpoint that is down. Each is one line
naming the problem, and nothing is written (moto on loopback, as test_object_store.py)."""

from __future__ import annotations

import pytest

from eaglenest import runconfig
from eaglenest.errors import StoreError
from eaglenest.featurestore import cli
from eaglenest.featurestore.table import objects, store

import fs_helpers as H  # on sys.path via conftest
import s3_helpers


@pytest.mark.parametrize("prefix, char", [("q?x", "?"), ("h#x", "#"), ("pc%41x", "%")])
def test_url_syntax_in_key_prefix_is_refused_before_any_write(s3, prefix, char):
    """Lance parses a store URI as a URL: ``s3://b/q?x`` wrote its table under ``q/`` (and
    ``pc%41x`` under ``pcAx/``) while the head record went under ``q?x/``; two such stores shared
    one table."""
    uri, m = s3.uri(prefix), H.meta()
    with pytest.raises(StoreError) as info:
        store.append(uri, store.FEATURES, H.table(["a"], m), meta=m)
    assert uri in str(info.value) and repr(char) in str(info.value) and "\n" not in str(info.value)
    assert s3.objects(prefix[:2]) == {}  # nothing written, under either reading of the key


@pytest.mark.parametrize("uri, says", [("s3://{bucket}//dbl", "an empty path segment"),
                                       ("s3:///p", "names no bucket"),
                                       ("s3://{bucket}/x\ny", "a control character")])
def test_malformed_key_is_one_line_before_any_write(s3, uri, says):
    """``//`` and no bucket were pyarrow's ArrowInvalid (a traceback); a newline in the key made Lance
    write under ``xy/`` before pyarrow failed on ``x\\ny/``."""
    uri, m = uri.format(bucket=s3.bucket), H.meta()
    before = s3.objects()
    with pytest.raises(StoreError) as info:
        store.append(uri, store.FEATURES, H.table(["a"], m), meta=m)
    assert says in str(info.value) and uri.replace("\n", "\\n") in str(info.value) and "\n" not in str(info.value)
    assert s3.objects() == before


def test_missing_bucket_is_named_not_an_empty_store(s3, capsys):
    uri, m = "s3://no-such-bucket-qa/p", H.meta()
    assert cli.main(["show", f"run.store={uri}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "bucket 'no-such-bucket-qa' does not exist" in err and "\n" not in err
    assert cli.main(["versions", f"run.store={uri}"]) == 2
    assert "bucket 'no-such-bucket-qa' does not exist" in capsys.readouterr().err
    with pytest.raises(StoreError, match="bucket 'no-such-bucket-qa' does not exist"):
        store.append(uri, store.FEATURES, H.table(["a"], m), meta=m)


def test_existing_bucket_without_tables_is_still_an_empty_store(s3, capsys):
    assert store.table_names(s3.uri("empty-prefix")) == []
    assert cli.main(["show", f"run.store={s3.uri('empty-prefix')}"]) == 0
    assert '"tables": {}' in capsys.readouterr().out


def test_endpoint_down_is_one_line_not_an_empty_store(s3, capsys, monkeypatch):
    """A listing or a side-file read that cannot reach the store said "no tables" (exit 0) and
    "no head record"; now both are a StoreError naming the store."""
    uri, m = s3.uri("down"), H.meta()
    store.append(uri, store.FEATURES, H.table(["a"], m), meta=m)
    monkeypatch.setattr(runconfig, "_STORAGE_OPTIONS", {})
    dead = f"http://127.0.0.1:{s3_helpers._free_port()}"
    assert cli.main(["show", f"run.store={uri}", f"run.storage_options.aws_endpoint={dead}",
                     "run.storage_options.allow_http=true"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"cannot reach {uri}" in err and "\n" not in err
    with pytest.raises(StoreError, match=f"cannot reach {uri}/features.lance/{store.HEAD_FILE}"):
        objects.read_text(objects.join(uri, "features.lance", store.HEAD_FILE))
    with pytest.raises(StoreError, match=f"cannot reach {uri}"):
        objects.listdir(uri)
    with pytest.raises(StoreError, match=f"cannot reach {uri}/features.lance/{store.HEAD_FILE}"):
        objects.write_text(objects.join(uri, "features.lance", store.HEAD_FILE), '{"version": 9}')
    with pytest.raises(StoreError, match=f"cannot reach {uri}/features.lance/{store.HEAD_FILE}"):
        objects.delete(objects.join(uri, "features.lance", store.HEAD_FILE))
    monkeypatch.setattr(runconfig, "_STORAGE_OPTIONS", {})
    assert store.head_version(uri, store.FEATURES) == 2  # the store itself is intact


def test_changed_environment_reaches_the_new_endpoint(s3, monkeypatch):
    """The pyarrow filesystem was cached on the recipe's options only, though it reads the endpoint
    and credentials from the environment: a process whose AWS_* variables changed (a second moto,
    a long-lived Dask worker) kept talking to the old endpoint."""
    assert store.table_names(s3.uri("cache")) == []  # a filesystem for this server, cached
    with s3_helpers.moto_s3(bucket="second-server") as other:
        for k, v in other.env.items():
            monkeypatch.setenv(k, v)
        uri, m = other.uri("p"), H.meta()
        store.append(uri, store.FEATURES, H.table(["a"], m), meta=m)
        assert store.head_version(uri, store.FEATURES) == 2 and store.table_names(uri) == [store.FEATURES]


def test_a_data_file_on_s3_is_named_by_its_uri(s3):
    # Named through pathlib, an s3 data file lost a slash in error lines: "s3:/bucket/...".
    from eaglenest.featurestore.table.integrity import fragment_files

    uri, m = s3.uri("named"), H.meta()
    store.append(uri, store.FEATURES, H.table(["a", "b"], m), meta=m)
    ds = store.dataset(uri, store.FEATURES)
    (name,) = fragment_files(ds, ds.get_fragments()[0].fragment_id)
    assert name.startswith(f"{uri}/features.lance/data/") and name.endswith(".lance"), name


@pytest.mark.parametrize("prefix", ["dot/./x", "dot/a/../b", "dot/x/.", "dot/.."])
def test_dot_segment_in_key_prefix_is_refused_before_any_write(s3, prefix):
    """Lance resolves ``.`` and ``..`` in a store URI, pyarrow keeps them: ``s3://b/a/../b`` wrote the
    table's versions under ``b/`` and then said it held no table; ``s3://b/p/..`` wrote at the bucket's root."""
    uri, m = s3.uri(prefix), H.meta()
    before = s3.objects()
    with pytest.raises(StoreError) as info:
        store.append(uri, store.FEATURES, H.table(["a"], m), meta=m)
    msg = str(info.value)
    assert msg.startswith(f"run.store: {uri}") and "has a '.' or '..' path segment" in msg and "\n" not in msg
    assert s3.objects() == before
    assert cli.main(["show", f"run.store={uri}"]) == 2


def test_side_file_written_by_two_threads_at_once_stays_whole(tmp_path):
    """The writer lease is re-entrant within a process, so two threads may record a table's head at
    once: both wrote the same temporary file, one's rename found it gone (FileNotFoundError, reported
    as "head record could not be written") and the other could rename a file still being written."""
    import threading

    path, texts, errors = str(tmp_path / "_eaglenest_head.json"), ['{"version": 7}', '{"version": 12345}'], []

    def write(text):
        try:
            for _ in range(1500):
                objects.write_text(path, text)
                assert objects.read_text(path) in texts
        except (OSError, AssertionError) as exc:
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(t,)) for t in texts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and objects.read_text(path) in texts
    assert [p.name for p in tmp_path.iterdir()] == ["_eaglenest_head.json"]  # no temporary file left
