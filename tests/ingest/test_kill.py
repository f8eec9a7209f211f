"""SIGKILL `ingest build` at a random point, run it again: every prompt is in the table exactly once.

Real vLLM in a real subprocess; the kill lands after at least one shard commit, at a random delay
(the seed is printed so a failure can be replayed), and takes the engine-core process with it.
The run is held 0.4 s between writing each shard's fragments and committing them (the fault point
``ingest.before_commit``), so the kill lands before the run ends however fast the machine is, and
often inside the window where uncommitted fragments are on disk.
"""

from __future__ import annotations

import collections
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eaglenest import faults
from eaglenest.featurestore.table import store

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
HOLD = 0.4
def _rows(uri: str) -> int:
    try:
        return len(store.sample_ids(uri, store.PROMPTS))
    except Exception:  # noqa: BLE001 - the table may be mid-creation
        return 0


def test_sigkill_then_rerun_is_exactly_once(tmp_path, root, tiny_target, small_manifest):
    CAPS, write_manifest = small_manifest
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    manifest = write_manifest(tmp_path / "m.yaml", root, max_tokens=32)
    work = tmp_path / "work"
    uri = str(work / "store")
    argv = [str(BIN / "ingest"), "build", "--manifest", str(manifest), f"run.workdir={work}",
            f"run.target={tiny_target}", "ingest.commit_every=3", "ingest.engine.max_num_seqs=4",
            "ingest.engine.max_model_len=512"]
    env = {**os.environ, faults.ENV: f"ingest.before_commit={HOLD}"}
    proc = subprocess.Popen(argv, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True, env=env)
    try:
        deadline = time.time() + 300
        # Kill at a random moment after a random number of training shards (1..3 of 7) is committed;
        # the 4 held-out rows are committed first, each training shard adds 3 rows. At least 4
        # shards remain, each held HOLD seconds, so the kill lands well before the run can end.
        threshold = 4 + 3 * rng.randint(1, 3)
        while _rows(uri) < threshold and proc.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 2 * HOLD))
        killed = proc.poll() is None
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    before = len(store.sample_ids(uri, store.PROMPTS))
    print(f"seed={seed} killed={killed} rows_before_rerun={before}")
    assert killed, f"the run finished before the kill (seed {seed}); {proc.stderr.read()[-2000:]!r}"
    total = sum(CAPS.values())
    assert 0 < before < total
    rerun = subprocess.run(argv, cwd=root, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    t = store.read(uri, store.PROMPTS, columns=["sample_id", "domain", "split", "finish_reason"])
    ids = t.column("sample_id").to_pylist()
    assert len(ids) == len(set(ids)) == total
    assert collections.Counter(t.column("domain").to_pylist()) == CAPS
    split = collections.Counter(zip(t.column("domain").to_pylist(), t.column("split").to_pylist()))
    assert all(split[(d, "heldout")] == 2 for d in CAPS)
    assert all(f for f, s in zip(t.column("finish_reason").to_pylist(), t.column("split").to_pylist())
               if s == "train")
