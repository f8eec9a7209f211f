"""Importing peer dumps: bad or partial dumps are refused naming the file, and nothing is committed."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import interop_helpers as I
from eaglenest.errors import SchemaError, StoreError
from eaglenest.featurestore.interop import source, specforge, speculators
from eaglenest.featurestore.table import store


@pytest.fixture
def dump(tmp_path):
    """A speculators export of a 5-sample table, and the store it came from."""
    target = I.tiny_target(tmp_path / "target")
    uri = str(tmp_path / "store")
    I.make_table(uri, target)
    speculators.export(source.open_source(uri, "features"), tmp_path / "spec", target=target)
    return uri, target, tmp_path / "spec"


def _rewrite(path, **change):
    t = load_file(str(path))
    t.update(change)
    save_file(t, str(path))


def _refused(uri, target, src, exc, match, *, name="back", module=speculators, **kw):
    before = I.versions(uri, name)
    with pytest.raises(exc, match=match):
        module.import_dump(src, uri, name, target=target, **kw)
    assert I.versions(uri, name) == before  # nothing committed (the table was not even created)


def test_missing_file_is_refused(dump):
    uri, target, src = dump
    (src / "hidden_states" / "hs_2.safetensors").unlink()
    _refused(uri, target, src, StoreError, r"hs_2\.safetensors: missing")


def test_truncated_file_is_refused(dump):
    uri, target, src = dump
    p = src / "hidden_states" / "hs_0.safetensors"
    p.write_bytes(p.read_bytes()[:-40])
    _refused(uri, target, src, StoreError, r"hs_0\.safetensors: unreadable")


def test_wrong_shape_is_refused(dump):
    uri, target, src = dump
    p = src / "hidden_states" / "hs_1.safetensors"
    _rewrite(p, hidden_states=load_file(str(p))["hidden_states"][:, 1:].contiguous())
    _refused(uri, target, src, SchemaError, r"hs_1\.safetensors: \[n_aux, H, dtype\] = \[2, 8, 'float32'\]")


def test_wrong_dtype_is_refused(dump):
    uri, target, src = dump
    p = src / "hidden_states" / "hs_3.safetensors"
    _rewrite(p, hidden_states=load_file(str(p))["hidden_states"].half())
    _refused(uri, target, src, SchemaError, r"hs_3\.safetensors: .*'float16'")
    _rewrite(p, hidden_states=load_file(str(p))["hidden_states"].to(torch.int32))
    _refused(uri, target, src, SchemaError, r"hs_3\.safetensors: hidden states are I32")


def test_token_ids_must_match_the_dataset(dump):
    uri, target, src = dump
    p = src / "hidden_states" / "hs_4.safetensors"
    _rewrite(p, token_ids=load_file(str(p))["token_ids"] + 1)
    _refused(uri, target, src, SchemaError, r"hs_4\.safetensors: token_ids differ")


def test_duplicate_sample_ids_are_refused(dump):
    uri, target, src = dump
    lines = (src / "eaglenest_samples.jsonl").read_text().splitlines()
    d = json.loads(lines[3])
    d["sample_id"] = json.loads(lines[1])["sample_id"]
    lines[3] = json.dumps(d)
    (src / "eaglenest_samples.jsonl").write_text("\n".join(lines) + "\n")
    _refused(uri, target, src, StoreError, r"hs_3\.safetensors: sample id d-01 is also .*hs_1")


def test_ids_already_in_the_table_are_refused(dump):
    uri, target, src = dump
    _refused(uri, target, src, StoreError, r"already in table 'features'", name="features")


def test_another_target_is_refused(dump, tmp_path):
    uri, _, src = dump
    other = I.tiny_target(tmp_path / "other", seed=1)
    _refused(uri, other, src, StoreError, r"not run\.target .*other")


def test_foreign_dump_takes_the_recipe_layers_and_checks_them(dump):
    """Without eaglenest_export.json the layer ids come from featurestore.layer_ids and must fit."""
    uri, target, src = dump
    for f in ("eaglenest_export.json", "eaglenest_samples.jsonl"):
        (src / f).unlink()
    _refused(uri, target, src, SchemaError, r"holds 3 aux layers, featurestore\.layer_ids gives 2",
             layer_ids=[2, 4])
    summary = speculators.import_dump(src, uri, "foreign", target=target, layer_ids=[], domain="spec")
    assert summary["layer_ids"] == [2, 4, 5] and summary["rows"] == 5  # vLLM's default (2, L//2, L-3)
    rows = I.table_rows(uri, "foreign")
    assert len(rows) == 5
    assert all(r["sample_id"].startswith("spec-") and r["source"].startswith("speculators:") for r in rows)


def test_specforge_missing_key_and_nan_leave_nothing(tmp_path):
    target = I.tiny_target(tmp_path / "target")
    uri = str(tmp_path / "store")
    I.make_table(uri, target)
    src = tmp_path / "sf"
    specforge.export(source.open_source(uri, "features"), src, target=target)
    p = sorted(src.rglob("data_2.ckpt"))[0]
    d = torch.load(p, weights_only=True)
    bad = {k: v for k, v in d.items() if k != "aux_hidden_state"}
    torch.save(bad, p)
    _refused(uri, target, src, SchemaError, r"data_2\.ckpt: missing key\(s\) \['aux_hidden_state'\]",
             module=specforge)
    d["aux_hidden_state"][0, 1, 3] = float("nan")  # found while writing: the commit never happens
    torch.save(d, p)
    with pytest.raises(SchemaError, match=r"data_2\.ckpt: aux hidden states hold NaN"):
        specforge.import_dump(src, uri, "back", target=target)
    # the table this import created is removed again, fragments and all (docs/import.md)
    assert not store.exists(uri, "back") and not store.table_path(uri, "back").exists()


def test_cli_export_then_import_and_a_refusal(tmp_path, capsys):
    from eaglenest.featurestore import cli

    target = I.tiny_target(tmp_path / "target")
    uri = str(tmp_path / "store")
    I.make_table(uri, target)
    keys = [f"run.workdir={tmp_path}", f"run.store={uri}", f"run.target={target}"]
    assert cli.main(["export", "--format", "specforge", "--out", str(tmp_path / "sf"), "--version", "2",
                     "--draft-vocab-size", "16", *keys]) == 0
    assert json.loads(capsys.readouterr().out)["table_version"] == 2
    assert cli.main(["import", "--format", "specforge", "--src", str(tmp_path / "sf"),
                     "featurestore.table=back", *keys]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["rows"] == 5
    I.assert_same_rows(uri, "features", "back")
    # its record beside the work folder's others: what was read, the version written (docs/formats.md)
    prov = json.loads((tmp_path / "import" / "back" / "provenance.json").read_text())
    assert prov["inputs"]["src"] == str(tmp_path / "sf") and prov["inputs"]["format"] == "specforge"
    assert prov["outputs"] == {"store": uri, "table": "back", "version": store.latest_version(uri, "back"),
                               "feature_set_id": summary["feature_set_id"]}
    assert json.loads((tmp_path / "import" / "back" / "stats.json").read_text()) == summary
    # the recipe's storage reaches the import: fp8 would not be bit-exact, so it is refused, not ignored
    assert cli.main(["import", "--format", "specforge", "--src", str(tmp_path / "sf"), "featurestore.table=fp8",
                     "featurestore.storage=fp8_e4m3", *keys]) == 2
    assert "featurestore.storage=fp8_e4m3" in capsys.readouterr().err and not store.exists(uri, "fp8")
    # a bad dump: exit 2, one line naming the file, nothing committed
    next((tmp_path / "sf").rglob("data_1.ckpt")).write_bytes(b"not a checkpoint")
    assert cli.main(["import", "--format", "specforge", "--src", str(tmp_path / "sf"),
                     "featurestore.table=again", *keys]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "data_1.ckpt: unreadable feature file" in err[-1] and not store.exists(uri, "again")
