"""bench/ingest_capture.py's floor arm (``--floor``): regeneration, then a ``max_tokens=1`` prefill of the same
prompt + response sequences through the regeneration engine, the second forward pass alone. The regeneration
had just left those sequences' KV blocks in that engine's prefix cache (vLLM caches them by default), so the
"floor" prefill read every full block back instead of computing it, while the capture engine it is the floor
for has none of them cached: the floor came out below any real second pass. The bench now empties the cache
first and prints how many tokens the floor's prefills found in it.

The toy prompts and answers fit in one KV block of vLLM's CPU backend (128 tokens), where nothing is cached:
here the prompts are a few hundred tokens, as a real conversation is."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def long_prompt_manifest(folder: Path) -> Path:
    lines = (ROOT / "recipes" / "data" / "prose.jsonl").read_text().splitlines()[:4]
    rows = [json.loads(line) for line in lines]
    data = folder / "long prose.jsonl"
    data.write_text("".join(json.dumps({"id": r["id"], "prompt": " ".join([r["prompt"]] * 12)}) + "\n" for r in rows))
    manifest = folder / "long.yaml"
    manifest.write_text(f"""name: long-prompts
version: 1
licence: CC0-1.0
held_out_fraction: 0.0
raw_fraction: 0.0
generation:
  temperature: 0.0
  max_tokens: 16
  seed: 0
domains:
  prose:
    cap_prompts: 10
    sources:
      - path: {json.dumps(str(data))}
        field: prompt
        provenance: test
""")
    return manifest


@pytest.mark.slow
def test_the_floor_prefill_computes_every_token(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "ingest_capture.py"), "--floor", "--prompts", "4",
                           "--rounds", "1", "--max-tokens", "16", "--max-num-seqs", "4",
                           "--manifest", str(long_prompt_manifest(tmp_path))],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    captured = re.search(r"captured tokens \(prompt \+ response\): (\d+)", proc.stdout)
    assert captured and int(captured.group(1)) > 4 * 128, proc.stdout[-2000:]  # full KV blocks to find cached
    cached = re.search(r"floor prefill: tokens read from the prefix cache per round \[([\d, ]*)\]", proc.stdout)
    assert cached, proc.stdout[-2000:]
    assert [int(x) for x in cached.group(1).split(",")] == [0]  # one round, no token read back
    assert re.search(r"regen\+prefill / regen \(time\) = \d", proc.stdout)
    assert re.search(r"regen\+capture / regen \(time\) = \d", proc.stdout)
