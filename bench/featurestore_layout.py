"""Row-per-sample vs chunked rows for the features table: write and shuffled-read cost, side by side.

Two Lance tables (file format 2.0, as the store writes) of the same EAGLE-3 features (see
featurestore_write.py), on the same disk:

* per-sample: one row per sample (the store's layout): ``aux_hidden`` / ``last_hidden`` values of
  T x 32 KiB (T = 1-2K tokens: 32-64 MiB per value at H=4096).
* chunked: one row per ``--chunk-tokens`` tokens of a sample (``sample_id``, ``chunk`` index,
  the chunk's ids and tensor bytes); a sample is its rows with that id, in chunk order.

Measured per round (contender order alternates): the write (``lance.write_dataset`` + fsync of
every file), a shuffled read of whole samples (per-sample: one take per sample; chunked: one take
of the sample's chunk rows, then the chunks concatenated), and a shuffled read of single
``--chunk-tokens`` windows (what a trainer sampling fixed windows would read; per-sample must
read whole values). Reads are cold: pages evicted with posix_fadvise(DONTNEED) first. Prints
chunked / per-sample time ratios as median [min, max] (> 1: chunked is slower).

    python bench/featurestore_layout.py                  # ~0.6 GiB, 3 rounds, < 90 s here
    python bench/featurestore_layout.py --chunk-tokens 512 --samples 24
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from eaglenest.cli import at_least

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("_bench_featurestore_write", HERE / "featurestore_write.py")
W = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(W)


def _binary(arrays: list[np.ndarray]):
    import pyarrow as pa

    return pa.array([a.tobytes() for a in arrays], pa.large_binary())


def table(samples: list[dict], chunk_tokens: int | None):
    """Rows of the samples: one per sample (``chunk_tokens`` None) or one per chunk of tokens."""
    import pyarrow as pa

    sid, chunk, ids, aux, last = [], [], [], [], []
    for k, s in enumerate(samples):
        step = chunk_tokens or len(s["ids"])
        for c, a in enumerate(range(0, len(s["ids"]), step)):
            sid.append(k)
            chunk.append(c)
            ids.append(s["ids"][a:a + step])
            aux.append(s["aux"][a:a + step])
            last.append(s["last"][a:a + step])
    return pa.table({"sample": pa.array(sid, pa.int32()), "chunk": pa.array(chunk, pa.int32()),
                     "input_ids": pa.array(ids, pa.list_(pa.int32())),
                     "aux_hidden": _binary(aux), "last_hidden": _binary(last)})


def write(tab, path: Path) -> None:
    import lance

    lance.write_dataset(tab, str(path), data_storage_version="2.0")
    W.sync_tree(path)


def read_samples(path: Path, rows_of: list[list[int]], order: list[int]) -> int:
    """Whole samples in shuffled order; returns the bytes of tensors delivered."""
    import lance

    ds = lance.dataset(str(path))
    total = 0
    for k in order:
        t = ds.take(rows_of[k], columns=["input_ids", "aux_hidden", "last_hidden"])
        aux = b"".join(t.column("aux_hidden").to_pylist()) if t.num_rows > 1 else t.column("aux_hidden")[0].as_buffer()
        total += len(aux) + t.column("last_hidden").nbytes
    return total


def read_windows(path: Path, rows_of: list[list[int]], picks: list[tuple[int, int]], chunk_tokens: int,
                 per_sample: bool, row_bytes: int) -> int:
    """One ``chunk_tokens`` window of each picked (sample, chunk); returns the window bytes delivered."""
    import lance

    ds = lance.dataset(str(path))
    total = 0
    for k, c in picks:
        row = rows_of[k][0] if per_sample else rows_of[k][c]
        t = ds.take([row], columns=["aux_hidden"])
        blob = t.column("aux_hidden")[0].as_buffer()
        lo = c * chunk_tokens * row_bytes if per_sample else 0
        total += len(blob[lo:lo + chunk_tokens * row_bytes])
    return total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    W.add_sample_args(ap, samples=12)
    ap.add_argument("--chunk-tokens", type=at_least(1), default=256, help="tokens per row of the chunked layout")
    ap.add_argument("--rounds", type=at_least(1), default=3, help="rounds (arms alternated; median [min, max])")
    ap.add_argument("--dir", type=W.scratch_dir, default="/tmp", help="parent of the temporary directory")
    args = ap.parse_args(argv)
    W.check_sample_args(ap, args)

    samples = W.make_samples(args.samples, args.min_tokens, args.max_tokens, args.hidden)
    nbytes = W.feature_bytes(samples)
    tabs = {"per-sample": table(samples, None), "chunked": table(samples, args.chunk_tokens)}
    rows_of = {}
    for name, tab in tabs.items():
        ids = tab.column("sample").to_numpy()
        rows_of[name] = [np.nonzero(ids == k)[0].tolist() for k in range(args.samples)]
    row_bytes = len(W.LAYER_IDS) * args.hidden * 2  # aux bytes per token
    print(f"{args.samples} samples, {nbytes / 2**30:.2f} GiB, rows: per-sample {tabs['per-sample'].num_rows}, "
          f"chunked {tabs['chunked'].num_rows} ({args.chunk_tokens} tokens), {args.rounds} rounds")
    del samples
    names = list(tabs)
    secs = {(n, op): [] for n in names for op in ("write", "samples", "windows")}
    root = Path(tempfile.mkdtemp(prefix="fs_layout_bench_", dir=args.dir))
    try:
        for r in range(args.rounds):
            rng = np.random.default_rng(r)
            order = rng.permutation(args.samples).tolist()
            picks = [(k, int(rng.integers(0, len(rows_of["chunked"][k])))) for k in order]
            for name in (names if r % 2 == 0 else names[::-1]):
                path = root / f"r{r}_{name}.lance"
                t0 = time.perf_counter()
                write(tabs[name], path)
                secs[name, "write"].append(time.perf_counter() - t0)
                W.sync_tree(path, drop_cache=True)
                t0 = time.perf_counter()
                read_samples(path, rows_of[name], order)
                secs[name, "samples"].append(time.perf_counter() - t0)
                W.sync_tree(path, drop_cache=True)
                t0 = time.perf_counter()
                read_windows(path, rows_of[name], picks, args.chunk_tokens, name == "per-sample", row_bytes)
                secs[name, "windows"].append(time.perf_counter() - t0)
                shutil.rmtree(path)
            print(f"round {r}: " + ", ".join(f"{n} {op} {secs[n, op][-1]:.2f}s" for n in names
                                             for op in ("write", "samples", "windows")))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for op, what in (("write", "write"), ("samples", "shuffled whole-sample read"),
                     ("windows", f"shuffled {args.chunk_tokens}-token window read")):
        ratio = [c / p for c, p in zip(secs["chunked", op], secs["per-sample", op])]
        print(f"chunked / per-sample time, {what}: {W.spread(ratio)}")
    return 0


if __name__ == "__main__":
    sys.exit(W.run_unwinding(main))
