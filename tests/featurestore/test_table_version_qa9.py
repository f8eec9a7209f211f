"""Opening a table at a version number it cannot have (qa9): one line, not a traceback.

``train.table_version`` and ``--version`` refuse a negative number before the store is opened; a
program calling the store (an export script, a notebook: ``FeatureShards(version=-1)``) got Lance's
``OverflowError: can't convert negative int to unsigned``.
"""

from __future__ import annotations

import pytest

from eaglenest.errors import StoreError
from eaglenest.featurestore.table import store
from eaglenest.train.data import FeatureShards

import fs_helpers as H  # on sys.path via conftest


@pytest.mark.parametrize("version", [-1, 2**64, 2**70])
def test_a_version_no_table_can_have_is_one_line_naming_it(tmp_path, version):
    uri, m = str(tmp_path / "store"), H.meta()
    store.append(uri, store.FEATURES, H.table(["a", "b"], m), meta=m)
    with pytest.raises(StoreError, match=rf"has no version {version} \(the latest is 2;"):
        store.dataset(uri, store.FEATURES, version)
    with pytest.raises(StoreError, match=rf"has no version {version} "):
        FeatureShards(uri, version=version, split="train", pack_tokens=64, batch_rows=2, seed=0)
