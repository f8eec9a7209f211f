"""What walking docs/export.md found: an export's `--out` is refused in one line when it lies inside the
feature store (the export would be written into a Lance table's folder) or is a file, and nothing is
written there; what a SIGKILLed export left beside `--out` is removed by the next export."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from eaglenest.errors import ConfigError
from eaglenest.featurestore.interop import hf, source

sys.path.insert(0, str(Path(__file__).parent / "featurestore"))
import interop_helpers as I  # noqa: E402


@pytest.fixture
def table(tmp_path):
    target = I.tiny_target(tmp_path / "target")
    uri = str(tmp_path / "store")
    I.make_table(uri, target)
    return uri


@pytest.mark.parametrize("inside", ["", "features.lance/export", "features.lance/data/x"])
def test_export_out_inside_the_store_is_refused(table, inside):
    out = Path(table, inside) if inside else Path(table)
    before = sorted(p.name for p in Path(table, "features.lance").rglob("*"))
    with pytest.raises(ConfigError) as err:
        hf.export(source.open_source(table, "features"), out, with_tensors=False, config={})
    assert f"--out {out}" in str(err.value) and "feature store" in str(err.value)
    assert sorted(p.name for p in Path(table, "features.lance").rglob("*")) == before


def test_export_out_a_file_is_named_a_file(table, tmp_path):
    out = tmp_path / "a-file"
    out.write_text("keep me")
    with pytest.raises(ConfigError, match=r"--out .*a-file: is a file"):
        hf.export(source.open_source(table, "features"), out, with_tensors=False, config={})
    assert out.read_text() == "keep me"


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_export_removes_what_a_killed_export_left_beside_out(table, tmp_path):
    dead = tmp_path / f".out.partial-{_dead_pid()}-abc"  # a SIGKILLed export's half-written folder
    (dead / "hidden_states").mkdir(parents=True)
    (dead / "hidden_states" / "hs_0.safetensors").write_bytes(b"half")
    live = tmp_path / f".out.partial-{os.getpid()}-def"  # a live export's: kept
    live.mkdir()
    hf.export(source.open_source(table, "features"), tmp_path / "out", with_tensors=False, config={})
    assert not dead.exists() and live.exists()
    assert sorted(p.name for p in tmp_path.glob(".out.partial-*")) == [live.name]
