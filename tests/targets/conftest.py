"""Shared by the target tests."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest

from eaglenest.featurestore import schema as S
from eaglenest.featurestore.capture import policy
from eaglenest.featurestore.table import store


def _one_row_features(uri, target):
    """A features table of one training row captured (all zeros) from ``target``: enough for ``train run``."""
    meta = S.FeatureMeta(target=str(target), layer_ids=(2, 4, 5), last_layer_id=8, hidden_size=128,
                         dtype="float32", feature_set_id="x",
                         identity=json.dumps({"weights_sha256": policy.target_id(str(target))}))
    T = 6
    row = {"sample_id": "s0", "domain": "d", "source": "s", "split": "train", "mode": "chat",
           "gen_params_id": "g", "num_tokens": T, "num_loss_tokens": T - 1, "input_ids": list(range(3, 3 + T)),
           "loss_mask": [0] + [1] * (T - 1),
           "aux_hidden": S.encode_tensor(np.zeros((T, 3, 128), "<f4"), "float32"),
           "last_hidden": S.encode_tensor(np.zeros((T, 128), "<f4"), "float32")}
    store.append(uri, "features", pa.Table.from_pylist([row], schema=S.features_schema(meta)), meta=meta)


@pytest.fixture
def one_row_features():
    """``one_row_features(uri, target)``: a features table of one training row, as if ``target`` captured it."""
    return _one_row_features
