"""Disk full in the middle of a real `featurestore capture`: exit 2, and the error is the last line.

Issue 23. The store side (one StoreError line, nothing of the commit committed) is
test_store_faults.py::test_disk_full_while_writing_commits_nothing_and_resumes; through the CLI, the
error line used to be followed by the multiprocessing resource tracker's reports of the shared
memory vLLM's killed engine process left (two lines per kind), printed as the CLI exited.

The disk fills as in the store test, with a file-size limit (a file past it: EFBIG, as ENOSPC for a
full disk), but set with ``prlimit`` on the capture's own process only once its engine is up and
its first fragment is written: the engine processes, already started, keep no limit (vLLM sizes
its shared memory with ``ftruncate``, which the limit would refuse at engine start).
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from eaglenest import faults
from eaglenest.engine import VLLM_LOG_ENV
from eaglenest.featurestore import schema as S
from eaglenest.featurestore.capture import policy
from eaglenest.featurestore.table import maintenance, store

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
#: Every fragment of one conversation is larger (>= 26 tokens x 4 hidden states x 128 x 4 bytes);
#: the run's vllm.log stays well below it.
LIMIT_BYTES = 48 * 1024


def _prompts(n: int) -> pa.Table:
    rng = np.random.default_rng(0)
    rows = [{"sample_id": f"d{i % 2}-{i:04d}", "domain": f"d{i % 2}", "source": "synthetic", "split": "train",
             "mode": "raw", "messages_json": "[]", "prompt_token_ids": rng.integers(3, 2000, 10 + i).tolist(),
             "response_token_ids": rng.integers(3, 2000, 16).tolist(), "finish_reason": "length",
             "gen_params_id": "g0"} for i in range(n)]
    return pa.Table.from_pylist(rows, schema=S.PROMPTS_SCHEMA)


def test_disk_full_during_capture_ends_with_one_error_line(tmp_path, root, tiny_target):
    uri = str(tmp_path / "store")
    store.append(uri, store.PROMPTS, _prompts(12),
                 lineage={"stage": "ingest", "shard": 0, **policy.lineage_record(str(tiny_target))})
    argv = [str(BIN / "featurestore"), "capture", f"run.workdir={tmp_path}", f"run.store={uri}",
            f"run.target={tiny_target}", "featurestore.commit_every=3", "featurestore.write_buffer_mb=0.001",
            "featurestore.engine.max_model_len=128", "featurestore.engine.memory_fraction=0.1",
            "featurestore.engine.max_num_seqs=4"]
    # A user's shell: no VLLM_LOGGING_* (the conftest sets one), so vLLM's INFO goes to logs/vllm.log.
    env = {k: v for k, v in os.environ.items() if k not in VLLM_LOG_ENV}
    env[faults.ENV] = "featurestore.before_commit=3"  # a window after the first fragments are written
    proc = subprocess.Popen(argv, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=env)
    try:
        data = store.table_path(uri, store.FEATURES) / "data"
        deadline = time.time() + 600
        while not (data.is_dir() and any(data.iterdir())):
            assert proc.poll() is None and time.time() < deadline, proc.stderr.read()[-3000:]
            time.sleep(0.02)
        resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (LIMIT_BYTES, resource.RLIM_INFINITY))
        _, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 2, err[-3000:]
    lines = err.strip().splitlines()
    ours = [i for i, line in enumerate(lines) if line.startswith("featurestore: error: ")]
    assert ours == [len(lines) - 1], err[-3000:]  # one error line, and nothing after it
    assert "cannot write table 'features'" in lines[-1] and "File too large" in lines[-1]
    for noise in ("Traceback", "Logging error", "resource_tracker", "leaked"):
        assert noise not in err, err[-3000:]
    # The tracker's bookkeeping went where vLLM's INFO lines go.
    assert (tmp_path / "logs" / "vllm.log").stat().st_size < LIMIT_BYTES
    # Whatever was committed before the disk filled is whole; the failed commit is not in it.
    if store.exists(uri, store.FEATURES):
        assert maintenance.verify(uri, store.FEATURES)["ok"]
        ids = store.read(uri, store.FEATURES, columns=["sample_id"]).column("sample_id").to_pylist()
        assert len(ids) == len(set(ids)) < 12
