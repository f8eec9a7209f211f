"""QA of import/export: a full disk under torch.save, two imports of one dump racing into one table,
sample lines that name rows the dump does not hold or are missing, a dataset whose input_ids are not
lists, records of another format or with impossible layer ids, an ``--out`` that is a symbolic link
or a mount point, a SpecForge ``.ckpt`` that is a dangling link."""

import contextlib
import json
import os
import shutil
import subprocess
import sys

import datasets
import pytest

import interop_helpers as I
from eaglenest.errors import ConfigError, SchemaError, StoreError
from eaglenest.featurestore.interop import hf, source, specforge, speculators
from eaglenest.featurestore.table import lease, store


@pytest.fixture
def base(tmp_path):
    target = I.tiny_target(tmp_path / "target")
    uri = str(tmp_path / "store")
    I.make_table(uri, target)
    return uri, target, tmp_path


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
