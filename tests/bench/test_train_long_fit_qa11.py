"""bench/train_long.py's least-squares line of peak RSS against tokens per sample: checked against numpy's
fit on known data, and a run that repeats a length (``--lengths 64,64``, to see the spread) ends with its
table instead of a ZeroDivisionError after every child ran."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from bench_helpers import load_bench  # tests/bench on sys.path via conftest

ROOT = Path(__file__).resolve().parents[2]


def load():
    return load_bench("train_long.py", "_bench_train_long_qa11")


def test_fit_agrees_with_numpy():
    xs = [2048.0, 8192.0, 16384.0, 32768.0]
    ys = [790.0, 1530.0, 2510.0, 4480.0]
    a, b, r2 = load().fit(xs, ys)
    slope, intercept = np.polyfit(xs, ys, 1)
    assert b == pytest.approx(slope, rel=1e-12) and a == pytest.approx(intercept, rel=1e-12)
    assert r2 == pytest.approx(np.corrcoef(xs, ys)[0, 1] ** 2, rel=1e-12)
    assert load().fit([1.0, 2.0, 3.0], [5.0, 7.0, 9.0]) == pytest.approx((3.0, 2.0, 1.0))


@pytest.mark.slow
def test_a_repeated_length_is_a_table_without_a_line():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "train_long.py"), "--lengths", "64,64",
                           "--hidden", "16", "--cp", "0", "--threads", "1"],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("\n| 64 |") == 2  # both runs in the table
    assert "least squares" not in proc.stdout  # no line through one length
