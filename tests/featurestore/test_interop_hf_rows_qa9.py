"""The hub, ninth pass: an ``hf --with-tensors`` export of a row too long for a datasets ``Array3D``
value (int32 offsets: 2^31 - 1 values, T x n_aux x H) is refused before anything is written, naming
the row, instead of failing with an Arrow traceback on that row mid-export. The limit is lowered here:
a real such row is 8 GiB."""

from __future__ import annotations

import datasets
import pytest

import interop_helpers as I
from interop_helpers import base  # noqa: F401  (a fixture: the table every test starts from)
from eaglenest.errors import StoreError
from eaglenest.featurestore.interop import hf, source

WIDTH = 3 * I.HIDDEN  # aux values a token: the base table's 3 aux layers x H


def _tokens(uri):
    return {r["sample_id"]: r["num_tokens"] for r in I.table_rows(uri, "features")}


def test_interop_hf_row_over_the_array_limit_is_refused_before_writing(base, monkeypatch):
    uri, _, tmp = base
    tokens = _tokens(uri)
    longest = max(tokens.values())
    first = next(s for s, t in tokens.items() if t == longest)  # table order is sample order here
    monkeypatch.setattr(hf, "MAX_ARRAY_VALUES", longest * WIDTH - 1)
    with pytest.raises(StoreError, match=f"^sample {first}: {longest} tokens x {WIDTH} aux values") as err:
        hf.export(source.open_source(uri, "features"), tmp / "hf out", with_tensors=True)
    assert "\n" not in str(err.value) and "--with-tensors" in str(err.value)
    assert not (tmp / "hf out").exists() and not list(tmp.glob(".hf out.partial-*"))


def test_interop_hf_row_at_the_array_limit_and_token_columns_export(base, monkeypatch):
    uri, _, tmp = base
    tokens = _tokens(uri)
    monkeypatch.setattr(hf, "MAX_ARRAY_VALUES", max(tokens.values()) * WIDTH)  # exactly full: fits
    hf.export(source.open_source(uri, "features"), tmp / "at", with_tensors=True)
    ds = datasets.load_from_disk(str(tmp / "at"))
    assert {r["sample_id"]: len(r["aux_hidden"]) for r in ds} == tokens
    monkeypatch.setattr(hf, "MAX_ARRAY_VALUES", 1)  # no tensor column: no limit
    hf.export(source.open_source(uri, "features"), tmp / "ids", with_tensors=False)
    assert len(datasets.load_from_disk(str(tmp / "ids"))) == len(tokens)
