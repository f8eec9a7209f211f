"""The hub, sixth pass: an eaglenest export whose hidden size is not run.target's is refused before
anything is written (the weights hash leaves config.json out, and run.off_policy=true lets another
model in); a speculators dump whose dataset is parquet shards (pushed to the Hub) is named as such
with what to do; a ``--src`` / ``--out`` name the OS cannot take is one line, not a traceback; a dump
imported, killed outright mid-way and imported again holds each row once."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import datasets
import pytest

import interop_helpers as I
from interop_helpers import base  # noqa: F401  (a fixture: the table every test starts from)
from eaglenest import faults
from eaglenest.errors import SchemaError, StoreError
from eaglenest.featurestore import cli
from eaglenest.featurestore.interop import source, specforge, speculators
from eaglenest.featurestore.table import store

RECIPE = str(Path(__file__).resolve().parents[2] / "recipes" / "toy.yaml")
MODULES = {"speculators": speculators, "specforge": specforge}


def _export(base, module, name: str) -> Path:
    uri, target, tmp = base
    module.export(source.open_source(uri, "features"), tmp / name, target=target)
    return tmp / name


def _wider_copy(target: str, tmp: Path) -> str:
    """The same weights, a config saying hidden_size 16 (the table's states are 8 wide)."""
    copy = tmp / "wider"
    shutil.copytree(target, copy)
    cfg = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**cfg, "hidden_size": 2 * cfg["hidden_size"]}))
    return str(copy)


# -- 1: an eaglenest export's hidden size against run.target's --------------------------------------

@pytest.mark.parametrize("off_policy", [False, True])
@pytest.mark.parametrize("fmt", ["speculators", "specforge"])
def test_an_export_of_another_hidden_size_than_the_target_is_refused(base, fmt, off_policy):
    """Imported (exit 0) before: a table of 8-wide states for a 16-wide run.target, which fails only in
    the trainer. A foreign dump was already held to the target's width; an eaglenest export was not."""
    uri, target, tmp = base
    dump, wider = _export(base, MODULES[fmt], fmt), _wider_copy(target, tmp)
    with pytest.raises(SchemaError) as info:
        MODULES[fmt].import_dump(dump, uri, "back", target=wider, off_policy=off_policy)
    assert str(info.value) == (f"the dump's hidden size is 8 (eaglenest_export.json), run.target {wider} has 16: "
                               "set run.target to the dump's target; nothing was imported")
    assert not store.exists(uri, "back") and not store.table_path(uri, "back").exists()


@pytest.mark.parametrize("fmt", ["speculators", "specforge"])
def test_an_export_comes_back_bit_for_bit_with_its_own_target(base, fmt):
    uri, target, tmp = base
    summary = MODULES[fmt].import_dump(_export(base, MODULES[fmt], fmt), uri, "back", target=target)
    assert summary["rows"] == 5 and summary["dtype"] == "float32"
    I.assert_same_rows(uri, "features", "back")


# -- 2: a speculators dump whose dataset is parquet shards -----------------------------------------

def test_a_dataset_of_parquet_shards_is_named_with_what_to_do(base):
    """``snapshot_download`` of a dataset pushed to the Hub gives ``data/train-*.parquet``; the line
    said only that the folder is not a save_to_disk directory."""
    uri, target, tmp = base
    dump = _export(base, speculators, "sp")
    pushed = tmp / "pushed"
    shutil.copytree(dump / "hidden_states", pushed / "hidden_states")
    (pushed / "data").mkdir()
    shard = pushed / "data" / "train-00000-of-00001.parquet"
    datasets.load_from_disk(str(dump)).with_format(None).to_parquet(str(shard))
    with pytest.raises(StoreError) as info:
        speculators.import_dump(pushed, uri, "back", target=target)
    msg = str(info.value)
    assert msg.startswith(f"--src {pushed}: not a datasets save_to_disk directory (") and "\n" not in msg, msg
    assert msg.endswith("; it holds parquet shards (data/*.parquet: a dataset pushed to the Hub): load them with "
                        "datasets.load_dataset('parquet', data_files=..., split='train') and save_to_disk the result "
                        "into --src"), msg
    assert not store.exists(uri, "back")


def test_a_dataset_saved_as_parquet_then_to_disk_imports(base):
    """What the hint says works: the same rows, loaded from the shards and saved with save_to_disk."""
    uri, target, tmp = base
    dump = _export(base, speculators, "sp")
    shard = tmp / "train-00000-of-00001.parquet"
    datasets.load_from_disk(str(dump)).with_format(None).to_parquet(str(shard))
    loaded = datasets.load_dataset("parquet", data_files=str(shard), split="train", cache_dir=str(tmp / "cache"))
    saved = tmp / "saved"
    shutil.copytree(dump / "hidden_states", saved / "hidden_states")
    loaded.save_to_disk(str(saved / "ds"))
    for f in (saved / "ds").iterdir():
        f.rename(saved / f.name)
    summary = speculators.import_dump(saved, uri, "back", target=target)
    assert summary["rows"] == 5
    tokens = {name: sorted(store.read(uri, name, columns=["input_ids"]).column("input_ids").to_pylist())
              for name in ("features", "back")}
    assert tokens["back"] == tokens["features"] and len(tokens["back"]) == 5


# -- 3: a --src / --out the OS cannot take ---------------------------------------------------------

def _cli(capsys, base, *argv, table="back"):
    uri, target, tmp = base
    code = cli.main([*argv, "--recipe", RECIPE, f"run.store={uri}", f"run.workdir={tmp}", f"run.target={target}",
                     f"featurestore.table={table}"])
    return code, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize("verb", [["export", "--format", "hf", "--out"], ["export", "--format", "specforge",
                                  "--draft-vocab-size", "0", "--out"], ["import", "--format", "speculators", "--src"]])
def test_a_path_name_too_long_is_one_line(base, capsys, verb):
    """``OSError: [Errno 36] File name too long`` from pathlib was a traceback (exit 1)."""
    uri, target, tmp = base
    long = tmp / ("x" * 300)
    code, err = _cli(capsys, base, *verb, str(long), table="back" if verb[0] == "import" else "features")
    key = verb[-1]
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"featurestore: error: {key}: ") and err[0].endswith(": name too long"), err
    assert sorted(p.name for p in tmp.iterdir()) == ["store", "target"]


# -- 4: killed outright mid-way, then run again ----------------------------------------------------

@pytest.mark.parametrize("foreign", [False, True])
def test_an_import_killed_mid_way_then_run_again_holds_each_row_once(base, foreign):
    """SIGKILL after the first rows are written (the table created, nothing committed), then the same
    command: every row once, one committed version; a third run is refused, adding nothing."""
    uri, target, tmp = base
    dump = _export(base, specforge, "sf")
    if foreign:
        for f in dump.rglob("eaglenest_*"):
            f.unlink()
    argv = [sys.executable, "-c", "import sys; from eaglenest.featurestore.cli import main; sys.exit(main())",
            "import", "--format", "specforge", "--src", str(dump), "--recipe", RECIPE, f"run.workdir={tmp}",
            f"run.store={uri}", f"run.target={target}", "featurestore.table=back",
            "featurestore.write_buffer_mb=0.000001"]  # every row flushed: data files exist before the commit
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, faults.ENV: "import.row_written=30"})
    deadline = time.monotonic() + 120
    data = store.table_path(uri, "back") / "data"
    while not (data.is_dir() and any(data.iterdir())):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert store.sample_ids(uri, "back") == set()  # nothing committed
    again = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    ids = store.read(uri, "back", columns=["sample_id"]).column("sample_id").to_pylist()
    assert len(ids) == 5 and len(set(ids)) == 5
    if not foreign:
        I.assert_same_rows(uri, "features", "back")
    third = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert third.returncode == 2 and "is already in table 'back'" in third.stderr.strip().splitlines()[-1]
    assert len(store.read(uri, "back", columns=["sample_id"])) == 5
