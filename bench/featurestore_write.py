"""Feature-store write throughput vs a plain sequential write and vs per-sample torch.save files.

Side by side in one run, on the same in-memory EAGLE-3 features (aux ``[T, 3, H]`` + last ``[T, H]``
bf16, 32 KiB/token at H=4096, random bits, token ids and loss mask), written to the same disk:

* store: Arrow rows of the features schema (``--build buffers``: one copy from the arrays;
  ``pylist``: capture's ``build.feature_row`` + ``pa.Table.from_pylist``) -> ``store.append``
  (``fragments.write_fragment`` + ``commit_fragments``, CRC sidecars included) in commits of
  ``--commit-every`` samples.
* plain: the same bytes (aux, last, ids, mask per sample) appended to one file with ``write``.
* torch.save: one file per sample holding a dict of torch tensors (the SpecForge layout).

Durability is the same for all three: every file a contender wrote is fsync'ed (and its directory)
before its clock stops. The page cache cannot be dropped without root; writes are measured to
stable storage through fsync instead of O_DIRECT, which Lance cannot use. Contenders alternate
order each round; each ratio is printed as median [min, max] over rounds. Also printed: the store's
bytes on disk over the feature bytes. ``--check`` exits 1 if store/plain < 0.7, store is not faster
than torch.save (median), or the size ratio exceeds 1.05.

    python bench/featurestore_write.py                       # ~1 GiB, 3 rounds, < 90 s here
    python bench/featurestore_write.py --samples 64 --rounds 5 --check
    python bench/featurestore_write.py --rounds 0 --rss --rss-gb 2 --commit-every 64 [--rss-legacy]

Peak memory (``--rss``): a fresh process writes ``--rss-gb`` GB of features the way capture does
(each sample made on the fly, ``build.feature_row``, then ``featurestore.capture.writer.FeatureWriter``
with capture's default budget (``--rss-budget-mb``), one commit per ``--commit-every`` samples), and
prints its peak RSS (``VmHWM``) beside its RSS before the first write. ``--rss-legacy`` also runs
the route capture used before the writer (a commit's rows held, ``from_pylist``, ``store.append``).

The data helpers here are shared with featurestore_read.py and featurestore_layout.py.
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

import numpy as np

from eaglenest.cli import at_least

# The argparse number types the benches share (bench/ is not a package: loaded from the file beside this one).
_spec = importlib.util.spec_from_file_location("_bench_arms", Path(__file__).with_name("arms.py"))
arms = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(arms)

LAYER_IDS = (2, 16, 29)  # vLLM's EAGLE-3 default for a 32-layer, 4096-hidden target


run_unwinding = arms.run_unwinding  # the featurestore benches call it as W.run_unwinding


def scratch_dir(text: str) -> str:
    """An argparse ``type`` for ``--dir``: an existing directory (the scratch data's parent), so a wrong
    one is a usage error before any data is made, not a traceback from ``mkdtemp``."""
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text}: no such directory" if not os.path.exists(text)
                                         else f"{text}: not a directory")
    if not os.access(text, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text}: not writable")
    return text


def add_sample_args(ap: argparse.ArgumentParser, *, samples: int) -> None:
    """``--samples --min-tokens --max-tokens --hidden``: the sizes of :func:`make_samples`, each >= 1."""
    ap.add_argument("--samples", type=at_least(1), default=samples, help="synthetic samples")
    ap.add_argument("--min-tokens", type=at_least(1), default=1024, help="fewest tokens per sample")
    ap.add_argument("--max-tokens", type=at_least(1), default=2048, help="most tokens per sample")
    ap.add_argument("--hidden", type=at_least(1), default=4096, help="the target's hidden size")


def check_sample_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.min_tokens > args.max_tokens:
        ap.error(f"--min-tokens ({args.min_tokens}) is above --max-tokens ({args.max_tokens})")


def make_meta(hidden: int):
    from eaglenest.featurestore import schema as S

    return S.FeatureMeta(target="bench-4096", layer_ids=LAYER_IDS, last_layer_id=32, hidden_size=hidden,
                         dtype="bfloat16", feature_set_id="bench")


def make_samples(num: int, min_tokens: int, max_tokens: int, hidden: int, seed: int = 0) -> list[dict]:
    """``num`` samples: conv fields as ``build.feature_row`` expects, plus bf16 bit-pattern arrays."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(num):
        t = int(rng.integers(min_tokens, max_tokens + 1))
        n_prompt = t // 4
        ids = rng.integers(0, 128_000, t).astype(np.int32)
        out.append({
            "conv": {"sample_id": f"bench-{i:05d}", "domain": "bench", "source": "random", "split": "train",
                     "mode": "chat", "gen_params_id": "bench",
                     "prompt_token_ids": ids[:n_prompt].tolist(), "response_token_ids": ids[n_prompt:].tolist()},
            "ids": ids, "mask": np.r_[np.zeros(n_prompt, np.uint8), np.ones(t - n_prompt, np.uint8)],
            # Random 16-bit patterns with the exponent capped so none is inf/NaN (not that it matters here).
            "aux": (rng.integers(0, 1 << 16, (t, len(LAYER_IDS), hidden), dtype=np.uint16) & 0xBFFF),
            "last": (rng.integers(0, 1 << 16, (t, hidden), dtype=np.uint16) & 0xBFFF),
        })
    return out


def feature_bytes(samples: list[dict]) -> int:
    return sum(s["aux"].nbytes + s["last"].nbytes + s["ids"].nbytes + s["mask"].nbytes for s in samples)


def sync_tree(root: Path, *, drop_cache: bool = False) -> None:
    """fsync every file and directory under ``root``; with ``drop_cache`` also evict their clean pages
    (posix_fadvise DONTNEED, which needs no root), so the next read comes from disk."""
    paths = [root] + sorted(root.rglob("*")) if root.is_dir() else [root]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            if drop_cache and not p.is_dir():
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _binary(array: np.ndarray):
    """A one-row ``large_binary`` array viewing ``array``'s memory (zero copy)."""
    import pyarrow as pa

    offsets = pa.py_buffer(np.array([0, array.nbytes], np.int64))
    return pa.LargeBinaryArray.from_buffers(pa.large_binary(), 1, [None, offsets, pa.py_buffer(array)])


def features_table(samples: list[dict], meta, *, build: str = "buffers"):
    """The features rows of ``samples``: ``pylist`` is capture's route today (``build.feature_row``
    + ``pa.Table.from_pylist``, two copies of the tensors); ``buffers`` makes one record batch per
    sample whose tensor columns view the arrays (zero copy): the same table, bit for bit."""
    import pyarrow as pa

    from eaglenest.featurestore import schema as S
    from eaglenest.featurestore.capture.build import feature_row

    schema = S.features_schema(meta)
    if build == "pylist":
        return pa.Table.from_pylist([feature_row(s["conv"], s["aux"], s["last"], meta) for s in samples],
                                    schema=schema)
    batches = []
    for s in samples:
        c = s["conv"]
        t = len(s["ids"])
        cols = [pa.array([c[k]], pa.string()) for k in ("sample_id", "domain", "source", "split", "mode",
                                                        "gen_params_id")]
        cols += [pa.array([t], pa.int32()), pa.array([int(s["mask"].sum())], pa.int32())]
        for key, typ in (("ids", pa.int32()), ("mask", pa.uint8())):
            cols.append(pa.ListArray.from_arrays(pa.array([0, t], pa.int32()), pa.array(s[key], typ)))
        cols += [_binary(s["aux"]), _binary(s["last"])]
        batches.append(pa.RecordBatch.from_arrays(cols, schema=schema))
    return pa.Table.from_batches(batches, schema=schema)


def write_store(samples: list[dict], uri: Path, commit_every: int, *, table: str = "features",
                build: str = "buffers") -> None:
    """The real write path: ``store.append`` = ``write_fragment`` + ``commit_fragments`` (+ CRCs)."""
    from eaglenest.featurestore.table import store

    meta = make_meta(samples[0]["last"].shape[1])
    for i in range(0, len(samples), commit_every):
        store.append(str(uri), table, features_table(samples[i:i + commit_every], meta, build=build), meta=meta)


def write_plain(samples: list[dict], path: Path) -> None:
    with open(path, "wb") as f:
        for s in samples:
            for key in ("ids", "mask", "aux", "last"):
                f.write(memoryview(s[key]).cast("B"))


def write_torch(samples: list[dict], folder: Path) -> None:
    import torch

    folder.mkdir()
    for i, s in enumerate(samples):
        torch.save({"input_ids": torch.from_numpy(s["ids"]), "loss_mask": torch.from_numpy(s["mask"]),
                    "aux_hidden_states": torch.from_numpy(s["aux"]).view(torch.bfloat16),
                    "hidden_states": torch.from_numpy(s["last"]).view(torch.bfloat16)},
                   folder / f"data_{i}.ckpt")


def status_mib(key: str) -> float:
    """A ``/proc/self/status`` memory line (``VmRSS``, ``VmHWM``) in MiB. VmHWM is the peak RSS of
    this process image (ru_maxrss would not do: Linux keeps it across execve)."""
    return int(next(line for line in open("/proc/self/status") if line.startswith(key)).split()[1]) / 1024


def rss_child(uri: Path, *, gb: float, commit_every: int, budget_mb: int, route: str, hidden: int) -> None:
    """Run in a fresh process: write ``gb`` GB of features the way capture does; print RSS before
    the first write and the peak (MiB), the bytes written and the commits made."""
    import pyarrow as pa

    from eaglenest.featurestore import schema as S
    from eaglenest.featurestore.table import store
    from eaglenest.featurestore.capture.build import feature_row
    from eaglenest.featurestore.capture.writer import FeatureWriter

    meta = make_meta(hidden)
    writer = FeatureWriter(str(uri), store.FEATURES, meta, budget=budget_mb << 20)
    make_samples(1, 8, 8, hidden, seed=1)  # numpy and imports before the baseline
    base = status_mib("VmRSS")
    done, i, commits, held = 0, 0, 0, []
    while done < gb * 1e9:
        s = make_samples(1, 1024, 2048, hidden, seed=1000 + i)[0]
        s["conv"]["sample_id"] = f"bench-{i:05d}"
        done += s["aux"].nbytes + s["last"].nbytes
        row = feature_row(s["conv"], s["aux"], s["last"], meta)
        del s
        i += 1
        if route == "writer":
            writer.add(row)
        else:
            held.append(row)
        if i % commit_every == 0:
            commits += 1
            if route == "writer":
                writer.commit()
            else:
                store.append(str(uri), store.FEATURES, pa.Table.from_pylist(held, schema=S.features_schema(meta)),
                             meta=meta)
                held = []
        del row
    if route == "writer":
        commits += writer.commit() is not None
    elif held:
        store.append(str(uri), store.FEATURES, pa.Table.from_pylist(held, schema=S.features_schema(meta)), meta=meta)
        commits += 1
    held = []
    rows = store.dataset(str(uri), store.FEATURES).count_rows()
    assert rows == i, (rows, i)
    peak = status_mib("VmHWM")
    print(f"RSS {base:.0f} {peak:.0f} {done / 1e9:.2f} {commits} {rows}")


def measure_rss(root: Path, args, route: str) -> str:
    import subprocess

    uri = root / f"rss_{route}"
    out = subprocess.run([sys.executable, __file__, "--rss-child", str(uri), "--rss-route", route,
                          "--rss-gb", str(args.rss_gb), "--commit-every", str(args.commit_every),
                          "--rss-budget-mb", str(args.rss_budget_mb), "--hidden", str(args.hidden)],
                         check=True, capture_output=True, text=True)
    shutil.rmtree(uri, ignore_errors=True)
    base, peak, done, commits, rows = next(l for l in out.stdout.splitlines() if l.startswith("RSS ")).split()[1:]
    budget = f"budget {args.rss_budget_mb} MiB, " if route == "writer" else ""
    return (f"peak RSS writing {done} GB of features ({route}: {budget}{rows} samples, {commits} commits of "
            f"{args.commit_every}, fresh process): {float(peak):.0f} MiB (before the first write: "
            f"{float(base):.0f} MiB)  (target < 1024)")


def run_rss(args) -> None:
    """The ``--rss`` measurements: capture's write route, and with ``--rss-legacy`` the old one."""
    root = Path(tempfile.mkdtemp(prefix="fs_write_rss_", dir=args.dir))
    try:
        for route in ["writer"] + (["whole-commit"] if args.rss_legacy else []):
            print(measure_rss(root, args, route), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} [{min(xs):.2f}, {max(xs):.2f}]"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_sample_args(ap, samples=24)
    ap.add_argument("--commit-every", type=at_least(1), default=8, help="samples per store commit")
    ap.add_argument("--rounds", type=at_least(0), default=3, help="rounds (0: only the --rss run)")
    ap.add_argument("--build", choices=["buffers", "pylist"], default="buffers",
                    help="how rows become an Arrow table (pylist = capture's from_pylist route)")
    ap.add_argument("--dir", type=scratch_dir, default="/tmp",
                    help="parent of the temporary directory (same disk for all)")
    ap.add_argument("--check", action="store_true", help="exit 1 if a threshold is missed")
    ap.add_argument("--rss", action="store_true", help="measure peak RSS of capture's write route in a fresh process")
    ap.add_argument("--rss-legacy", action="store_true", help="with --rss: also the pre-writer route")
    ap.add_argument("--rss-gb", type=arms.number_above(0), default=2.0, help="GB of features the --rss process writes")
    ap.add_argument("--rss-budget-mb", type=at_least(1), default=128,
                    help="FeatureWriter budget (featurestore.write_buffer_mb)")
    ap.add_argument("--rss-child", help=argparse.SUPPRESS)
    ap.add_argument("--rss-route", default="writer", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    check_sample_args(ap, args)
    if args.rss_child:
        rss_child(Path(args.rss_child), gb=args.rss_gb, commit_every=args.commit_every, budget_mb=args.rss_budget_mb,
                  route=args.rss_route, hidden=args.hidden)
        return 0
    if args.rounds < 1:  # memory only
        if not args.rss:
            ap.error("--rounds 0 needs --rss")
        run_rss(args)
        return 0

    samples = make_samples(args.samples, args.min_tokens, args.max_tokens, args.hidden)
    nbytes = feature_bytes(samples)
    tokens = sum(len(s["ids"]) for s in samples)
    print(f"{args.samples} samples, {tokens} tokens, {nbytes / 2**30:.2f} GiB per write, {args.rounds} rounds")
    writers = {"store": lambda d: write_store(samples, d / "store", args.commit_every, build=args.build),
               "plain": lambda d: write_plain(samples, d / "plain.bin"),
               "torch.save": lambda d: write_torch(samples, d / "pt")}
    names = list(writers)
    secs: dict[str, list[float]] = {n: [] for n in names}
    sizes: list[float] = []
    root = Path(tempfile.mkdtemp(prefix="fs_write_bench_", dir=args.dir))
    try:
        warm = root / "warmup"  # imports (lance, torch) and first-call costs stay outside the clock
        warm.mkdir()
        tiny = make_samples(2, 8, 8, 64, seed=1)
        write_store(tiny, warm / "store", 1)
        write_torch(tiny, warm / "pt")
        shutil.rmtree(warm)
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                d = root / f"r{r}_{name.replace('.', '_')}"
                d.mkdir()
                t0 = time.perf_counter()
                writers[name](d)
                sync_tree(d)  # every contender: all data durable before the clock stops
                secs[name].append(time.perf_counter() - t0)
                if name == "store":  # bytes on disk (data, manifests, CRC sidecars) / feature bytes
                    sizes.append(sum(p.stat().st_size for p in d.rglob("*") if p.is_file()) / nbytes)
                shutil.rmtree(d)
            print(f"round {r}: " + ", ".join(f"{n} {nbytes / secs[n][-1] / 1e9:.2f} GB/s" for n in order))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    vs_plain = [p / s for s, p in zip(secs["store"], secs["plain"])]
    vs_torch = [t / s for s, t in zip(secs["store"], secs["torch.save"])]
    for n in names:
        print(f"{n:>10}: {spread([tokens / s for s in secs[n]])} tokens/s, "
              f"{spread([nbytes / s / 1e9 for s in secs[n]])} GB/s")
    print(f"store / plain sequential write: {spread(vs_plain)}  (target >= 0.7)")
    print(f"store / torch.save per sample:  {spread(vs_torch)}  (target > 1)")
    print(f"store bytes on disk / feature bytes: {max(sizes):.4f}  (target <= 1.05)")
    if args.rss:
        run_rss(args)
    ok = statistics.median(vs_plain) >= 0.7 and statistics.median(vs_torch) > 1.0 and max(sizes) <= 1.05
    if args.check and not ok:
        print("FAIL: a write threshold was missed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(run_unwinding(main))
