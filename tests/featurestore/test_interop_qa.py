"""QA of import/export: a full disk under torch.save, two imports of one dump racing into one table,
sample lines that name rows the dump does not hold or are missing, a dataset whose input_ids are not
lists, records of another format or with impossible layer ids, an ``--out`` that is a symbolic link
or a mount point, a SpecForge ``.ckpt`` that is a dangling link. Second pass: a recorded target path
that holds another model now, a damaged target under SpecForge's final norm, an impossible vocab_size,
an empty ``--src`` / ``--out``, SpecForge folders that are links, unordered layer ids of a foreign dump."""

import contextlib
import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import torch

import interop_helpers as I
from interop_helpers import base  # noqa: F401  (a fixture: the table both files start from)
from eaglenest.errors import ConfigError, SchemaError, StoreError
from eaglenest.featurestore import cli
from eaglenest.featurestore import schema as S
from eaglenest.featurestore.interop import hf, source, specforge, speculators
from eaglenest.featurestore.table import lease, store


@pytest.fixture
def sp(base):
    uri, target, tmp = base
    speculators.export(source.open_source(uri, "features"), tmp / "sp", target=target)
    return uri, target, tmp / "sp"


def _refused(uri, target, src, exc, match, *, module=speculators, name="back", **kw):
    with pytest.raises(exc, match=match) as info:
        module.import_dump(src, uri, name, target=target, **kw)
    assert "\n" not in str(info.value)
    assert not store.exists(uri, name) and not store.table_path(uri, name).exists()


# -- torch.save on a full disk: one line and exit 2, not a RuntimeError's traceback -----------------

#: The child: ``featurestore export`` with files capped at ``limit`` bytes (RLIMIT_FSIZE, SIGXFSZ
#: ignored: a write past it fails with EFBIG, as a full disk fails with ENOSPC).
FULL_DISK = r"""
import resource, signal, sys
from eaglenest.featurestore.cli import main
limit = int(sys.argv[1])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
sys.exit(main(sys.argv[2:]))
"""


def test_a_full_disk_under_torch_save_is_one_line(base):
    """Every SpecForge feature file is a torch.save (~3 KB here; the files before them are smaller)."""
    uri, target, tmp = base
    out = tmp / "out"
    keys = [f"run.workdir={tmp}", f"run.store={uri}", f"run.target={target}"]
    proc = subprocess.run([sys.executable, "-c", FULL_DISK, "1500", "export", "--format", "specforge", "--out",
                           str(out), "--draft-vocab-size", "0", *keys], capture_output=True, text=True, timeout=300)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert last.startswith(f"featurestore: error: --out {out}: writing the export failed (File too large)"), last
    assert not out.exists() and not list(tmp.glob(".out.partial-*"))


# -- two imports of one dump into one table: the second must not commit the rows again ---------------

def test_an_import_racing_another_of_the_same_dump_adds_no_duplicates(sp, monkeypatch):
    """The second import checks the table's ids, then waits for the writer lease while the first commits
    the same samples: once it holds the lease it checks them again and is refused before it writes a
    data file (it used to write the whole dump, refused only at its commit by the writer's guard)."""
    uri, target, src = sp
    take_lease, raced = lease.hold, []

    @contextlib.contextmanager
    def hold_after_a_rival(uri_, name, **kw):
        if name == "back" and not raced:  # the rival gets the lease first and commits the dump
            raced.append("rival")
            raced.append(speculators.import_dump(src, uri, "back", target=target)["version"])
        with take_lease(uri_, name, **kw):
            yield

    monkeypatch.setattr(lease, "hold", hold_after_a_rival)
    data = store.table_path(uri, "back") / "data"
    with pytest.raises(StoreError, match=r"sample id d-00 is already in table 'back'.*nothing was imported"):
        speculators.import_dump(src, uri, "back", target=target)
    assert raced == ["rival", 2] and store.latest_version(uri, "back") == 2
    assert len(list(data.iterdir())) == len(store.dataset(uri, "back").get_fragments())  # none uncommitted
    I.assert_same_rows(uri, "features", "back")  # five rows, not ten


# -- speculators: every sample line names a row of the dataset and its hidden-state file --------------

def _edit_line(src, n, **change):
    path = src / "eaglenest_samples.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    lines[n].update(change)
    path.write_text("".join(json.dumps(d) + "\n" for d in lines))


def test_a_sample_line_past_the_dataset_is_refused(sp):
    """Five lines for five rows, but one names row 9: row 4 would be imported under a made-up id."""
    uri, target, src = sp
    _edit_line(src, 4, index=9)
    _refused(uri, target, src, SchemaError, r"eaglenest_samples\.jsonl: sample index 9 is not a row of the dataset "
             r"\(0\.\.4\)")


def test_a_sample_line_naming_another_file_is_refused(sp):
    uri, target, src = sp
    _edit_line(src, 2, file="hidden_states/hs_3.safetensors")
    _refused(uri, target, src, SchemaError, r"eaglenest_samples\.jsonl: sample index 2 names file "
             r"'hidden_states/hs_3\.safetensors', expected 'hidden_states/hs_2\.safetensors'")


# -- an HF dataset whose input_ids are not lists of token ids ----------------------------------------

def test_a_dataset_whose_input_ids_are_not_lists_is_refused(sp):
    uri, target, src = sp
    rows = datasets.load_from_disk(str(src)).with_format(None).to_list()
    for f in src.glob("data-*.arrow"):
        f.unlink()
    scalar = datasets.Dataset.from_list([{**r, "input_ids": r["input_ids"][0]} for r in rows])
    scalar.save_to_disk(str(src.parent / "scalar"))
    for f in (src.parent / "scalar").iterdir():
        os.replace(f, src / f.name)
    _refused(uri, target, src, SchemaError, r"dataset row 0: input_ids are a 0-d value, expected a list of token ids")


# -- --out as a symbolic link: followed to an empty directory, a dangling one refused up front -------

def test_out_linked_to_an_empty_directory_gets_the_export(base):
    uri, target, tmp = base
    (tmp / "disk" / "exports").mkdir(parents=True)
    (tmp / "out").symlink_to(tmp / "disk" / "exports")
    record = specforge.export(source.open_source(uri, "features"), tmp / "out", target=target)
    assert record["rows"] == 5 and (tmp / "out").is_symlink()
    assert len(list((tmp / "disk" / "exports").rglob("data_*.ckpt"))) == 5
    assert not list(tmp.glob(".out.partial-*")) and not list((tmp / "disk").glob(".exports.partial-*"))


def test_out_linked_to_nothing_is_refused_before_writing(base, monkeypatch):
    uri, target, tmp = base
    (tmp / "out").symlink_to(tmp / "nowhere")
    read = []
    monkeypatch.setattr(specforge, "iter_samples", lambda *a, **k: read.append(1) or iter(()))
    with pytest.raises(ConfigError, match=r"^--out .*out: a symbolic link to .*nowhere, which does not exist"):
        specforge.export(source.open_source(uri, "features"), tmp / "out", target=target)
    assert not read and (tmp / "out").is_symlink() and not (tmp / "nowhere").exists()


# -- SpecForge: a feature file that is a dangling link is a missing file, not no file ----------------

def test_a_dangling_ckpt_link_is_refused(base):
    uri, target, tmp = base
    specforge.export(source.open_source(uri, "features"), tmp / "sf", target=target)
    for f in ("eaglenest_export.json", "eaglenest_samples.jsonl"):  # a foreign dump: no list of its files
        (tmp / "sf" / f).unlink()
    (tmp / "sf" / "rows_0-2000" / "data_5.ckpt").symlink_to(tmp / "blobs" / "not-downloaded")
    _refused(uri, target, tmp / "sf", StoreError, r"data_5\.ckpt: unreadable feature file \(FileNotFoundError",
             module=specforge, layer_ids=[2, 4, 5])


# -- an eaglenest export that lost its sample lines: its rows' ids, domains and splits are gone --------

@pytest.mark.parametrize("module", [speculators, specforge])
def test_an_export_without_its_sample_lines_is_refused(base, module):
    """Imported, every row would become split 'train' of domain 'imported' under the export's feature set:
    held-out rows would train."""
    uri, target, tmp = base
    module.export(source.open_source(uri, "features"), tmp / "out", target=target)
    (tmp / "out" / "eaglenest_samples.jsonl").unlink()
    _refused(uri, target, tmp / "out", StoreError, r"eaglenest_export\.json is there but eaglenest_samples\.jsonl "
             r"is missing \(a partial copy\?\)", module=module)


# -- eaglenest_export.json: a FeatureMeta no capture makes is refused, naming the key ---------------

def _edit_meta(src, fn):
    path = src / "eaglenest_export.json"
    record = json.loads(path.read_text())
    fn(record["feature_meta"])
    path.write_text(json.dumps(record))


@pytest.mark.parametrize("change, match", [
    ({"layer_ids": [-1, 4, 5]}, r"'feature_meta\.layer_ids' \[-1, 4, 5\] with last_layer_id 8"),
    ({"layer_ids": [4, 4, 5]}, r"'feature_meta\.layer_ids' \[4, 4, 5\] with last_layer_id 8"),
    ({"layer_ids": [2, 4, 8]}, r"'feature_meta\.layer_ids' \[2, 4, 8\] with last_layer_id 8"),
    ({"last_layer_id": -1}, r"'feature_meta\.layer_ids' \[2, 4, 5\] with last_layer_id -1"),
])
def test_a_record_with_impossible_layer_ids_is_refused(sp, change, match):
    uri, target, src = sp
    _edit_meta(src, lambda fm: fm.update(change))
    _refused(uri, target, src, SchemaError, r"eaglenest_export\.json: key " + match)


def test_a_record_whose_weights_hash_is_not_a_string_is_refused(sp):
    uri, target, src = sp

    def number(fm):
        fm["identity"] = json.dumps({**json.loads(fm["identity"]), "weights_sha256": 5})

    _edit_meta(src, number)
    _refused(uri, target, src, SchemaError, r"eaglenest_export\.json: key 'feature_meta\.identity' weights_sha256 "
             r"is 5, expected a sha256 string")


def test_a_dataset_info_of_the_wrong_json_type_is_refused(sp):
    uri, target, src = sp
    (src / "dataset_info.json").write_text("[]")
    _refused(uri, target, src, StoreError, r"--src .*sp: not a datasets save_to_disk directory \(.*'list' object")


@pytest.mark.parametrize("exporter, importer", [(hf, speculators), (speculators, specforge), (specforge, speculators)])
def test_an_export_of_another_format_is_named_as_such(base, exporter, importer):
    """An hf export holds input_ids and loss_mask as speculators' dataset does, but no hidden states:
    it was refused as a partial copy (a missing file), which it is not."""
    uri, target, tmp = base
    kw = {} if exporter is hf else {"target": target}
    exporter.export(source.open_source(uri, "features"), tmp / "out", **kw)
    _refused(uri, target, tmp / "out", SchemaError,
             rf"out/eaglenest_export\.json: key 'format' is '{exporter.FORMAT}': an eaglenest export of another "
             rf"format, not a {importer.FORMAT} dump", module=importer)


# -- --out an empty mount point (a container's volume): refused before the export, not after it ---------

@pytest.fixture
def mount_point(tmp_path):
    """An empty tmpfs mounted at a folder (needs root: skipped elsewhere), unmounted after the test."""
    point = tmp_path / "volume"
    point.mkdir()
    if not shutil.which("mount") or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "eaglenest-test",
                                                     str(point)], capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (not root)")
    try:
        yield point
    finally:
        subprocess.run(["umount", str(point)], check=True)


@pytest.mark.parametrize("linked", [False, True])
def test_out_a_mount_point_is_refused_before_writing(base, mount_point, linked, monkeypatch):
    """The export is renamed onto --out, which a mount point refuses (EBUSY): only after every file is written."""
    uri, target, tmp = base
    out = mount_point
    if linked:
        out = tmp / "link"
        out.symlink_to(mount_point)
    read = []
    monkeypatch.setattr(specforge, "iter_samples", lambda *a, **k: read.append(1) or iter(()))
    with pytest.raises(ConfigError, match=r"^--out .*: a mount point; give a new directory inside it"):
        specforge.export(source.open_source(uri, "features"), out, target=target)
    assert not read and not list(mount_point.iterdir())


def test_sample_lines_that_are_not_utf8_are_refused(sp):
    # Decoded with errors="replace": a byte that is not UTF-8 silently changed a sample id (or domain).
    uri, target, src = sp
    path = src / "eaglenest_samples.jsonl"
    path.write_bytes(path.read_bytes().replace(b'"sample_id": "', b'"sample_id": "\xff', 1))
    _refused(uri, target, src, SchemaError, r"eaglenest_samples\.jsonl: not UTF-8 text \(byte \d+\)")


# == second pass ==================================================================================

def _export_cli(tmp, uri, target, out, capsys, fmt="specforge"):
    """``featurestore export`` in process: (exit code, the last line on stderr)."""
    rc = cli.main(["export", "--format", fmt, "--out", str(out), "--draft-vocab-size", "16", f"run.workdir={tmp}",
                   f"run.store={uri}", f"run.target={target}"])
    err = capsys.readouterr().err.strip().splitlines()
    return rc, err[-1] if err else ""


# -- the table's target path now holds another model: its final norm must not be applied -------------

def test_a_recorded_target_that_now_holds_another_model_is_refused(base, capsys):
    """The recorded path was trusted because it exists: a model rebuilt or replaced there since the
    capture gave its final norm and vocabulary to hidden states it did not make, exit 0."""
    uri, target, tmp = base
    I.tiny_target(tmp / "target", seed=1)  # another model at the table's target path
    rc, last = _export_cli(tmp, uri, target, tmp / "out", capsys)
    assert rc == 2 and last.startswith(f"featurestore: error: run.target: the table's features were captured from "
                                       f"{target}, which holds another model now (weights other than"), last
    assert not (tmp / "out").exists() and not list(tmp.glob(".out.partial-*"))


def test_a_copy_of_the_model_stands_in_for_a_replaced_recorded_target(base, capsys):
    uri, target, tmp = base
    copy = shutil.copytree(target, tmp / "copy")
    I.tiny_target(tmp / "target", seed=1)
    rc, last = _export_cli(tmp, uri, copy, tmp / "out", capsys)
    assert rc == 0, last
    weight, eps = specforge.final_norm(str(copy))
    other, _ = specforge.final_norm(target)
    assert not torch.equal(weight, other)  # the two norms differ: the check below tells them apart
    rows = {r["sample_id"]: r for r in I.table_rows(uri, "features")}
    lines = [json.loads(x) for x in (tmp / "out" / "eaglenest_samples.jsonl").read_text().splitlines()]
    assert len(lines) == len(rows) == 5
    for line in lines:
        d = torch.load(tmp / "out" / line["file"], weights_only=True)
        last_hidden = d[specforge.PRENORM_KEY][0]
        assert torch.equal(d["hidden_state"][0], specforge.apply_norm(last_hidden, weight, eps)), line["file"]


# -- a damaged target (an interrupted download) under SpecForge's final norm: one line, not a traceback ----

def _missing_shard(t):
    (t / "model.safetensors").rename(t / "model-00001-of-00002.safetensors")
    (t / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
        "model.norm.weight": "model-00002-of-00002.safetensors"}}))


def _truncated(t):
    (t / "model.safetensors").write_bytes((t / "model.safetensors").read_bytes()[:40])


def _index_not_json(t):
    (t / "model.safetensors.index.json").write_text('{"weight_map": {"model.norm.weight": ')


def _index_without_map(t):
    (t / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 1}}))


def _eps_text(t):
    cfg = json.loads((t / "config.json").read_text())
    (t / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": "1e-5x"}))


@pytest.mark.parametrize("damage, match", [
    (_missing_shard, r"cannot read .*model-00002-of-00002\.safetensors \(No such file"),
    (_truncated, r"cannot read .*model\.safetensors \(Error while deserializing header"),
    (_index_not_json, r"model\.safetensors\.index\.json: not valid JSON"),
    (_index_without_map, r"model\.safetensors\.index\.json has no 'weight_map'"),
    (_eps_text, r"config has rms_norm_eps '1e-5x', expected a positive number"),
])
def test_a_damaged_target_is_one_line_under_the_final_norm(base, damage, match):
    uri, target, tmp = base
    broken = Path(shutil.copytree(target, tmp / "broken"))
    damage(broken)
    with pytest.raises(ConfigError, match=match) as info:
        specforge.export(source.open_source(uri, "features"), tmp / "out", target=str(broken))
    assert "\n" not in str(info.value) and not (tmp / "out").exists()
    specforge.export(source.open_source(uri, "features"), tmp / "sf", target=target)
    for f in ("eaglenest_export.json", "eaglenest_samples.jsonl"):  # a foreign dump: the import divides by the norm
        (tmp / "sf" / f).unlink()
    for p in (tmp / "sf").rglob("*.ckpt"):
        d = torch.load(p, weights_only=True)
        del d[specforge.PRENORM_KEY]
        torch.save(d, p)
    with pytest.raises(ConfigError, match=match):
        specforge.import_dump(tmp / "sf", uri, "back", target=str(broken), layer_ids=[2, 4, 5])
    assert not store.exists(uri, "back")


# -- a target config's vocab_size that no vocabulary mapping can be over -------------------------------

@pytest.mark.parametrize("vocab", [-5, 0, 10**12, True])
@pytest.mark.parametrize("module", [speculators, specforge])
def test_an_impossible_vocab_size_is_refused_naming_the_config(base, module, vocab):
    """-5 and 0 were blamed on --draft-vocab-size ('must be in 1..-5'); 10**12 ran out of memory for t2d."""
    uri, target, tmp = base
    bad = Path(shutil.copytree(target, tmp / "bad"))
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "vocab_size": vocab}))
    with pytest.raises(ConfigError, match=rf"^run\.target: .*bad's config has vocab_size {vocab}, expected a "
                                          r"positive integer up to 2147483648") as info:
        module.export(source.open_source(uri, "features"), tmp / "out", draft_vocab_size=8, target=str(bad))
    assert "\n" not in str(info.value) and not (tmp / "out").exists()


# -- an empty --src / --out (an unset shell variable) is not the working directory --------------------

@pytest.mark.parametrize("module", [speculators, specforge])
def test_an_empty_src_is_refused_not_the_working_directory(base, module, monkeypatch):
    """``--src "$DUMP"`` with DUMP unset: Path('') is '.', so the dump in the working directory (a
    SpecForge import: every .ckpt under it) was imported."""
    uri, target, tmp = base
    module.export(source.open_source(uri, "features"), tmp / "here", target=target)
    monkeypatch.chdir(tmp / "here")
    _refused(uri, target, "", ConfigError, rf"^--src is empty; give the {module.FORMAT} dump's directory$",
             module=module)


@pytest.mark.parametrize("module", [hf, speculators, specforge])
def test_an_empty_out_is_refused_before_writing(base, module, monkeypatch):
    uri, target, tmp = base
    (tmp / "empty").mkdir()
    monkeypatch.chdir(tmp / "empty")  # an empty working directory passed as an empty new --out
    read = []
    monkeypatch.setattr(module, "iter_samples", lambda *a, **k: read.append(1) or iter(()))
    kw = {} if module is hf else {"target": target}
    with pytest.raises(ConfigError, match=r"^--out is empty; give a new directory$"):
        module.export(source.open_source(uri, "features"), "", **kw)
    # Nothing staged in the working directory nor beside it (as `.empty.partial-*`, had '' been resolved).
    assert not read and not list((tmp / "empty").iterdir()) and not list(tmp.glob(".*partial-*"))


# -- SpecForge: a dump whose folders are symbolic links (stitched from several disks) -----------------

@pytest.mark.parametrize("foreign", [True, False])
def test_a_specforge_folder_that_is_a_link_is_read(base, foreign):
    """``rglob`` does not enter a linked folder: a foreign dump lost those files without a word (here:
    every file, 'no .ckpt files'; beside a real folder, a silent partial import), an eaglenest export was
    'a partial copy'. A link back into the dump (a cycle) is walked once."""
    uri, target, tmp = base
    specforge.export(source.open_source(uri, "features"), tmp / "sf", target=target)
    if foreign:
        for f in ("eaglenest_export.json", "eaglenest_samples.jsonl"):
            (tmp / "sf" / f).unlink()
    shutil.move(str(tmp / "sf" / "rows_0-2000"), str(tmp / "other-disk"))
    (tmp / "sf" / "rows_0-2000").symlink_to(tmp / "other-disk")
    (tmp / "other-disk" / "loop").symlink_to(tmp / "sf")
    summary = specforge.import_dump(tmp / "sf", uri, "back", target=target, layer_ids=[2, 4, 5])
    assert summary["rows"] == 5
    want, got = I.table_rows(uri, "features"), I.table_rows(uri, "back")
    assert sorted(r["input_ids"] for r in got) == sorted(r["input_ids"] for r in want)
    if not foreign:
        I.assert_same_rows(uri, "features", "back")


# -- a foreign dump's aux layers are in ascending order, whatever order featurestore.layer_ids lists -----

@pytest.mark.parametrize("module", [speculators, specforge])
def test_a_foreign_dump_gets_its_layer_ids_ascending(base, module):
    """speculators' and SpecForge's captures append the aux layers as the forward meets them (ascending).
    ``featurestore.layer_ids=[5, 2, 4]`` labelled the stored layers 5, 2, 4: the trainer, which puts the
    aux layers in ascending id order, then fed layer 4 where layer 2 belongs (and exports said so)."""
    uri, target, tmp = base
    module.export(source.open_source(uri, "features"), tmp / "dump", target=target)
    for f in ("eaglenest_export.json", "eaglenest_samples.jsonl"):
        (tmp / "dump" / f).unlink()
    summary = module.import_dump(tmp / "dump", uri, "back", target=target, layer_ids=[5, 2, 4])
    assert summary["layer_ids"] == [2, 4, 5]
    assert S.feature_meta(store.dataset(uri, "back").schema).layer_ids == (2, 4, 5)
    want = {tuple(r["input_ids"]): r["aux_hidden"] for r in I.table_rows(uri, "features")}  # stored (2, 4, 5)
    got = I.table_rows(uri, "back")
    assert len(got) == len(want) == 5 and all(r["aux_hidden"] == want[tuple(r["input_ids"])] for r in got)


# -- speculators: a dump written by hs_connectors' FP8 connector (float8 hidden states, per-token scales) ----

def _to_fp8(src, *, scales=None):
    """Rewrite every hidden-state file as ``FP8HiddenStatesConnector`` writes it (its own quantizer)."""
    from safetensors.torch import load_file, save_file

    fp8 = importlib.import_module("hs_connectors.fp8_utils")  # installed by `make install` (Makefile)
    for p in sorted((src / "hidden_states").glob("hs_*.safetensors")):
        t = load_file(str(p))
        q, s = fp8.quantize_tensor_to_fp8(t["hidden_states"])
        save_file({**t, "hidden_states": q, fp8.SCALES_KEY: s if scales is None else scales(s)}, str(p))


def test_an_fp8_speculators_dump_imports_as_speculators_reads_it(base):
    """It was refused ('hidden states are F8_E4M3'): the rows come back as hs_connectors' own
    ``FP8Transfer`` (what speculators' trainer reads such a dump with) dequantizes them."""
    transfer = importlib.import_module("hs_connectors.transfer")
    uri, target, tmp = base
    speculators.export(source.open_source(uri, "features"), tmp / "fp8", target=target)
    for f in ("eaglenest_export.json", "eaglenest_samples.jsonl"):  # what speculators itself writes
        (tmp / "fp8" / f).unlink()
    _to_fp8(tmp / "fp8")
    summary = speculators.import_dump(tmp / "fp8", uri, "back", target=target, layer_ids=[2, 4, 5])
    assert summary["rows"] == 5 and summary["dtype"] == "bfloat16"
    rows = {tuple(r["input_ids"]): r for r in I.table_rows(uri, "back")}
    reader = transfer.FP8Transfer(tmp / "fp8" / "hidden_states")
    data = datasets.load_from_disk(str(tmp / "fp8")).with_format(None)
    assert len(rows) == len(data) == 5
    for i in range(len(data)):
        want = reader.get_cached(i)["hidden_states"]
        r, T = rows[tuple(data[i]["input_ids"])], len(data[i]["input_ids"])
        assert want.dtype == torch.bfloat16
        assert torch.equal(S.torch_from_blob(r["aux_hidden"], (T, 3, I.HIDDEN), "bfloat16"), want[:, :-1]), i
        assert torch.equal(S.torch_from_blob(r["last_hidden"], (T, I.HIDDEN), "bfloat16"), want[:, -1]), i


@pytest.mark.parametrize("scales, match", [
    (lambda s: s.reshape(-1), r"hidden_states F8_E4M3 with hidden_states_scales \('F32', \[\d+\]\)"),
    (lambda s: s.half(), r"hidden_states F8_E4M3 with hidden_states_scales \('F16', \[\d+, 1, 1\]\)"),
])
def test_fp8_scales_of_the_wrong_shape_or_dtype_are_refused(sp, scales, match):
    uri, target, src = sp
    _to_fp8(src, scales=scales)
    _refused(uri, target, src, SchemaError, r"hs_0\.safetensors: " + match)
