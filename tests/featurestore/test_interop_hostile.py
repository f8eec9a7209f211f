"""Hostile dumps and edge cases of import/export: each bad input is refused with one line naming the file
(and key) before anything is written; a failed import into a new table leaves no table behind; empty
and zero-token versions export without crashing; a full disk is one line."""

import json
import shutil

import datasets
import numpy as np
import pyarrow as pa
import pytest
import safetensors
import torch

import interop_helpers as I
from eaglenest.errors import ConfigError, SchemaError, StoreError
from eaglenest.featurestore import schema as S
from eaglenest.featurestore.interop import hf, sink, source, specforge, speculators
from eaglenest.featurestore.table import fragments, store


@pytest.fixture
def base(tmp_path):
    """A 5-sample float32 table (and its tiny target)."""
    target = I.tiny_target(tmp_path / "target")
    uri = str(tmp_path / "store")
    meta = I.make_table(uri, target)
    return uri, target, tmp_path, meta


@pytest.fixture
def sf(base):
    uri, target, tmp, _ = base
    specforge.export(source.open_source(uri, "features"), tmp / "sf", target=target)
    return uri, target, tmp / "sf"


@pytest.fixture
def sp(base):
    uri, target, tmp, _ = base
    speculators.export(source.open_source(uri, "features"), tmp / "sp", target=target)
    return uri, target, tmp / "sp"


def _ckpt(src, i):
    return next(src.rglob(f"data_{i}.ckpt"))


def _edit(path, fn):
    d = torch.load(path, weights_only=True)
    torch.save(fn(d), path)


def _refused(uri, target, src, exc, match, *, module=specforge, name="back", **kw):
    """Refused with ``match``, and nothing written: the table does not exist, not even empty."""
    with pytest.raises(exc, match=match) as info:
        module.import_dump(src, uri, name, target=target, **kw)
    assert "\n" not in str(info.value)  # one line
    assert not store.exists(uri, name) and not (store.table_path(uri, name)).exists()


def _foreign(src):
    for f in ("eaglenest_export.json", "eaglenest_samples.jsonl"):
        (src / f).unlink()


# -- 1, 8, 12: tensors of a SpecForge file are checked in pass 1, naming the file and key -------------

@pytest.mark.parametrize("change, match", [
    (lambda t: torch.cat([t, t], -1), r"'eaglenest_last_hidden' has shape \[1, \d+, 16\], expected \[1, \d+, 8\]"),
    (lambda t: t[..., :4].contiguous(), r"'eaglenest_last_hidden' has shape \[1, \d+, 4\]"),
    (lambda t: t.double(), r"'eaglenest_last_hidden' is torch\.float64, hidden_state torch\.float32"),
    (lambda t: [1, 2, 3], r"key 'eaglenest_last_hidden' holds a list, expected a tensor"),
])
def test_bad_prenorm_tensor_is_refused_in_pass_1(sf, change, match):
    uri, target, src = sf
    _edit(_ckpt(src, 3), lambda d: {**d, specforge.PRENORM_KEY: change(d[specforge.PRENORM_KEY])})
    _refused(uri, target, src, SchemaError, r"data_3\.ckpt: .*" + match)


@pytest.mark.parametrize("key, value", [("input_ids", [1, 2, 3]), ("hidden_state", 3), ("aux_hidden_state", "x")])
def test_non_tensor_values_are_refused(sf, key, value):
    uri, target, src = sf
    _edit(_ckpt(src, 1), lambda d: {**d, key: value})
    _refused(uri, target, src, SchemaError, rf"data_1\.ckpt: key '{key}' holds a \w+, expected a tensor")


def test_feature_row_refuses_a_blob_of_the_wrong_size():
    meta = S.FeatureMeta(target="t", layer_ids=(2, 4, 5), last_layer_id=8, hidden_size=I.HIDDEN, dtype="float32")
    ids, mask = np.arange(4, dtype=np.int64), np.ones(4, dtype=np.uint8)
    aux, last = torch.zeros(4, 3, I.HIDDEN), torch.zeros(4, I.HIDDEN)
    strings = {k: "x" for k in source.STRING_COLUMNS}
    assert sink.feature_row(strings, ids, mask, aux, last, meta, "f")["num_tokens"] == 4
    with pytest.raises(SchemaError, match=r"^f: last hidden states hold 64 values, the table needs 4 x 8"):
        sink.feature_row(strings, ids, mask, aux, torch.zeros(4, 16), meta, "f")
    with pytest.raises(SchemaError, match=r"^f: aux hidden states are torch\.float64, the table stores float32"):
        sink.feature_row(strings, ids, mask, aux.double(), last, meta, "f")


# -- 2, 10: token ids: in the target's vocabulary, integers, never wrapped ---------------------------

@pytest.mark.parametrize("shift, bad", [(I.VOCAB, r"\d+"), (-100, r"-\d+"), (1 << 40, r"\d{13}")])
def test_token_ids_outside_the_vocabulary_are_refused_specforge(sf, shift, bad):
    uri, target, src = sf
    _edit(_ckpt(src, 2), lambda d: {**d, "input_ids": d["input_ids"] + shift})
    _refused(uri, target, src, SchemaError, rf"data_2\.ckpt: token id {bad} is outside the target's vocabulary "
             rf"\(0\.\.{I.VOCAB - 1}\)")


def _rewrite_dataset(src, fn):
    """Rewrite the speculators dataset rows with ``fn(i, row) -> row`` (hidden-state files untouched)."""
    ds = datasets.load_from_disk(str(src))
    rows = [fn(i, r) for i, r in enumerate(ds.with_format(None).to_list())]
    floats = any(isinstance(t, float) for r in rows for t in r["input_ids"])
    new = datasets.Dataset.from_list(rows, features=datasets.Features({
        "input_ids": datasets.List(datasets.Value("float64" if floats else "int64")),
        "loss_mask": datasets.List(datasets.Value("int64")), "seq_len": datasets.Value("int64")}))
    tmp = src.parent / "rewritten"
    new.save_to_disk(str(tmp))
    del ds, new
    for f in tmp.iterdir():
        shutil.move(str(f), str(src / f.name))


@pytest.mark.parametrize("change, match", [
    (lambda ids: [t + I.VOCAB for t in ids], r"token id \d+ is outside the target's vocabulary"),
    (lambda ids: [-1] + ids[1:], r"token id -1 is outside"),
    (lambda ids: [t + (1 << 40) for t in ids], r"token id \d{13} is outside"),
    (lambda ids: [t + 0.7 for t in ids], r"input_ids are float64, expected integers"),
])
def test_token_ids_are_checked_speculators(sp, change, match):
    uri, target, src = sp
    _rewrite_dataset(src, lambda i, r: {**r, "input_ids": change(r["input_ids"])} if i == 1 else r)
    _refused(uri, target, src, SchemaError, r"dataset row \d: " + match, module=speculators)


def test_float_token_ids_are_refused_specforge(sf):
    uri, target, src = sf
    _edit(_ckpt(src, 0), lambda d: {**d, "input_ids": d["input_ids"].float() + 0.7})
    _refused(uri, target, src, SchemaError, r"data_0\.ckpt: key 'input_ids' is torch\.float32, expected integer")


def test_vocab_mapping_refuses_negative_ids():
    with pytest.raises(StoreError, match=r"token id -1 is outside the target's vocabulary 0\.\.63"):
        source.vocab_mapping({-1: 3, 5: 1}, 4, I.VOCAB)


# -- 3: a failed import into a new table leaves no table and no fragments ----------------------------

@pytest.mark.parametrize("module", [specforge, speculators])
def test_failed_import_into_a_new_table_leaves_nothing(base, module, monkeypatch):
    uri, target, tmp, _ = base
    remove, there = sink._remove_uncommitted, []

    def spy(uri_, name, **kw):  # the table and its fragments were written before the NaN, so the cleanup is tested
        there.append(len(list(store.table_path(uri_, name).rglob("*.lance"))))
        remove(uri_, name, **kw)

    monkeypatch.setattr(sink, "_remove_uncommitted", spy)
    module.export(source.open_source(uri, "features"), tmp / "out", target=target)
    if module is specforge:
        _edit(_ckpt(tmp / "out", 4), lambda d: {**d, "aux_hidden_state": d["aux_hidden_state"] * float("nan")})
    else:
        from safetensors.torch import load_file, save_file

        p = tmp / "out" / "hidden_states" / "hs_4.safetensors"
        t = load_file(str(p))
        save_file({**t, "hidden_states": t["hidden_states"] * float("nan")}, str(p))
    # a one-byte write buffer: every row is flushed as a fragment (and the table created) before the NaN
    with pytest.raises(SchemaError, match=r"_4\.(ckpt|safetensors): aux hidden states hold NaN"):
        module.import_dump(tmp / "out", uri, "back", target=target, budget_bytes=1)
    assert len(there) == 1 and there[0] >= 4, there  # four rows flushed as data files before the fifth's NaN
    assert not store.exists(uri, "back") and not store.table_path(uri, "back").exists()
    # the name is free: the same dump, repaired, imports
    module.export(source.open_source(uri, "features"), tmp / "out2", target=target)
    assert module.import_dump(tmp / "out2", uri, "back", target=target, budget_bytes=1)["rows"] == 5
    I.assert_same_rows(uri, "features", "back")


def test_failed_import_into_an_existing_table_keeps_it(base, sf):
    """A table that existed before the import (even empty) is never removed by its failure."""
    uri, target, src = sf
    fragments.ensure_table(uri, "back", meta=base[3])
    _edit(_ckpt(src, 4), lambda d: {**d, "aux_hidden_state": d["aux_hidden_state"] * float("nan")})
    with pytest.raises(SchemaError, match="NaN"):
        specforge.import_dump(src, uri, "back", target=target, budget_bytes=1)
    assert store.exists(uri, "back") and store.latest_version(uri, "back") == 1


# -- 4: corrupt eaglenest_export.json / eaglenest_samples.jsonl -------------------------------------

@pytest.mark.parametrize("fname, text, match", [
    ("eaglenest_export.json", "{not json", r"eaglenest_export\.json: not valid JSON"),
    ("eaglenest_export.json", "[1, 2]", r"eaglenest_export\.json: holds a JSON list, expected an object"),
    ("eaglenest_export.json", "{}", r"eaglenest_export\.json: key 'feature_meta' is missing"),
    ("eaglenest_export.json", '{"feature_meta": {"target": "t"}}', r"key 'feature_meta\.layer_ids' is None"),
    ("eaglenest_samples.jsonl", "garbage\n", r"eaglenest_samples\.jsonl:1: not valid JSON"),
    ("eaglenest_samples.jsonl", '{"foo": 1}\n', r"eaglenest_samples\.jsonl:1: key 'index' is missing"),
    ("eaglenest_samples.jsonl", '{"index": 0, "sample_id": "x"}\n', r"jsonl:1: key 'file' is missing"),
    ("eaglenest_samples.jsonl", "[3]\n", r"jsonl:1: holds a JSON list, expected an object"),
])
@pytest.mark.parametrize("module", [specforge, speculators])
def test_corrupt_record_or_sample_lines_are_refused(base, module, fname, text, match):
    uri, target, tmp, _ = base
    module.export(source.open_source(uri, "features"), tmp / "out", target=target)
    (tmp / "out" / fname).write_text(text)
    _refused(uri, target, tmp / "out", SchemaError, match, module=module)


def test_bad_domain_in_sample_lines_is_refused(sp):
    uri, target, src = sp
    lines = [json.loads(x) for x in (src / "eaglenest_samples.jsonl").read_text().splitlines()]
    lines[2]["domain"] = "a/b c'; DROP"
    (src / "eaglenest_samples.jsonl").write_text("".join(json.dumps(d) + "\n" for d in lines))
    _refused(uri, target, src, ConfigError, r"eaglenest_samples\.jsonl:3: key 'domain': domain .* must be ASCII",
             module=speculators)


# -- 5, 6: empty versions export; empty dumps are refused ------------------------------------------

@pytest.fixture
def empty(base):
    """An empty features table (its first, empty version)."""
    uri, target, tmp, meta = base
    fragments.ensure_table(uri, "nothing", meta=meta)
    src = source.open_source(uri, "nothing")
    assert src.rows == 0
    return uri, target, tmp, src


@pytest.mark.parametrize("module", [speculators, specforge, hf])
def test_an_empty_version_exports(empty, module):
    uri, target, tmp, src = empty
    record = module.export(src, tmp / "out", target=target) if module is not hf else module.export(src, tmp / "out")
    assert record["rows"] == 0 and (tmp / "out" / "eaglenest_export.json").is_file()
    if module is not specforge:  # a loadable empty dataset (docs/export.md)
        assert len(datasets.load_from_disk(str(tmp / "out"))) == 0
    if module is speculators:
        _refused(uri, target, tmp / "out", StoreError, r"the dump holds no samples", module=module)
    elif module is specforge:
        _refused(uri, target, tmp / "out", StoreError, r"no \.ckpt or \.ckpt\.gz feature files", module=module)


def test_an_empty_save_to_disk_directory_is_refused(tmp_path, base):
    uri, target, _, _ = base
    datasets.Dataset.from_dict({"input_ids": [], "loss_mask": []}).save_to_disk(str(tmp_path / "e"))
    _refused(uri, target, tmp_path / "e", StoreError, r"the dump holds no samples", module=speculators)
    (tmp_path / "e2").mkdir()
    _refused(uri, target, tmp_path / "e2", StoreError, r"not a datasets save_to_disk directory", module=speculators)


# -- 7: zero-token samples ---------------------------------------------------------------------------

def test_zero_token_samples_are_refused_and_export_survives_them(sf, base):
    uri, target, src = sf
    _edit(_ckpt(src, 1), lambda d: {"input_ids": d["input_ids"][:0], "loss_mask": d["loss_mask"][:0],
                                     "hidden_state": d["hidden_state"][:, :0],
                                     "aux_hidden_state": d["aux_hidden_state"][:, :0]})
    _refused(uri, target, src, SchemaError, r"data_1\.ckpt: the sample has no tokens")
    # a table that somehow holds a zero-token row still exports
    _, _, tmp, meta = base
    row = {**I.rows(["z-00"], meta)[0], "num_tokens": 0, "num_loss_tokens": 0, "input_ids": [], "loss_mask": [],
           "aux_hidden": b"", "last_hidden": b""}
    store.append(uri, "zero", pa.Table.from_pylist([row], schema=S.features_schema(meta)), meta=meta)
    assert specforge.export(source.open_source(uri, "zero"), tmp / "zero_sf", target=target)["rows"] == 1


# -- 9: a full disk while writing safetensors is one line ------------------------------------------

def test_safetensors_write_error_is_one_line(base, monkeypatch):
    uri, target, tmp, _ = base

    def full(*a, **k):
        raise safetensors.SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                                          'message: "No space left on device" })')

    monkeypatch.setattr("safetensors.torch.save_file", full)
    with pytest.raises(StoreError, match=r"--out .*out: writing the export failed \(Error while serializing"):
        speculators.export(source.open_source(uri, "features"), tmp / "out", target=target)
    assert not (tmp / "out").exists() and not list(tmp.glob(".out.partial-*"))


# -- 10: --domain, layer id 0 for SpecForge, featurestore.storage ----------------------------------

@pytest.mark.parametrize("domain", ["", "a/b c'; DROP", "dé"])
def test_bad_domain_is_refused(sf, domain):
    uri, target, src = sf
    _refused(uri, target, src, ConfigError, r"--domain: domain .* must be ASCII letters", domain=domain)


def test_layer_id_0_is_refused_for_specforge(sf):
    uri, target, src = sf
    _foreign(src)
    _refused(uri, target, src, ConfigError, r"featurestore\.layer_ids: layer id 0 .* has no SpecForge name",
             layer_ids=[0, 4, 5])


def test_fp8_storage_is_refused_on_import(sf):
    uri, target, src = sf
    _refused(uri, target, src, ConfigError, r"featurestore\.storage=fp8_e4m3: an import stores the dump's tensors "
             r"raw", storage="fp8_e4m3")


# -- 11: a partial copy of an eaglenest export -----------------------------------------------------

def test_partial_specforge_copy_is_refused(sf):
    uri, target, src = sf
    _ckpt(src, 1).unlink()
    _ckpt(src, 3).unlink()
    _refused(uri, target, src, StoreError, r"2 of 5 files listed in eaglenest_samples\.jsonl are missing "
             r"\(first: rows_0-2000/data_1\.ckpt; a partial copy\?\)")
    (src / "eaglenest_samples.jsonl").unlink()  # the record's row count still tells
    _refused(uri, target, src, StoreError, r"eaglenest_export\.json says rows: 5, the dump holds 3 feature files")


def test_partial_speculators_copy_is_refused(sp):
    uri, target, src = sp
    record = json.loads((src / "eaglenest_export.json").read_text())
    (src / "eaglenest_export.json").write_text(json.dumps({**record, "rows": 7}))
    _refused(uri, target, src, StoreError, r"says rows: 7, the dump holds 5 dataset rows", module=speculators)


# -- 12: prompts table, legacy torch.save files, --draft-vocab-size ---------------------------------

def test_import_into_prompts_is_refused_as_export_does(sf):
    uri, target, src = sf
    with pytest.raises(StoreError, match=r"^table 'prompts' holds prompts, not features"):
        specforge.import_dump(src, uri, "prompts", target=target)


def test_legacy_torch_save_files_import(sf):
    import zipfile

    uri, target, src = sf
    files = sorted(src.rglob("*.ckpt"))
    for p in files:
        torch.save(torch.load(p, weights_only=True), p, _use_new_zipfile_serialization=False)
    # the loop ran over every sample's file, and each is now the legacy (non-zip) format the test is about
    assert len(files) == 5 and not any(zipfile.is_zipfile(p) for p in files)
    assert specforge.import_dump(src, uri, "back", target=target)["rows"] == 5
    I.assert_same_rows(uri, "features", "back")


@pytest.mark.parametrize("module", [specforge, speculators])
def test_draft_vocab_size_is_checked_before_writing(base, module, monkeypatch):
    uri, target, tmp, _ = base
    wrote = []
    monkeypatch.setattr(module, "iter_samples", lambda *a, **k: wrote.append(1) or iter(()))
    with pytest.raises(ConfigError, match=r"^--draft-vocab-size \(default train\.draft_vocab_size\): 99999 must be "
                                          r"in 1\.\.64"):
        module.export(source.open_source(uri, "features"), tmp / "out", draft_vocab_size=99999, target=target)
    assert not wrote and not (tmp / "out").exists() and not list(tmp.glob(".out.partial-*"))


# -- 5: a SIGTERM unwinds like Ctrl-C: the new table is removed, the process still ends by SIGTERM ----

def test_sigterm_during_an_import_into_a_new_table_leaves_nothing(base):
    import os
    import signal
    import subprocess
    import sys
    import time

    from eaglenest import faults

    uri, target, tmp, _ = base
    specforge.export(source.open_source(uri, "features"), tmp / "sf", target=target)
    keys = [f"run.workdir={tmp}", f"run.store={uri}", f"run.target={target}", "featurestore.table=back",
            "featurestore.write_buffer_mb=0.000001"]  # every row flushed: the table exists after the first
    cli = [sys.executable, "-c", "import sys; from eaglenest.featurestore.cli import main; sys.exit(main())"]
    proc = subprocess.Popen([*cli, "import", "--format", "specforge", "--src", str(tmp / "sf"), *keys],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, faults.ENV: "import.row_written=30"})
    deadline = time.monotonic() + 120
    while not store.table_path(uri, "back").exists():  # the first row is written: the import holds there
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGTERM, err  # its parent still sees a SIGTERM
    assert err.strip().splitlines()[-1] == "featurestore: terminated" and "Traceback" not in err
    assert not store.exists(uri, "back") and not store.table_path(uri, "back").exists()
