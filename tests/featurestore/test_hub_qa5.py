"""The store as a hub, fifth pass: a failed import's cleanup on object storage removes only what that
import wrote (another writer's uncommitted fragments in the same new table stay, and its commit lands)."""

import json

import pyarrow as pa
import pytest

import interop_helpers as I
from interop_helpers import base  # noqa: F401  (a fixture: the table both files start from)
from eaglenest.errors import SchemaError
from eaglenest.featurestore import schema as S
from eaglenest.featurestore.interop import sink, specforge
from eaglenest.featurestore.table import fragments, store


# -- a failed import's cleanup on object storage -------------------------------------------------------

def test_failed_remote_import_keeps_another_writers_uncommitted_fragments(base, s3, monkeypatch):
    """Another writer had written (not yet committed) a fragment into the table the failed import created;
    the cleanup deleted the whole table prefix, that writer's data files included, so its commit failed."""
    target = base[1]
    dump, remote = I.nan_dump(base), s3.uri("raced-uncommitted")
    meta = sink.record_meta(json.loads((dump / "eaglenest_export.json").read_text()), "record")
    remove, other = sink._remove_uncommitted, {}

    def other_writer_mid_write(uri_, name, **kw):
        rows = pa.Table.from_pylist(I.rows(["other-0"], meta), schema=S.features_schema(meta))
        other["frags"] = fragments.write_fragment(uri_, name, rows, meta=meta)
        remove(uri_, name, **kw)

    monkeypatch.setattr(sink, "_remove_uncommitted", other_writer_mid_write)
    with pytest.raises(SchemaError, match=r"data_4\.ckpt: aux hidden states hold NaN"):
        specforge.import_dump(dump, remote, "back", target=target, budget_bytes=1)
    mine = {k for k in s3.objects("raced-uncommitted/back.lance/data/") if not k.endswith("/")}  # no dir marker
    theirs = {f"raced-uncommitted/back.lance/data/{f.path}" for fr in other["frags"] for f in fr.files}
    assert mine == theirs, (mine, theirs)  # the import's own four fragments went, the other writer's stayed
    fragments.commit_fragments(remote, "back", other["frags"], meta=meta)
    assert store.sample_ids(remote, "back") == {"other-0"}
