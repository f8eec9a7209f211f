"""Training reads from the feature store vs a raw sequential read and vs per-sample torch.load files.

Side by side in one run, on the same EAGLE-3 features (see featurestore_write.py: aux ``[T, 3, H]``
+ last ``[T, H]`` bf16, 32 KiB/token at H=4096), written once to the same disk:

* store: the store opened with ``store.dataset`` (schema validated), samples in a seeded shuffled
  order in batches of ``--batch-samples``, read with ``featurestore.reader.SampleReader``
  (per sample one ``dataset.take`` of the small columns and blob descriptors, the tensor values
  ``pread`` into pooled buffers, ``--threads`` samples in flight), delivered as torch tensors of
  the stored dtype (bf16) viewing those buffers; the consumer releases a batch's buffers when it
  is done with it (they are reused, so their pages are already mapped).
* store-serial, store-fresh, store-readahead (``--serial``): the same with one sample in flight,
  with a fresh buffer per value instead of the reader's pool, and with the kernel asked to read
  each group's values ahead (``readahead=True``; see featurestore/read/reader.py).
* trainer (``--trainer``): ``train.data.FeatureShards.read`` as shipped: its shuffled plan, then
  per batch the same per-sample reads, each sample converted once (bf16 -> fp32, aux layer order)
  straight into the packed, padded ``Batch``, against torch.load files turned into the same
  ``Batch`` with ``collate`` ("torch.load->Batch").
* store-checked, store-checked-first (``--integrity``): the store read with the trainer's
  integrity check on (``SampleReader(integrity="check")``, featurestore/table/integrity.py): with the
  data files' stamps present (one ``stat`` per file), and with them deleted before the round
  (uncached: a full CRC-32 pass over the cold files, stamps rewritten, then the read). The plain
  ``store`` arm reads with the check off; ratios are printed against it, and so is the check's
  own time as a share of the checked read's (robust to the noise between arms).
* raw: the same bytes read sequentially from one file, one fresh buffer per sample (no decode).
* disk: the same file read into one reused 8 MiB buffer: the disk alone, no memory to fill (on
  this VM first-touch page faults cost as much as the disk; printed, not a threshold).
* torch.load: one file per sample (the SpecForge layout), the same shuffled batches, each sample
  ``torch.load``-ed (bf16 tensors, as the store's).

Peak memory (``--rss``, after the timed rounds): a fresh process reads the store through the
same reader, epoch after epoch until ``--rss-gb`` GB of features were delivered, and prints its
peak RSS (``VmHWM``) next to its RSS before the first read (imports, dataset open).

Cold reads for every contender: before each timed read, its files are fsync'ed and their pages
evicted from the page cache with ``posix_fadvise(DONTNEED)`` (no root needed; ``drop_caches``
would need it). ``--warm`` skips the eviction (all from page cache). Contenders alternate order
each round; each ratio is median [min, max] over rounds. ``--check`` exits 1 if store/raw < 0.6
or store/torch.load < 3 (medians).

    python bench/featurestore_read.py                      # ~1 GiB, 3 rounds, < 90 s here
    python bench/featurestore_read.py --samples 48 --rounds 5 --check
    python bench/featurestore_read.py --integrity --samples 12 --rounds 5   # the integrity check's cost
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _write_module():
    spec = importlib.util.spec_from_file_location("_bench_featurestore_write", HERE / "featurestore_write.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


W = _write_module()
#: Seconds of each integrity check made by read_store(integrity="check"), in call order.
CHECK_SECS: list[float] = []


def read_store(uri: Path, *, batch_samples: int, seed: int, threads: int, recycle: bool = True,
               readahead: bool = False, integrity: str = "off") -> int:
    """Shuffled batches of whole samples as torch tensors of the stored dtype (bf16), straight from
    the store: ``SampleReader`` (one take per sample, ``threads`` in flight), tensors viewing the
    Arrow buffers. Returns tokens."""
    import numpy as np

    from eaglenest.featurestore.table import store
    from eaglenest.featurestore.table.integrity import check_version
    from eaglenest.featurestore.read.reader import SampleReader

    ds = store.dataset(str(uri), store.FEATURES)
    if integrity == "check":  # what SampleReader(integrity="check") runs first, timed on its own
        t0 = time.perf_counter()
        check_version(ds)
        CHECK_SECS.append(time.perf_counter() - t0)
    lengths = ds.to_table(columns=["num_tokens"]).column("num_tokens").to_numpy()
    order = np.random.default_rng(seed).permutation(len(lengths)).tolist()
    tokens = 0
    with SampleReader(ds, threads=threads, recycle=recycle, readahead=readahead, integrity="off") as reader:
        samples = reader.iter_samples(order)
        for j in range(0, len(order), batch_samples):
            batch, held = [], []
            for i in order[j:j + batch_samples]:
                s = next(samples)
                ids = s.ids_tensor()
                batch.append((ids, s.aux_stored(), s.last_stored()))
                assert s.index == i and ids.numel() == int(lengths[i])
                tokens += ids.numel()
                held.append(s)
            del batch  # the consumer is done with this batch: its buffers go back to the pool
            for s in held:
                s.release()
    return tokens


def drop_stamps(uri: Path) -> None:
    """Delete the integrity stamps: the next checked read re-reads every data file (uncached)."""
    from eaglenest.featurestore.table import integrity

    for p in (Path(uri) / "features.lance" / integrity.CRC_DIR).glob("*.stamp"):
        p.unlink()


def read_trainer(uri: Path, *, pack_tokens: int, batch_rows: int, seed: int, threads: int = 4) -> int:
    """All of one epoch through the trainer's reader; returns the tokens delivered."""
    from eaglenest.train.data import FeatureShards

    shards = FeatureShards(str(uri), version=None, split="train", pack_tokens=pack_tokens,
                           batch_rows=batch_rows, seed=seed, read_threads=threads)
    tokens = 0
    try:
        for rows in shards.plan(0):
            batch = shards.read(rows)
            tokens += int((batch.doc_ids >= 0).sum())
    finally:
        shards.reader.close()
    return tokens


def read_raw(path: Path, sizes: list[int]) -> int:
    """Sequential read of ``path`` into one fresh buffer per sample (the bytes end up in memory, as
    any reader's must); returns the bytes read."""
    total = 0
    with open(path, "rb", buffering=0) as f:
        for n in sizes:
            total += len(f.read(n))
    return total


def read_disk(path: Path) -> int:
    """Sequential read of ``path`` into one reused 8 MiB buffer: the disk alone, no memory to fill."""
    buf = bytearray(8 << 20)
    total = 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            total += n
    return total


def read_torch(folder: Path, *, num: int, batch_samples: int, seed: int) -> int:
    """The same shuffled batches as :func:`read_store`, from per-sample torch.save files."""
    import numpy as np
    import torch

    order = np.random.default_rng(seed).permutation(num)
    tokens = 0
    for j in range(0, num, batch_samples):
        batch = [torch.load(folder / f"data_{i}.ckpt") for i in order[j:j + batch_samples].tolist()]
        tokens += sum(int(d["input_ids"].shape[0]) for d in batch)
    return tokens


def read_torch_trainer(folder: Path, uri: Path, *, pack_tokens: int, batch_rows: int, seed: int, **_) -> int:
    """The same plan and the same Batch as :func:`read_trainer`, from per-sample torch.save files."""
    import torch

    from eaglenest.train.data import FeatureShards, collate

    shards = FeatureShards(str(uri), version=None, split="train", pack_tokens=pack_tokens,
                           batch_rows=batch_rows, seed=seed)  # the plan only (small columns)
    order = shards.aux_order

    def decode(i: int):
        d = torch.load(folder / f"data_{int(shards.offsets[i])}.ckpt")
        n = min(d["input_ids"].shape[0], pack_tokens)
        return (d["input_ids"][:n].long(), d["loss_mask"][:n].bool(),
                d["aux_hidden_states"][:n, order].float().reshape(n, -1), d["hidden_states"][:n].float())

    tokens = 0
    for rows in shards.plan(0):
        batch = collate([[decode(i) for i in row] for row in rows])
        tokens += int((batch.doc_ids >= 0).sum())
    return tokens


def rss_child(uri: Path, *, batch_samples: int, threads: int, gb: float) -> None:
    """Run in a fresh process: read the store with :func:`read_store` until ``gb`` GB of features
    were delivered; print RSS before the first read and the peak, in MiB."""
    from eaglenest.featurestore.table import store

    ds = store.dataset(str(uri), store.FEATURES)  # imports and metadata, before the baseline
    per_epoch = sum(f.stat().st_size for f in (Path(uri) / "features.lance" / "data").glob("*"))
    base = W.status_mib("VmRSS")
    done, epoch = 0, 0
    while done < gb * 1e9:
        read_store(uri, batch_samples=batch_samples, seed=1000 + epoch, threads=threads)
        done += per_epoch
        epoch += 1
    del ds
    # VmHWM: the peak RSS of this process image. ru_maxrss would not do: Linux keeps it across
    # execve, so a child would report the parent's peak (the bench holds the samples in memory).
    peak = W.status_mib("VmHWM")
    print(f"RSS {base:.0f} {peak:.0f} {done / 1e9:.2f} {epoch}")


def measure_rss(uri: Path, *, batch_samples: int, threads: int, gb: float) -> tuple[float, float, float, int]:
    import subprocess

    out = subprocess.run([sys.executable, __file__, "--rss-child", str(uri), "--batch-samples", str(batch_samples),
                          "--threads", str(threads), "--rss-gb", str(gb)], check=True, capture_output=True, text=True)
    line = next(l for l in out.stdout.splitlines() if l.startswith("RSS "))
    base, peak, done, epochs = line.split()[1:]
    return float(base), float(peak), float(done), int(epochs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=24)
    ap.add_argument("--min-tokens", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--batch-samples", type=int, default=4, help="samples per shuffled batch")
    ap.add_argument("--threads", type=int, default=2, help="samples in flight (SampleReader)")
    ap.add_argument("--serial", action="store_true",
                    help="also time the store with one sample in flight, and with fresh (not pooled) buffers")
    ap.add_argument("--integrity", action="store_true",
                    help="also time the store with the trainer's integrity check, stamps present and absent")
    ap.add_argument("--rss", action="store_true", help="measure the reader's peak RSS in a fresh process")
    ap.add_argument("--rss-gb", type=float, default=2.0, help="GB of features the --rss process reads")
    ap.add_argument("--rss-child", help=argparse.SUPPRESS)
    ap.add_argument("--trainer", action="store_true",
                    help="also time train.data.FeatureShards (packed fp32 Batch) and torch.load into the same Batch")
    ap.add_argument("--pack-tokens", type=int, default=4096, help="train.pack_tokens for --trainer")
    ap.add_argument("--batch-rows", type=int, default=2, help="train.batch_rows for --trainer")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warm", action="store_true", help="read from the page cache (no eviction)")
    ap.add_argument("--dir", default="/tmp", help="parent of the temporary directory (same disk for all)")
    ap.add_argument("--check", action="store_true", help="exit 1 if a threshold is missed")
    args = ap.parse_args(argv)
    if args.rss_child:
        rss_child(Path(args.rss_child), batch_samples=args.batch_samples, threads=args.threads, gb=args.rss_gb)
        return 0

    samples = W.make_samples(args.samples, args.min_tokens, args.max_tokens, args.hidden)
    nbytes = W.feature_bytes(samples)
    tokens = sum(len(s["ids"]) for s in samples)
    print(f"{args.samples} samples, {tokens} tokens, {nbytes / 2**30:.2f} GiB, {args.rounds} rounds, "
          f"{'warm (page cache)' if args.warm else 'cold (pages evicted before each read)'}")
    root = Path(tempfile.mkdtemp(prefix="fs_read_bench_", dir=args.dir))
    try:
        uri, raw, pt = root / "store", root / "plain.bin", root / "pt"
        W.write_store(samples, uri, commit_every=8)
        W.write_plain(samples, raw)
        W.write_torch(samples, pt)
        sizes = [s["aux"].nbytes + s["last"].nbytes + s["ids"].nbytes + s["mask"].nbytes for s in samples]
        del samples
        bopts = dict(batch_samples=args.batch_samples)
        topts = dict(pack_tokens=args.pack_tokens, batch_rows=args.batch_rows, threads=args.threads)
        readers = {"store": (uri, lambda r: read_store(uri, seed=r, threads=args.threads, **bopts)),
                   "raw": (raw, lambda r: read_raw(raw, sizes)),
                   "disk": (raw, lambda r: read_disk(raw)),
                   "torch.load": (pt, lambda r: read_torch(pt, num=args.samples, seed=r, **bopts))}
        if args.serial:  # the design's parts: one sample in flight; fresh buffers instead of pooled
            readers["store-serial"] = (uri, lambda r: read_store(uri, seed=r, threads=1, **bopts))
            readers["store-fresh"] = (uri, lambda r: read_store(uri, seed=r, threads=args.threads, recycle=False,
                                                                **bopts))
            readers["store-readahead"] = (uri, lambda r: read_store(uri, seed=r, threads=args.threads,
                                                                    readahead=True, **bopts))
        if args.integrity:  # (path, read, prepare): prepare runs before the pages are evicted, off the clock
            readers["store-checked"] = (uri, lambda r: read_store(uri, seed=r, threads=args.threads,
                                                                  integrity="check", **bopts))
            readers["store-checked-first"] = (uri, lambda r: read_store(uri, seed=r, threads=args.threads,
                                                                        integrity="check", **bopts),
                                              lambda: drop_stamps(uri))
        if args.trainer:
            readers["trainer"] = (uri, lambda r: read_trainer(uri, seed=r, **topts))
            readers["torch.load->Batch"] = (pt, lambda r: read_torch_trainer(pt, uri, seed=r, **topts))
        # Warm-up (imports, first calls) and a check that every reader delivers every token.
        assert read_store(uri, seed=99, threads=args.threads, **bopts) == tokens == read_torch(pt, num=args.samples, seed=99, **bopts)
        assert read_raw(raw, sizes) == nbytes == read_disk(raw)
        if args.trainer:
            small = dict(topts, pack_tokens=max(args.pack_tokens, args.max_tokens))
            assert read_trainer(uri, seed=99, **small) == tokens == read_torch_trainer(pt, uri, seed=99, **small)
        names = list(readers)
        secs: dict[str, list[float]] = {n: [] for n in names}
        check_share: dict[str, list[float]] = {}  # the check's seconds / the checked read's seconds
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                path, fn, *prepare = readers[name]
                for step in prepare:
                    step()
                W.sync_tree(path, drop_cache=not args.warm)
                CHECK_SECS.clear()
                t0 = time.perf_counter()
                fn(r)
                secs[name].append(time.perf_counter() - t0)
                if name.startswith("store-checked"):
                    check_share.setdefault(name, []).append(sum(CHECK_SECS) / secs[name][-1])
            print(f"round {r}: " + ", ".join(f"{n} {nbytes / secs[n][-1] / 1e9:.2f} GB/s" for n in order),
                  flush=True)
        rss = measure_rss(uri, batch_samples=args.batch_samples, threads=args.threads, gb=args.rss_gb) \
            if args.rss else None
    finally:
        shutil.rmtree(root, ignore_errors=True)
    vs_raw = [w / s for s, w in zip(secs["store"], secs["raw"])]
    vs_torch = [t / s for s, t in zip(secs["store"], secs["torch.load"])]
    for n in names:
        print(f"{n:>10}: {W.spread([nbytes / s / 1e9 for s in secs[n]])} GB/s of stored features")
    print(f"store / raw sequential read:  {W.spread(vs_raw)}  (target >= 0.6)")
    print(f"store / disk-only read (reused 8 MiB buffer): "
          f"{W.spread([w / s for s, w in zip(secs['store'], secs['disk'])])}")
    print(f"store / torch.load per sample: {W.spread(vs_torch)}  (target >= 3)")
    if args.serial:
        for n in ("store-serial", "store-fresh", "store-readahead"):
            print(f"{n} / raw sequential read: {W.spread([w / s for s, w in zip(secs[n], secs['raw'])])}")
    if args.integrity:
        for n in ("store-checked", "store-checked-first"):
            print(f"{n} / store (check off): {W.spread([u / c for c, u in zip(secs[n], secs['store'])])}"
                  f"; the check itself: {W.spread([100 * x for x in check_share[n]])} % of the read's time"
                  + ("  (aim <= 5)" if n == "store-checked" else ""))
    if rss is not None:
        print(f"peak RSS reading {rss[2]:.2f} GB of features ({rss[3]} epochs, fresh process): {rss[1]:.0f} MiB "
              f"(before the first read: {rss[0]:.0f} MiB)  (target < 1024)")
    if args.trainer:
        print(f"trainer Batch / raw sequential read:        "
              f"{W.spread([w / s for s, w in zip(secs['trainer'], secs['raw'])])}")
        print(f"trainer Batch / torch.load into same Batch: "
              f"{W.spread([t / s for s, t in zip(secs['trainer'], secs['torch.load->Batch'])])}")
    ok = statistics.median(vs_raw) >= 0.6 and statistics.median(vs_torch) >= 3.0
    if args.check and not ok:
        print("FAIL: a read threshold was missed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
