"""Write speed of the tensor columns as Lance blob columns (schema v2) vs inline large_binary (v1).

Same rows (features of ``--samples`` samples, H=4096 bf16 by default), written with
``lance.write_dataset`` in appends of 4 samples and fsync'ed, contenders alternating order each
round. Prints blob speed / inline speed as median [min, max]: above 1 means the blob layout
writes faster. This is the check that the read-path layout (docs/featurestore.md, "Read path")
did not cost write speed. ``--check`` exits 1 if the median is below 1 (blob slower than inline).

    python bench/featurestore_blob_layout.py --samples 12 --rounds 4 [--check]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import featurestore_write as W  # noqa: E402  (shared data helpers)

from eaglenest.cli import at_least


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=at_least(1), default=12, help="samples written per round")
    p.add_argument("--rounds", type=at_least(1), default=4, help="rounds (arms alternated; median [min, max])")
    p.add_argument("--hidden", type=at_least(1), default=4096, help="the target's hidden size")
    p.add_argument("--dir", type=W.scratch_dir, default=None, help="scratch directory on the disk to measure")
    p.add_argument("--check", action="store_true", help="exit 1 if blob writes are slower than inline (median)")
    args = p.parse_args(argv)

    import lance
    import pyarrow as pa

    from eaglenest.featurestore import schema as S

    samples = W.make_samples(args.samples, 1024, 2048, args.hidden)
    meta = W.make_meta(args.hidden)
    blob = S.features_schema(meta)
    inline = pa.schema([pa.field(f.name, f.type, nullable=f.nullable) for f in blob], metadata=blob.metadata)
    root = Path(tempfile.mkdtemp(prefix="blob_layout_", dir=args.dir))
    times: dict[str, list[float]] = {"inline": [], "blob": []}
    try:
        for r in range(args.rounds):
            for name in (("inline", "blob") if r % 2 == 0 else ("blob", "inline")):
                schema = inline if name == "inline" else blob
                target = root / f"{name}{r}.lance"
                t0 = time.perf_counter()
                for i in range(0, len(samples), 4):
                    table = W.features_table(samples[i:i + 4], meta).cast(schema)
                    lance.write_dataset(table, str(target), schema=schema, mode="append" if i else "create",
                                        data_storage_version="2.0")
                W.sync_tree(target)
                times[name].append(time.perf_counter() - t0)
                shutil.rmtree(target)
            print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return report(times, check=args.check)


def report(times: dict[str, list[float]], *, check: bool) -> int:
    """Print blob speed / inline speed over rounds; 1 if ``check`` and the median is below 1."""
    ratios = [a / b for a, b in zip(times["inline"], times["blob"], strict=True)]
    median = statistics.median(ratios)
    print(f"blob speed / inline speed: {median:.2f} [{min(ratios):.2f}, {max(ratios):.2f}]  (target >= 1)")
    if check and median < 1:
        print("FAIL: blob writes are slower than inline", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(W.run_unwinding(main))
