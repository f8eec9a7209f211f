"""bench/featurestore_query_memory.py ran every round of the small table, then every round of the large one,
and printed one ratio of two medians, with no spread: the claim's ratio was not side by side per round and
had no interval. Now both tables are built first, the two queries alternate per round, and the ratio
large/small is printed per round as median [min, max] (the ``--check`` reads the median)."""

from __future__ import annotations

import re

from bench_helpers import load_bench  # tests/bench on sys.path via conftest


def test_the_ratio_is_per_round_with_an_interval(capsys):
    bench = load_bench("featurestore_query_memory.py", "_bench_qm_qa11")
    assert bench.main(["--sizes", "4,8", "--row-mib", "4", "--rounds", "3"]) == 0
    out = capsys.readouterr().out
    found = re.search(r"peak RSS growth \(MiB\)\s+(\d+)\s+(\d+)\s+([\d.]+) \[([\d.]+), ([\d.]+)\] over 3 rounds", out)
    assert found, out
    median, low, high = (float(x) for x in found.groups()[2:])
    assert 0 < low <= median <= high


def test_small_columns_mode_builds_tables_the_store_accepts(capsys):
    """``--small`` (a command BENCHMARKS.md records) built rows whose loss mask held num_tokens ones against a
    num_loss_tokens of num_tokens - 1: the store refused the first write, a SchemaError traceback."""
    bench = load_bench("featurestore_query_memory.py", "_bench_qm_small_qa11")
    assert bench.main(["--small", "--sizes", "1,2", "--rounds", "1", "--check"]) in (0, 1)  # 1: a missed check
    out = capsys.readouterr().out
    assert re.search(r"table \(MiB of small columns\)\s+1\s+2\s+ratio", out), out
    assert re.search(r"peak RSS growth \(MiB\)\s+\d+\s+\d+\s+[\d.]+ \[[\d.]+, [\d.]+\] over 1 rounds", out), out
