"""A table version as a Hugging Face datasets directory: load_from_disk gives back the table."""

import json

import datasets
import pytest
import torch

import interop_helpers as I
from eaglenest.featurestore import schema as S
from eaglenest.featurestore.interop import hf, source


@pytest.fixture
def target(tmp_path):
    return I.tiny_target(tmp_path / "target")


def test_token_columns_round_trip(tmp_path, target):
    uri = str(tmp_path / "store")
    I.make_table(uri, target)
    record = hf.export(source.open_source(uri, "features"), tmp_path / "hf")
    ds = datasets.load_from_disk(str(tmp_path / "hf"))
    want = I.table_rows(uri, "features")
    got = sorted(ds.to_list(), key=lambda r: r["sample_id"])
    assert got == [{k: v for k, v in r.items() if k not in S.TENSOR_COLUMNS} for r in want]
    assert "aux_hidden" not in ds.column_names and record["table_version"] == 2
    assert json.loads((tmp_path / "hf" / "eaglenest_export.json").read_text())["feature_set_id"] == record[
        "feature_set_id"]
    assert (tmp_path / "hf" / "provenance.json").is_file() and not (tmp_path / "hf" / ".hf_cache").exists()


@pytest.mark.parametrize("dtype,storage", [("float32", "raw"), ("float16", "raw"), ("bfloat16", "raw"),
                                           ("bfloat16", "fp8_e4m3")])
def test_tensor_columns_round_trip(tmp_path, target, dtype, storage):
    uri = str(tmp_path / "store")
    m = I.make_table(uri, target, dtype=dtype, storage=storage)
    hf.export(source.open_source(uri, "features"), tmp_path / "hf", with_tensors=True)
    ds = datasets.load_from_disk(str(tmp_path / "hf"))
    assert ds.features["aux_hidden"].dtype == {"bfloat16": "float32"}.get(dtype, dtype)  # stored dtype
    ds = ds.with_format("numpy")  # (datasets' numpy formatter widens float16 to float32, exactly)
    rows = {r["sample_id"]: r for r in I.table_rows(uri, "features")}
    assert len(ds) == len(rows)
    for got in ds:
        r, T = rows[got["sample_id"]], int(got["num_tokens"])
        if storage == "fp8_e4m3":
            aux = S.decode_fp8(r["aux_hidden"], (T, 3, m.hidden_size)).to(torch.bfloat16).float()
        else:
            aux = S.torch_from_blob(r["aux_hidden"], (T, 3, m.hidden_size), dtype)
        assert got["aux_hidden"].shape == (T, 3, m.hidden_size)
        # bit for bit: float32/float16 as stored, bfloat16 widened exactly (narrowing gives the stored bits)
        assert torch.equal(torch.from_numpy(got["aux_hidden"]).to(aux.dtype), aux)
        assert got["last_hidden"].shape == (T, m.hidden_size)
