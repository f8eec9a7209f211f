"""Memory of the streaming bypass under a slow consumer: bounded by train.stream.depth, not by N.

A real capture stream (tiny target, vLLM on CPU) over ``--samples`` sequences of ``--tokens``
tokens (fp32, 4 layers x 128: 2 KiB per token, ~1 MiB per capture at 500 tokens), consumed slowly
(``--sleep-s`` per capture), once per depth in ``--depths``. A sampling thread records the RSS of
the consumer and of the engine's process group; printed: RSS growth over the value at the first
capture (peak - first), the most captures ever in flight (from send and hand-out times), and the
growth if every capture had been buffered (samples x capture size) for scale.

    .venv/bin/python bench/stream_memory.py [--samples 32 --tokens 500 --depths 2,16 --sleep-s 0.5]
"""

from __future__ import annotations

import argparse
import importlib.util
import threading
import time
from pathlib import Path

import numpy as np

from eaglenest.cli import at_least

# The argparse number types the benches share (bench/ is not a package: loaded from the file beside this one).
_spec = importlib.util.spec_from_file_location("_bench_arms", Path(__file__).with_name("arms.py"))
arms = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(arms)


def _rss_mib(pids) -> float:
    import psutil

    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.Error:
            pass
    return total / 2**20


def run_once(target: str, depth: int, seqs, sleep_s: float) -> dict:
    import os

    import psutil

    from eaglenest.engine import EngineConfig
    from eaglenest.featurestore.stream.local import CaptureStream

    eng = EngineConfig(max_model_len=512, memory_fraction=0.1, max_num_seqs=depth)
    samples, stop = {"me": [], "engine": []}, threading.Event()
    with CaptureStream(target, layer_ids=(2, 4, 5), num_layers=8, engine=eng, sequences=seqs, depth=depth) as s:
        def sample():
            while not stop.is_set():
                try:
                    kids = [p.pid for p in psutil.Process(s.pid).children(recursive=True)] + [s.pid]
                except psutil.Error:
                    kids = []
                samples["me"].append(_rss_mib([os.getpid()]))
                samples["engine"].append(_rss_mib(kids))
                time.sleep(0.05)

        first = None
        t = threading.Thread(target=sample, daemon=True)
        for k, (ids, hidden) in enumerate(s):
            if k == 0:
                capture_mib = hidden.numel() * hidden.element_size() / 2**20
                first = {"me": _rss_mib([os.getpid()])}
                samples["me"].clear()
                samples["engine"].clear()
                t.start()
            time.sleep(sleep_s)
        stop.set()
        t.join()
        in_flight = s.max_in_flight()
    return {"depth": depth, "in_flight": in_flight, "capture_mib": capture_mib,
            "consumer_growth_mib": max(samples["me"]) - first["me"],
            "engine_growth_mib": max(samples["engine"]) - samples["engine"][0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="assets/tiny-target", help="the target model folder")
    ap.add_argument("--samples", type=at_least(1), default=32, help="captures streamed per depth")
    ap.add_argument("--tokens", type=at_least(1), default=500, help="tokens per capture")
    ap.add_argument("--depths", default="2,16", help="comma list of train.stream.depth values, one run each")
    ap.add_argument("--sleep-s", type=arms.number_at_least(0), default=0.5,
                    help="the slow consumer's pause per capture")
    args = ap.parse_args()
    try:
        depths = [int(d) for d in args.depths.split(",")]
    except ValueError:
        depths = [0]
    if min(depths) < 1:
        ap.error(f"--depths: a comma list of depths, each >= 1, got {args.depths!r}")
    rng = np.random.default_rng(0)
    seqs = [rng.integers(3, 2000, args.tokens).tolist() for _ in range(args.samples)]
    rows = [run_once(args.target, d, seqs, args.sleep_s) for d in depths]
    for r in rows:
        ratio = r["consumer_growth_mib"] / (r["depth"] * r["capture_mib"])
        print(f"depth {r['depth']:3d}: max in flight {r['in_flight']:3d}; consumer RSS growth "
              f"{r['consumer_growth_mib']:7.1f} MiB = {ratio:.2f} x depth x capture; engine group RSS growth "
              f"{r['engine_growth_mib']:7.1f} MiB "
              f"(captures {r['capture_mib']:.2f} MiB each; all {args.samples} buffered would be "
              f"{args.samples * r['capture_mib']:.0f} MiB)")


if __name__ == "__main__":
    main()
