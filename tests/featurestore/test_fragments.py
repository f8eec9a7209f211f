import pickle
import subprocess
import sys

import pytest

from eaglenest.errors import SchemaError
from eaglenest.featurestore.table import fragments, store

import fs_helpers as H  # on sys.path via conftest

HERE = __import__("pathlib").Path(__file__).parent


def _writer(uri, worker, num_commits, per_commit):
    worker, num_commits, per_commit = int(worker), int(num_commits), int(per_commit)
    m = H.meta()
    for c in range(num_commits):
        ids = [f"w{worker}-c{c}-{i}" for i in range(per_commit)]
        frags = fragments.write_fragment(uri, store.FEATURES, H.table(ids, m, seed=worker * 100 + c), meta=m)
        fragments.commit_fragments(uri, store.FEATURES, frags, meta=m, lineage={"worker": worker, "commit": c})


def test_concurrent_writers_lose_and_duplicate_nothing(tmp_path):
    uri = str(tmp_path / "store")
    # Separate interpreters (Lance is not fork-safe), all committing at the same time.
    code = f"import sys; sys.path.insert(0, {str(HERE)!r}); import test_fragments as t; t._writer(*sys.argv[1:])"
    procs = [subprocess.Popen([sys.executable, "-c", code, uri, str(w), "3", "5"]) for w in range(4)]
    assert [p.wait(120) for p in procs] == [0] * 4
    got = store.read(uri, store.FEATURES, columns=["sample_id"]).column("sample_id").to_pylist()
    want = {f"w{w}-c{c}-{i}" for w in range(4) for c in range(3) for i in range(5)}
    assert len(got) == len(want) and set(got) == want
    ds = store.dataset(uri, store.FEATURES)
    assert ds.version == 1 + 12  # the empty create, then one version per commit
    lineages = [fragments.lineage_of(ds, v) for v in range(2, ds.version + 1)]
    assert sorted((x["worker"], x["commit"]) for x in lineages) == [(w, c) for w in range(4) for c in range(3)]
    assert all(x["parent_version"] < v for x, v in zip(lineages, range(2, ds.version + 1)))


def test_fragments_from_workers_commit_once(tmp_path):
    uri, m = str(tmp_path), H.meta()
    frags = []
    for w in range(3):  # what Dask workers would return: pickled metadata
        frags += pickle.loads(pickle.dumps(fragments.write_fragment(uri, store.FEATURES,
                                                                    H.table([f"{w}-{i}" for i in range(4)], m), meta=m)))
    assert store.dataset(uri, store.FEATURES).count_rows() == 0  # created empty; nothing visible before the commit
    v = fragments.commit_fragments(uri, store.FEATURES, frags, meta=m)
    ds = store.dataset(uri, store.FEATURES)
    assert ds.version == v and ds.count_rows() == 12 and len(ds.get_fragments()) == 3


def test_fragment_schema_and_identity_are_checked(tmp_path):
    uri, m = str(tmp_path), H.meta()
    with pytest.raises(SchemaError, match="missing column 'loss_mask'"):
        fragments.write_fragment(uri, store.FEATURES, H.table(["a"], m).drop_columns(["loss_mask"]), meta=m)
    fragments.commit_fragments(uri, store.FEATURES, fragments.write_fragment(uri, store.FEATURES, H.table(["a"], m),
                                                                             meta=m), meta=m)
    other = H.meta(layer_ids=(1, 4, 5))
    with pytest.raises(SchemaError, match="layer_ids.*featurestore.table"):
        fragments.write_fragment(uri, store.FEATURES, H.table(["b"], other), meta=other)
