"""Stream throughput: the cross-host gloo transport on loopback vs the local Unix socket, same frames.

Both paths are the project's own code, without an engine: the Unix socket is
:class:`Publisher` -> :class:`Channel` (what the capture connector and a single-rank trainer use);
gloo is :func:`stream.xhost.serve` -> :class:`stream.xhost.RankStream` (one engine, one rank, a gloo
group on 127.0.0.1). The publisher/engine side runs in a child process (as on a real engine host),
the consumer here. ``--frames`` captures of ``[tokens, layers, hidden]`` per round; throughput is
bytes of hidden states from the first capture handed out to the last (start-up excluded), so it
is the transport's sustained rate. Printed: MB/s per round, the median [min, max] over ``--rounds``
rounds, the gloo / unix ratio, and the bytes per second a trainer GPU needs at H=7168 and H=3072
for ``--train-tokens-per-s`` (an assumed figure; the measured rates are what the docs compare).

    .venv/bin/python bench/stream_transport.py [--frames 12 --tokens 2048 --layers 4 --hidden 4096
        --dtype bfloat16 --depth 4 --rounds 3 --train-tokens-per-s 20000]
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing as mp
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

from eaglenest.cli import at_least

# The argparse number types the benches share (bench/ is not a package: loaded from the file beside this one).
_spec = importlib.util.spec_from_file_location("_bench_arms", Path(__file__).with_name("arms.py"))
arms = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(arms)


def _frame(args):
    import torch

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.tokens, args.layers, args.hidden, generator=g).to(getattr(torch, args.dtype))
    return torch.arange(args.tokens, dtype=torch.int64) % 2000 + 3, hidden


def _publish(path, args) -> None:  # child process: the engine side of the Unix socket
    from eaglenest.featurestore.capture.publish import Publisher

    ids, hidden = _frame(args)
    pub = Publisher(path)
    for tag in range(args.frames):
        pub.publish(tag, ids, hidden)


def _serve(addr, args) -> None:  # child process: one engine host of the gloo stream
    import contextlib

    from eaglenest.featurestore.stream.xhost import serve

    ids, hidden = _frame(args)

    @contextlib.contextmanager
    def frames(spec, seqs):
        yield ((ids.numpy(), hidden) for _ in seqs)

    serve(addr, 0, timeout_s=120, captures=frames)


def _consume(next_item, n: int) -> float:
    next_item()
    t0 = time.perf_counter()
    for _ in range(n - 1):
        next_item()
    return time.perf_counter() - t0


def run_unix(args) -> float:
    from eaglenest.featurestore.stream.local import Channel

    with tempfile.TemporaryDirectory(prefix="eaglenest-bench-") as folder:  # the socket's, removed after
        path = os.path.join(folder, "s.sock")
        chan = Channel(path, num_items=args.frames, depth=args.depth, check=lambda: None)
        child = mp.get_context("spawn").Process(target=_publish, args=(path, args))
        child.start()
        try:
            return _consume(chan.next, args.frames)
        finally:
            chan.close()
            child.join(30)


def run_gloo(args) -> float:
    from eaglenest.featurestore.stream.xhost import RankStream

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{s.getsockname()[1]}"
    child = mp.get_context("spawn").Process(target=_serve, args=(addr, args))
    child.start()
    seq = list(range(3, 3 + args.tokens))
    rs = RankStream(addr, rank=0, world_size=1, num_engines=1, spec={}, sequences=[seq] * args.frames,
                    steps=list(range(args.frames)), depth=args.depth, timeout_s=120)
    try:
        return _consume(rs.next, args.frames)
    finally:
        rs.close()
        child.join(30)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # The rate is timed from the first frame handed out to the last: two frames at least.
    ap.add_argument("--frames", type=at_least(2), default=12, help="captures per round (timed after the first)")
    ap.add_argument("--tokens", type=at_least(1), default=2048, help="tokens per capture")
    ap.add_argument("--layers", type=at_least(1), default=4, help="hidden-state layers per capture")
    ap.add_argument("--hidden", type=at_least(1), default=4096, help="hidden size")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="the hidden states' dtype")
    ap.add_argument("--depth", type=at_least(1), default=4, help="captures in flight (train.stream.depth)")
    ap.add_argument("--rounds", type=at_least(1), default=3, help="rounds (arms alternated; median [min, max])")
    ap.add_argument("--train-tokens-per-s", type=arms.number_above(0), default=20000.0,
                    help="tokens/s one trainer GPU consumes (assumed), for the bandwidth it needs")
    args = ap.parse_args(argv)
    frame_bytes = args.tokens * args.layers * args.hidden * (2 if args.dtype == "bfloat16" else 4)
    moved = frame_bytes * (args.frames - 1)
    rates = {"unix": [], "gloo": []}
    pair = (("unix", run_unix), ("gloo", run_gloo))
    for k in range(args.rounds):  # alternate, so drift in the machine's load hits both alike
        for name, fn in (pair if k % 2 == 0 else pair[::-1]):
            rates[name].append(moved / fn(args) / 1e6)
            print(f"round {k}: {name:4s} {rates[name][-1]:8.0f} MB/s", flush=True)
    ratio = [g / u for g, u in zip(rates["gloo"], rates["unix"])]
    print(f"frames: {args.frames} x [{args.tokens}, {args.layers}, {args.hidden}] {args.dtype} "
          f"= {frame_bytes / 2**20:.0f} MiB each, depth {args.depth}")
    for name, r in rates.items():
        print(f"{name:4s}: median {statistics.median(r):8.0f} MB/s [{min(r):.0f}, {max(r):.0f}]")
    print(f"gloo / unix: median {statistics.median(ratio):.2f} [{min(ratio):.2f}, {max(ratio):.2f}]")
    for name, hidden in (("Kimi-K2", 7168), ("MiniMax-M2", 3072)):
        per_token = 4 * hidden * 2  # 3 aux layers + the last one, bf16
        need = per_token * args.train_tokens_per_s / 1e6
        print(f"{name} (H={hidden}): {per_token} B/token; at {args.train_tokens_per_s:.0f} trainer tokens/s "
              f"per GPU (assumed) a GPU needs {need:.0f} MB/s = "
              f"{need / statistics.median(rates['gloo']):.2f} x the measured gloo loopback rate")


if __name__ == "__main__":
    main()
