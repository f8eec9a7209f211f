"""Write speed of the tensor columns as Lance blob columns (schema v2) vs inline large_binary (v1).

Same rows (features of ``--samples`` samples, H=4096 bf16 by default), written with
``lance.write_dataset`` in appends of 4 samples and fsync'ed, contenders alternating order each
round. Prints blob speed / inline speed as median [min, max]: above 1 means the blob layout
writes faster. This is the check that the read-path layout (docs/featurestore.md, "Read path")
did not cost write speed.

    python bench/featurestore_blob_layout.py --samples 12 --rounds 4
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
    p.add_argument("--samples", type=int, default=12)
    p.add_argument("--rounds", type=at_least(1), default=4)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--dir", type=Path, default=None, help="scratch directory on the disk to measure")
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
    ratios = [a / b for a, b in zip(times["inline"], times["blob"])]
    print(f"blob speed / inline speed: {statistics.median(ratios):.2f} [{min(ratios):.2f}, {max(ratios):.2f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
