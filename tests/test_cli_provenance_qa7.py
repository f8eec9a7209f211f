"""The command line a train checkpoint's provenance records (QA pass 7). ``train launch`` runs its ranks as
``python -m eaglenest.pipeline.train_cli run ...``, whose sys.argv[0] is that module's file: the record
held the file's absolute path (a machine's path, and no command anyone types) because ``train run``
handed ``sys.argv`` to the provenance writer instead of letting it name the module. One real training
step in a process of its own; no engine."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "recipes" / "toy.yaml"


def _synth():
    spec = importlib.util.spec_from_file_location("_eaglenest_test_synth_qa7", ROOT / "tests" / "train" / "synth.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.timeout(600)
def test_a_module_run_of_train_records_python_dash_m(tmp_path, tiny_target):
    synth = _synth()
    store = str(tmp_path / "store")
    synth.write_features(store, tiny_target, synth.greedy_sequences(tiny_target, n=6, prompt_len=8, gen_len=16))
    work = tmp_path / "work"
    args = ["run", "--recipe", str(RECIPE), f"run.workdir={work}", f"run.target={tiny_target}", f"run.store={store}",
            "train.num_steps=1", "train.draft_vocab_size=256", "train.pack_tokens=96", "train.batch_rows=2",
            "train.ttt_steps=2", "train.num_threads=1", "train.track.tensorboard=false"]
    cwd = tmp_path / "elsewhere"  # not the checkout: a module file under it would be shown relative to it
    cwd.mkdir()
    proc = subprocess.run([sys.executable, "-m", "eaglenest.pipeline.train_cli", *args], cwd=cwd, timeout=540,
                          capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    argv = json.loads((work / "train" / "provenance.json").read_text())["argv"]
    assert argv == ["python", "-m", "eaglenest.pipeline.train_cli", *args], argv
