"""``featurestore export`` of a table whose target is not on this machine: ``run.target`` stands in
for it only when it is the same model (its weights hash is the one the table's identity records).
Another model is refused (its final norm would be applied to hidden states it did not make, its
vocabulary used for the draft vocabulary); a copy of the target is accepted."""

import json
import shutil
import subprocess
import sys

import pytest

import interop_helpers as I


def _export(tmp, uri, target, fmt, out):
    keys = [f"run.workdir={tmp}", f"run.store={uri}", f"run.target={target}"]
    return subprocess.run([sys.executable, "-m", "eaglenest.featurestore.cli", "export", "--format", fmt, "--out",
                           str(out), "--draft-vocab-size", "16", *keys], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("fmt", ["specforge", "speculators"])
def test_another_model_is_refused_a_copy_is_taken(tmp_path, fmt):
    target = I.tiny_target(tmp_path / "target")
    uri = str(tmp_path / "store")
    I.make_table(uri, target)
    copy = shutil.copytree(target, tmp_path / "copy")
    shutil.rmtree(target)  # the table's target is gone (captured on another machine)
    other = I.tiny_target(tmp_path / "other", seed=1)

    proc = _export(tmp_path, uri, other, fmt, tmp_path / "out-other")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert f"captured from {target}, which is not here, and {other} is another model" in last, last
    assert not (tmp_path / "out-other").exists()

    proc = _export(tmp_path, uri, copy, fmt, tmp_path / "out")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["rows"] == 5
