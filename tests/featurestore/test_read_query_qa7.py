"""Hostile pass on ``featurestore query`` and version arguments (qa7): a ``query --out`` killed
mid-write must not leave its temporary file behind for good; a signed number given as a version
(``--version -1``, Python's "the last one") is no version, not a tag name to look up; and a query's
batches are sized by the table's largest row, not its first (rows differ in length a thousandfold)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eaglenest.errors import ConfigError
from eaglenest.featurestore import cli
from eaglenest.featurestore import schema as S
from eaglenest.featurestore.read import query
from eaglenest.featurestore.table import names, store

import fs_helpers as H  # on sys.path via conftest

RECIPE = str(Path(__file__).resolve().parents[2] / "recipes" / "toy.yaml")


@pytest.fixture
def small(tmp_path):
    uri, m = str(tmp_path / "my store"), H.meta()
    store.append(uri, store.FEATURES, H.table([f"s{i}" for i in range(4)], m), meta=m)
    store.append(uri, store.FEATURES, H.table([f"t{i}" for i in range(3)], m, seed=1), meta=m)
    return uri


def _killed_writer(out) -> int:
    """Run a process that starts ``query --out`` into ``out`` the way write_query does (its temporary
    file beside ``out``, some bytes in it) and is SIGKILLed there; returns its pid."""
    code = ("import os, signal, sys\n"
            "from eaglenest.featurestore.read import query\n"
            "tmp = query.temp_path(sys.argv[1])\n"
            "tmp.write_bytes(b'PAR1 half a file')\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(out)])
    assert proc.wait(timeout=120) == -signal.SIGKILL
    return proc.pid


def test_query_out_rerun_removes_the_temp_file_a_killed_run_left(small, tmp_path):
    out = tmp_path / "out dir" / "res [1].parquet"
    out.parent.mkdir()
    pid = _killed_writer(out)
    left = query.temp_path(out, pid)
    assert left.exists()  # what a SIGKILL leaves: nothing can remove it in the killed process
    rows = query.write_query(small, "SELECT sample_id FROM features ORDER BY sample_id", out)
    assert rows == 7 and pq.read_table(out).column("sample_id").to_pylist() == sorted(
        [f"s{i}" for i in range(4)] + [f"t{i}" for i in range(3)])
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name]


def test_query_out_keeps_a_live_writers_temp_file_and_other_outputs(small, tmp_path):
    out = tmp_path / "res.parquet"
    live = query.temp_path(out, os.getppid())  # a process that is running: its write is in progress
    live.write_bytes(b"in progress")
    other = query.temp_path(tmp_path / "other.parquet", _killed_writer(tmp_path / "other.parquet"))
    assert query.write_query(small, "SELECT count(*) AS n FROM features", out) == 1
    assert live.read_bytes() == b"in progress" and other.exists()


@pytest.mark.parametrize("text", ["-1", "-0", "+3", "-12"])
def test_a_signed_version_number_is_refused_not_looked_up_as_a_tag(text):
    with pytest.raises(ConfigError, match=r"--version .*version number"):
        names.version_arg(text)


def test_checkout_version_minus_one_says_it_is_no_version(small, capsys):
    code = cli.main(["checkout", "--v=-1", "--recipe", RECIPE, f"run.store={small}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "no tag" not in err[0] and "version number" in err[0], err


CHILD = H.PEAK_CHILD


def _rows_of(m, sizes: list[int]) -> pa.Table:
    rng = np.random.default_rng(0)
    rows = []
    for k, T in enumerate(sizes):
        aux = rng.standard_normal((T, len(m.layer_ids), m.hidden_size), dtype=np.float32)
        last = rng.standard_normal((T, m.hidden_size), dtype=np.float32)
        rows.append({"sample_id": f"b{k}", "domain": "d", "source": "s", "split": "train", "mode": "chat",
                     "gen_params_id": "g", "num_tokens": T, "num_loss_tokens": T - 1, "input_ids": [0] * T,
                     "loss_mask": [0] + [1] * (T - 1), "aux_hidden": S.encode_tensor(aux, m.dtype),
                     "last_hidden": S.encode_tensor(last, m.dtype)})
    return pa.Table.from_pylist(rows, schema=S.features_schema(m))


def test_query_out_memory_is_bounded_when_the_first_row_is_short(small, tmp_path):
    """The batch was sized by the table's first row: a 2-token first row before 31 rows of 4 MiB
    (short and long conversations in one table) made batches of 2,000 rows, the whole table in one,
    and the command grew ~410 MiB for a 124 MiB table (~90 MiB when the rows are alike). Sized by the
    largest row it stays far below the table's size, as test_query_out bounds it for alike rows: 252 MiB
    here, bounded at 180 MiB (a loaded machine's noise measured up to ~120 MiB at any table size)."""
    m = H.meta(hidden=1024)
    big = str(tmp_path / "big")
    tokens = 4 * 2**20 // (4 * m.hidden_size * 4)  # 4 MiB of fp32 tensors a row
    store.append(big, store.FEATURES, _rows_of(m, [2] + [tokens] * 63), meta=m)
    out = tmp_path / "big.parquet"
    proc = subprocess.run([sys.executable, "-c", CHILD, small, big, str(out), "--recipe", RECIPE], capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    growth = json.loads(proc.stdout.strip().splitlines()[-1])["growth_mib"]
    got = pq.read_table(out, columns=["sample_id", "num_tokens"])
    assert got.num_rows == 64 and sorted(got.column("num_tokens").to_pylist()) == [2] + [tokens] * 63
    assert growth < 180, f"peak RSS grew {growth:.0f} MiB for a 252 MiB table"
