"""``ingest build``'s warnings before any engine starts: a domain held out whole."""

import hashlib

from eaglenest.config import build
from eaglenest.ingest.commands import all_held_out
from eaglenest.ingest.manifest import Manifest
from eaglenest.ingest.pool import build_pool
from eaglenest.text import content_key


def _held_by_hash(prompt: str, fraction: float) -> bool:
    """docs/manifest.md step 4: held out when the second hash, as a share of 2**48, is under the fraction."""
    return int(hashlib.sha256(f"heldout:{content_key(prompt)}".encode()).hexdigest()[:12], 16) / 2.0 ** 48 < fraction


def test_a_held_out_fraction_that_takes_a_small_domain_whole_is_warned_of():
    # A held_out_fraction under 1 can still hold out every prompt of a small domain by its hashes: nothing of
    # the domain was trained on, and only a held_out_count that did so was warned of.
    prompts = [p for p in (f"question number {i}" for i in range(200)) if _held_by_hash(p, 0.5)][:3]
    others = [p for p in (f"another question {i}" for i in range(200)) if not _held_by_hash(p, 0.5)][:3]
    m = build(Manifest, {"name": "t", "licence": "x", "held_out_fraction": 0.5, "domains": {
        d: {"cap_prompts": 10, "sources": [{"path": "x", "provenance": "p"}]} for d in ("a", "b")}})
    report: dict = {}
    build_pool(m, {"a": [{"prompt": p, "system": "", "source": "s"} for p in prompts],
                   "b": [{"prompt": p, "system": "", "source": "s"} for p in others]}, report=report)
    assert report["domains"]["a"]["held_out"] == report["domains"]["a"]["kept"] == 3
    assert all_held_out(m, report) == [
        "ingest: warning: domain a: held_out_fraction 0.5 takes all 3 of its prompts (each prompt's hash decides): "
        "none of them is trained on (lower held_out_fraction, or add prompts)"]
