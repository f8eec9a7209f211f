"""Edges of a write: ``store.append`` of a table with no rows validates it and makes no version (an
empty commit would add a version holding nothing new); a row whose ``loss_mask`` disagrees with its
``num_loss_tokens`` is refused before a byte is written."""

import pyarrow as pa
import pytest

from eaglenest.errors import SchemaError
from eaglenest.featurestore.table import store

import fs_helpers as H  # on sys.path via conftest


def _versions(uri):
    return [v["version"] for v in store.version_list(store.dataset(uri, store.FEATURES), uri, store.FEATURES)]


def test_zero_rows_make_no_version(tmp_path):
    uri, m = str(tmp_path / "store"), H.meta()
    empty = H.table(["a"], m).slice(0, 0)
    first = store.append(uri, store.FEATURES, empty, meta=m)  # creates the table, nothing in it
    assert _versions(uri) == [first]
    v = store.append(uri, store.FEATURES, H.table(["a", "b"], m), meta=m)
    assert v == first + 1
    assert store.append(uri, store.FEATURES, empty, meta=m) == v
    assert _versions(uri) == [first, v]
    assert store.read(uri, store.FEATURES, columns=["sample_id"]).num_rows == 2


def test_zero_rows_still_checked(tmp_path):
    """An empty table with a column missing, or of another feature set, is refused as a full one is."""
    uri, m = str(tmp_path / "store"), H.meta()
    store.append(uri, store.FEATURES, H.table(["a"], m), meta=m)
    empty = H.table(["a"], m).slice(0, 0)
    with pytest.raises(SchemaError, match="hidden_size"):
        store.append(uri, store.FEATURES, empty, meta=H.meta(hidden=16))
    missing = empty.drop_columns(["sample_id"])
    with pytest.raises(SchemaError, match="sample_id"):
        store.append(uri, store.FEATURES, missing, meta=m)
    assert isinstance(missing, pa.Table) and len(_versions(uri)) == 2


@pytest.mark.parametrize("change, message", [
    ({"num_loss_tokens": 1}, "loss_mask holds 3 ones, not the num_loss_tokens 1"),
    ({"loss_mask": [0, 2, 1, 1]}, "loss_mask holds a value other than 0 and 1"),
    ({"loss_mask": [0, 0, 1, 1]}, "loss_mask holds 2 ones, not the num_loss_tokens 3"),
])
def test_loss_mask_must_match_its_count(tmp_path, change, message):
    """The trainer plans on ``num_loss_tokens`` (a row with none is skipped) and weights each token's
    loss by ``loss_mask``: a row where they disagree is refused at write, naming it, and nothing is
    stored; the other rows of a good table still go in."""
    uri, m = str(tmp_path / "store"), H.meta()
    good = H.rows(["ok-0", "ok-1"], m)
    bad = {**H.rows(["bad"], m)[0], **change}
    assert bad["num_tokens"] == 4
    table = pa.Table.from_pylist(good + [bad], schema=H.table(["x"], m).schema)
    with pytest.raises(SchemaError, match=f"row 'bad': {message}"):
        store.append(uri, store.FEATURES, table, meta=m)
    assert not store.exists(uri, store.FEATURES) or store.read(uri, store.FEATURES).num_rows == 0
    store.append(uri, store.FEATURES, table.slice(0, 2), meta=m)
    assert store.read(uri, store.FEATURES, columns=["sample_id"]).num_rows == 2
