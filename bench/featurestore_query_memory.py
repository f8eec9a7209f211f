"""Peak memory of ``featurestore query`` at two table sizes: ``--with-tensors --out f.parquet``, and
(``--small``) an aggregate over the small columns, printed.

Builds two feature tables of synthetic EAGLE-3 rows (random fp32 hidden states, ``--row-mib`` MiB
of tensors per sample) holding ``--sizes`` MiB of tensor columns each, then runs, in a fresh
process per table, the query command as a user would (``featurestore query --with-tensors --sql
"SELECT * FROM features" --out x.parquet``, through ``featurestore.cli.main``) and prints that
process's peak RSS growth: ``VmHWM`` at the end minus ``VmRSS`` before the command (after importing
Lance, DuckDB and pyarrow, so the libraries' own footprint is not counted). The output files are
checked to hold every row.

Printed side by side for the sizes (both tables built first, then the queries alternated per round),
with the ratio large/small per round as median [min, max]. A query streamed to the file in
batches (``featurestore/read/query.py``) grows by about the same at both sizes (ratio ~1);
materialising the table grows with it (ratio ~ the size ratio). ``--check`` exits 1 when the
median ratio exceeds 1.5.

``--small``: the tables hold ``--sizes`` MiB of the small columns instead (16K-token rows, hidden
size 8, so ``input_ids`` and ``loss_mask`` are nearly all of it) and the query is an aggregate that
reads every token id, without ``--with-tensors`` and without ``--out``: ``SELECT domain, count(*),
sum(len(input_ids)) FROM features GROUP BY 1``. Each table is scanned batch by batch like the tensor
view (``featurestore/read/query.py``), so its growth does not follow the table either.

    python bench/featurestore_query_memory.py                    # 64 and 256 MiB, < 60 s here
    python bench/featurestore_query_memory.py --sizes 64,512 --rounds 3 --check
    python bench/featurestore_query_memory.py --small --check
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
from functools import partial
from pathlib import Path

from eaglenest.cli import at_least

# What the benches share: here, run_unwinding (bench/ is not a package: loaded from the file beside this one).
_spec = importlib.util.spec_from_file_location("_bench_arms", Path(__file__).with_name("arms.py"))
arms = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(arms)

#: Run in the child: peak RSS growth (MiB) of one query command, printed as JSON.
CHILD = r"""
import json, sys
import duckdb, lance, pyarrow.parquet  # noqa: F401 - imported before the baseline
from eaglenest.featurestore import cli

def kib(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1])

before = kib("VmRSS:")
if sys.argv[3] == "small":
    rc = cli.main(["query", "--sql", "SELECT domain, count(*) AS n, sum(len(input_ids)) AS t FROM features GROUP BY 1",
                   f"run.store={sys.argv[1]}"])
else:
    rc = cli.main(["query", "--with-tensors", "--sql", "SELECT * FROM features", "--out", sys.argv[2],
                   f"run.store={sys.argv[1]}"])
print(json.dumps({"rc": rc, "growth_mib": (kib("VmHWM:") - before) / 1024}))
"""


def build(uri: str, *, mib: int, row_mib: int, hidden: int = 1024, seed: int = 0) -> int:
    """A features table with ``mib`` MiB of tensor columns (fp32, ``row_mib`` MiB per sample)."""
    import numpy as np
    import pyarrow as pa

    from eaglenest.featurestore import schema as S
    from eaglenest.featurestore.table import store

    meta = S.FeatureMeta(target="bench", layer_ids=(1, 2, 3), last_layer_id=4, hidden_size=hidden,
                         dtype="float32", feature_set_id="bench-query-memory")
    tokens = row_mib * 2**20 // (4 * hidden * 4)  # aux [T, 3, H] + last [T, H], fp32
    n = mib // row_mib
    rng = np.random.default_rng(seed)
    for start in range(0, n, 8):  # one commit per 8 samples (bounded memory while building)
        rows = []
        for k in range(start, min(n, start + 8)):
            aux = rng.standard_normal((tokens, 3, hidden), dtype=np.float32)
            last = rng.standard_normal((tokens, hidden), dtype=np.float32)
            rows.append({"sample_id": f"s{k:06d}", "domain": "d", "source": "bench", "split": "train",
                         "mode": "chat", "gen_params_id": "g", "num_tokens": tokens, "num_loss_tokens": tokens - 1,
                         "input_ids": list(range(tokens)), "loss_mask": [0] + [1] * (tokens - 1),
                         "aux_hidden": S.encode_tensor(aux, "float32"), "last_hidden": S.encode_tensor(last, "float32")})
        table = pa.Table.from_pylist(rows, schema=S.features_schema(meta))
        store.append(uri, store.FEATURES, table, meta=meta)
    return n


def build_small(uri: str, *, mib: int, tokens: int = 16384, seed: int = 0) -> int:
    """A features table with about ``mib`` MiB of small columns (int32 ids and uint8 mask, ``tokens`` per
    row) and tensors of hidden size 8, so the tensor columns are a small share."""
    import numpy as np
    import pyarrow as pa

    from eaglenest.featurestore import schema as S
    from eaglenest.featurestore.table import store

    meta = S.FeatureMeta(target="bench", layer_ids=(1,), last_layer_id=4, hidden_size=1,
                         dtype="float16", feature_set_id="bench-query-memory-small")
    n = mib * 2**20 // (5 * tokens)
    rng = np.random.default_rng(seed)
    mask = np.ones(tokens, dtype=np.uint8)
    mask[0] = 0  # the first token is never a loss token (as in build)
    for start in range(0, n, 64):
        rows = []
        for k in range(start, min(n, start + 64)):
            rows.append({"sample_id": f"s{k:06d}", "domain": f"d{k % 3}", "source": "bench", "split": "train",
                         "mode": "chat", "gen_params_id": "g", "num_tokens": tokens, "num_loss_tokens": tokens - 1,
                         "input_ids": rng.integers(0, 150_000, tokens, dtype=np.int32),
                         "loss_mask": mask,  # num_loss_tokens ones: the store checks the count
                         # the smallest tensors whose sizes agree with num_tokens (the store checks them)
                         "aux_hidden": S.encode_tensor(np.zeros((tokens, 1, 1), np.float16), "float16"),
                         "last_hidden": S.encode_tensor(np.zeros((tokens, 1), np.float16), "float16")})
        store.append(uri, store.FEATURES, pa.Table.from_pylist(rows, schema=S.features_schema(meta)), meta=meta)
    return n


def peak_growth(uri: str, out: Path, mode: str = "tensors") -> float:
    proc = subprocess.run([sys.executable, "-c", CHILD, uri, str(out), mode], capture_output=True, text=True,
                          check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    rc = proc.returncode or (json.loads(lines[-1])["rc"] if lines else None)  # the child's, else the command's
    if rc != 0:
        raise SystemExit(f"query failed (exit {rc}): {proc.stderr.strip()[-500:]}")
    return json.loads(lines[-1])["growth_mib"]


def two_sizes(text: str) -> list[int]:
    """An argparse ``type`` for ``--sizes``: two MiB counts, the smaller first. The check reads growth
    large/small: sizes given the other way round (or equal) made a ratio a growing query passes."""
    try:
        sizes = [int(s) for s in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"two whole MiB counts, got {text!r}") from None
    if len(sizes) != 2 or not 0 < sizes[0] < sizes[1]:
        raise argparse.ArgumentTypeError(f"two sizes in MiB, the smaller first (64,256), got {text!r}")
    return sizes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=two_sizes, default="64,256",
                    help="two table sizes in MiB of tensor columns, the smaller first")
    ap.add_argument("--row-mib", type=at_least(1), default=4, help="MiB of tensors per sample")
    ap.add_argument("--rounds", type=at_least(1), default=2, help="rounds (sizes alternated; ratio median [min, max])")
    ap.add_argument("--check", action="store_true", help="exit 1 if large/small growth > 1.5")
    ap.add_argument("--small", action="store_true", help="small columns and an aggregate query (no tensors)")
    args = ap.parse_args(argv)
    sizes = args.sizes
    if not args.small and min(sizes) < args.row_mib:  # no whole sample fits: the table would have no rows
        ap.error(f"--sizes: each size must be at least --row-mib ({args.row_mib} MiB), "
                 f"got {','.join(map(str, sizes))}")
    import pyarrow.parquet as pq

    runs: dict[int, list[float]] = {mib: [] for mib in sizes}
    with tempfile.TemporaryDirectory(prefix="eaglenest-bench-query-") as tmp:
        rows = {mib: (build_small if args.small else partial(build, row_mib=args.row_mib))(
            str(Path(tmp) / f"store{mib}"), mib=mib) for mib in sizes}
        for r in range(args.rounds):  # the two sizes side by side, the order alternated per round
            for mib in (sizes if r % 2 == 0 else sizes[::-1]):
                out = Path(tmp) / f"out{mib}.parquet"
                runs[mib].append(peak_growth(str(Path(tmp) / f"store{mib}"), out, "small" if args.small else "tensors"))
                if not args.small:
                    assert pq.read_metadata(out).num_rows == rows[mib], "the output file lost rows"
                    out.unlink()
    small, large = sizes
    growth = {mib: statistics.median(runs[mib]) for mib in sizes}
    ratios = [b / max(a, 1e-9) for a, b in zip(runs[small], runs[large])]  # per round, large / small
    ratio = statistics.median(ratios)
    print(f"{'table (MiB of ' + ('small columns)' if args.small else 'tensors)'):>24} {small:>10} {large:>10}   ratio")
    print(f"{'peak RSS growth (MiB)':>24} {growth[small]:>10.0f} {growth[large]:>10.0f}   {ratio:.2f} "
          f"[{min(ratios):.2f}, {max(ratios):.2f}] over {args.rounds} rounds (table ratio {large / small:.1f})")
    return 1 if args.check and ratio > 1.5 else 0


if __name__ == "__main__":
    sys.exit(arms.run_unwinding(main))
