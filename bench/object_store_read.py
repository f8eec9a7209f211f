"""Training reads from an object store (moto S3 on loopback) vs from local disk: same data, one run.

One features table (``--samples`` samples of ``--tokens`` tokens, aux ``[T, 3, H]`` + last
``[T, H]`` bf16, random bits) is written with ``store.append`` twice: into a local store under
``--dir`` and into ``s3://<bucket>/bench`` on a moto server started on 127.0.0.1
(``tests/featurestore/s3_helpers.py``). Each round reads every sample of both, in one seeded
shuffled order, through the trainer's reader (``featurestore.read.reader.SampleReader``: samples in
flight chosen by the reader from the rate it measures, as in training, or fixed by ``--threads N``; pooled buffers, integrity check off on both: it is a local-disk feature). On
local disk the values are ``pread`` from the data files; on S3 the reader has no file to ``pread``
and fills the same buffers through Lance's blob reader (ranged GETs).

Local reads are cold: the data files' pages are evicted (``posix_fadvise(DONTNEED)``) before each
local read. moto keeps objects in its own process's memory, so the S3 side measures the HTTP/S3
protocol path (request per value, signing, the server's own overhead) without a network or a real
disk behind it: a floor for what the reader's object-store path costs, not a forecast for AWS.
The two arms alternate order each round; MB/s per arm and the ratio S3/local are printed as
median [min, max] over rounds.

    .venv/bin/python bench/object_store_read.py                  # ~25 MB, 5 rounds, < 1 min here
    .venv/bin/python bench/object_store_read.py --hidden 4096 --samples 16 --tokens 256 --rounds 3
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from eaglenest.cli import at_least

HERE = Path(__file__).resolve().parent
# featurestore_write.py's --dir check and SIGTERM unwinding (bench/ is not a package: loaded from beside this file)
_spec = importlib.util.spec_from_file_location("_bench_featurestore_write", HERE / "featurestore_write.py")
W = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(W)


def _helpers():
    spec = importlib.util.spec_from_file_location("s3_helpers", HERE.parent / "tests" / "featurestore" / "s3_helpers.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["s3_helpers"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def table(samples: int, tokens: int, hidden: int, seed: int):
    import numpy as np
    import pyarrow as pa

    from eaglenest.featurestore import schema as S

    meta = S.FeatureMeta(target="bench", layer_ids=(2, 4, 5), last_layer_id=8, hidden_size=hidden, dtype="bfloat16",
                         feature_set_id=f"bench-{hidden}")
    rng = np.random.default_rng(seed)
    rows = []
    for k in range(samples):
        # Random bf16 bit patterns with the top exponent bits clear: finite values, no NaN.
        aux = (rng.integers(0, 1 << 16, (tokens, 3, hidden), dtype=np.uint16) & 0x3FFF)
        last = (rng.integers(0, 1 << 16, (tokens, hidden), dtype=np.uint16) & 0x3FFF)
        rows.append({"sample_id": f"b{k:05d}", "domain": "bench", "source": "s", "split": "train", "mode": "chat",
                     "gen_params_id": "g", "num_tokens": tokens, "num_loss_tokens": tokens - 1,
                     "input_ids": list(range(tokens)), "loss_mask": [0] + [1] * (tokens - 1),
                     "aux_hidden": S.encode_tensor(aux, "bfloat16"), "last_hidden": S.encode_tensor(last, "bfloat16")})
    return pa.Table.from_pylist(rows, schema=S.features_schema(meta)), meta


def evict(folder: Path) -> None:
    for p in folder.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def read_all(uri: str, order: list[int], threads: int | None) -> tuple[int, float, int]:
    """(bytes of tensor values delivered, seconds, samples in flight at the end): every sample once,
    through SampleReader (``threads`` None: the reader's adaptive window)."""
    from eaglenest.featurestore.table import store
    from eaglenest.featurestore.read.reader import SampleReader

    t0 = time.perf_counter()
    ds = store.dataset(uri, store.FEATURES)
    nbytes = 0
    with SampleReader(ds, threads=threads, recycle=True, integrity="off") as reader:
        for s in reader.iter_samples(order):
            nbytes += s._aux.nbytes + s._last.nbytes
            s.release()
        window = reader.window.current()
    return nbytes, time.perf_counter() - t0, window


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=at_least(1), default=24, help="samples in the table")
    ap.add_argument("--tokens", type=at_least(1), default=128, help="tokens per sample")
    ap.add_argument("--hidden", type=at_least(1), default=1024, help="the target's hidden size")
    ap.add_argument("--rounds", type=at_least(1), default=5, help="rounds (arms alternated; median [min, max])")
    ap.add_argument("--threads", type=at_least(1), default=None,
                    help="samples in flight, fixed (default: chosen by the reader, as in training)")
    ap.add_argument("--dir", type=W.scratch_dir, default="/tmp", help="parent of the local store's temporary directory")
    args = ap.parse_args(argv)

    import numpy as np

    from eaglenest.featurestore.table import store

    h = _helpers()
    work = Path(tempfile.mkdtemp(prefix="eaglenest-objread-", dir=args.dir))
    try:
        with h.moto_s3("eaglenest-bench") as s3:
            os.environ.update(s3.env)
            t, meta = table(args.samples, args.tokens, args.hidden, seed=0)
            local, remote = str(work / "store"), s3.uri("bench")
            for uri in (local, remote):
                store.append(uri, store.FEATURES, t, meta=meta)
            total_tokens = args.samples * args.tokens
            mb = {"local": [], "s3": []}
            windows = {"local": [], "s3": []}
            ratios = []
            for r in range(args.rounds):
                order = [int(i) for i in np.random.default_rng(r).permutation(args.samples)]
                arms = ["local", "s3"] if r % 2 == 0 else ["s3", "local"]
                got = {}
                for arm in arms:
                    if arm == "local":
                        evict(work / "store")
                    nbytes, secs, window = read_all(local if arm == "local" else remote, order, args.threads)
                    got[arm] = nbytes / secs / 1e6
                    windows[arm].append(window)
                    mb[arm].append(got[arm])
                ratios.append(got["s3"] / got["local"])
                print(f"round {r}: local {got['local']:.1f} MB/s, s3 {got['s3']:.1f} MB/s", flush=True)

            def fmt(xs):
                return f"{statistics.median(xs):.3g} [{min(xs):.3g}, {max(xs):.3g}]"

            print(f"\n{args.samples} samples x {args.tokens} tokens ({total_tokens} tokens), H={args.hidden} bf16, "
                  f"{nbytes / 1e6:.1f} MB of tensor values per read, samples in flight {args.threads or 'adaptive'}, {args.rounds} rounds")
            print(f"local disk (cold)  MB/s  {fmt(mb['local'])}")
            print(f"moto S3 (loopback) MB/s  {fmt(mb['s3'])}")
            print(f"ratio S3/local           {fmt(ratios)}")
            print(f"samples in flight at the end of a read: local {windows['local']}, s3 {windows['s3']}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(W.run_unwinding(main))
