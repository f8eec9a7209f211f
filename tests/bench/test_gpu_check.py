"""bench/gpu_check.py within the GPU machine's limits, and the real check where a GPU is present.

The dry run (CPU, gloo, tiny shapes) runs in a subprocess set up like the GPU machine:

* vllm, lance/lancedb, duckdb, dask, matplotlib and datasets cannot be imported at all;
* tqdm and pyyaml cannot be imported BY eaglenest or the script. They stay importable for
  transformers, which cannot import without them (huggingface_hub imports both), so wherever
  transformers is installed they are too; what must hold is that our code never needs them;
* the installed (editable) eaglenest is removed from the import system: the script must map the
  stage folders to ``eaglenest.*`` itself, from ``PYTHONPATH`` = the repository root, as
  bench/gpu_check.sh sets it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.py"

# Runs the script as __main__ under the import limits above; exits 3 if a blocked module got in.
WRAPPER = r"""
import builtins, importlib.abc, json, runpy, sys
ABSENT = {"vllm", "lance", "lancedb", "duckdb", "dask", "distributed", "matplotlib", "datasets"}
OURS_ONLY = {"tqdm", "yaml"}

class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ABSENT:
            raise ImportError(f"{name} is not installed on the GPU machine")
        return None

sys.meta_path[:] = [Absent()] + [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "")]
real_import = builtins.__import__

def guarded(name, globals=None, locals=None, fromlist=(), level=0):
    who = (globals or {}).get("__name__") or ""
    if level == 0 and name.partition(".")[0] in OURS_ONLY and (who.startswith("eaglenest") or who == "__main__"):
        raise ImportError(f"{who} imports {name}, which the GPU machine may not have")
    return real_import(name, globals, locals, fromlist, level)

builtins.__import__ = guarded
sys.argv = [sys.argv[1], *sys.argv[2:]]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
except SystemExit as e:
    code = e.code or 0
else:
    code = 0
leaked = sorted(m for m in sys.modules if m.partition(".")[0] in ABSENT)
origin = getattr(sys.modules.get("eaglenest.train.ttt"), "__file__", "")
print(json.dumps({"leaked": leaked, "ttt_file": origin}), file=sys.stderr)
sys.exit(3 if leaked else code)
"""


def load_script():
    spec = importlib.util.spec_from_file_location("_eaglenest_gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # module level: stdlib only
    return mod


@pytest.mark.slow
def test_dry_run_within_gpu_machine_limits(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OUT": str(tmp_path / "out"), "OMP_NUM_THREADS": "1",
           "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-c", WRAPPER, str(SCRIPT), "--dry-run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    info = json.loads(proc.stderr.strip().splitlines()[-1])
    assert info["leaked"] == []
    assert Path(info["ttt_file"]).resolve() == ROOT / "train" / "ttt.py"  # through the script's shim
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert json.loads(proc.stdout) == report
    assert report["mode"] == "dry-run" and report["ok"] is True
    fsdp = report["sections"]["fsdp2"]
    assert fsdp["ok"] and fsdp["backend"] == "gloo" and fsdp["world_size"] == 1
    assert fsdp["target_chunk_tokens"] < fsdp["shape"]["tokens"]  # the chunked path ran under FSDP2
    assert fsdp["max_rel_diff"] <= 1e-4 and fsdp["losses_fsdp2"][-1] < fsdp["losses_fsdp2"][0]
    trainer = report["sections"]["trainer_bf16"]
    chunk = trainer["shape"]["chunk"]
    assert chunk < trainer["shape"]["tokens"]
    assert set(trainer["variants"]) == {f"target_chunk_tokens={chunk}", "target_chunk_tokens=0"}
    for v in trainer["variants"].values():
        assert v["tokens_per_second"] > 0 and len(v["losses"]) == 3
    offline = report["sections"]["offline_al"]
    assert offline["ok"] and offline["lossless"] == "3/3" and offline["rounds"] > 0


def test_script_defaults_match_the_trainer():
    from eaglenest.train.config import TrainConfig

    mod = load_script()
    assert mod.DEFAULT_CHUNK == TrainConfig().target_chunk_tokens
    assert mod.REAL["chunk"] < mod.REAL["tokens"]  # the realistic run takes the chunked path
    import tomllib

    dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    assert mod.PACKAGE_DIRS == dirs


@pytest.mark.gpu
def test_gpu_check_on_gpu(tmp_path):
    """The real check (CUDA, NCCL, realistic shape); skipped on CPU by tests/conftest.py."""
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["mode"] == "gpu" and report["ok"] is True
    assert report["sections"]["fsdp2"]["backend"] == "nccl"
    trainer = report["sections"]["trainer_bf16"]
    chunked = trainer["variants"][f"target_chunk_tokens={trainer['shape']['chunk']}"]
    assert chunked["mfu"] > 0 and chunked["peak_memory_gib"] > 0
    assert report["seconds"] < 8 * 60
