"""Near-duplicate removal in the prompt pool: MinHash + LSH against brute-force Jaccard, determinism,
the manifest switch, per-domain counts, and cross-domain precedence. Pure CPU, no engine."""

from __future__ import annotations

import itertools
import random

import pytest

from eaglenest.config import build
from eaglenest.ingest.manifest import Manifest, check
from eaglenest.ingest.neardup import NearDupIndex, jaccard, shingles
from eaglenest.ingest.pool import build_pool

WORDS = ("river harbour gull tide stone lantern market bread copper window garden ladder violin "
         "kettle orchard meadow signal engine paper thunder").split()


def _corpus(n: int, seed: int = 0) -> list[str]:
    """Base texts plus edited copies (a few words swapped): pairs at many similarity levels."""
    rng = random.Random(seed)
    base = [" ".join(rng.choice(WORDS) for _ in range(30)) for _ in range(n)]
    out = list(base)
    for text in base:
        words = text.split()
        for edits in (1, 3, 8):
            w = list(words)
            for i in rng.sample(range(len(w)), edits):
                w[i] = rng.choice(WORDS)
            out.append(" ".join(w))
    return out


def _manifest(threshold=None, cap=1000, domains=("a",)):
    return build(Manifest, {"name": "t", "licence": "x", "held_out_fraction": 0.2, "raw_fraction": 0.0,
                            "dedup": {"near_duplicate_threshold": threshold},
                            "domains": {d: {"cap_prompts": cap, "sources": [{"path": "x", "provenance": "p"}]}
                                        for d in domains}})


def test_lsh_finds_what_brute_force_finds():
    texts = _corpus(40)
    sets = [shingles(t) for t in texts]
    idx = NearDupIndex(0.5)
    found = set()
    for i, t in enumerate(texts):
        sk = idx.sketch(t)
        assert sk[0] == sets[i]
        hit = idx.find(sk)
        if hit is not None:
            assert jaccard(sets[i], sets[hit]) >= 0.5  # verified exactly: never a false positive
            found.add(i)
        idx.add(i, sk)
    # brute force: the texts with an earlier text at Jaccard >= 0.5 (all earlier ones are indexed)
    best = {j: max(jaccard(sets[i], sets[j]) for i in range(j)) for j in range(1, len(texts))}
    truth = {j for j, b in best.items() if b >= 0.5}
    assert len(truth) > 40, "the corpus must contain near pairs"
    assert found <= truth
    missed = truth - found
    assert len(missed) <= 0.05 * len(truth), (len(missed), len(truth))
    assert all(best[j] < 0.65 for j in missed)  # LSH misses only pairs close to the threshold


def test_pool_near_dedup_is_deterministic_counted_and_off_by_default():
    texts = _corpus(30, seed=1)
    rows = [{"prompt": t, "system": "", "source": "s"} for t in texts]
    on = _manifest(threshold=0.5)
    report: dict = {}
    p1 = build_pool(on, {"a": rows}, report=report)
    p2 = build_pool(on, {"a": list(reversed(rows))})
    assert p1 == p2
    counts = report["domains"]["a"]
    assert counts["near_duplicates"] > 0 and counts["kept"] == len(p1)
    assert counts["rows"] == len(rows) == counts["kept"] + counts["near_duplicates"] + counts["exact_duplicates"]
    kept = [shingles(e.prompt) for e in p1]
    assert all(jaccard(x, y) < 0.5 for x, y in itertools.combinations(kept, 2))  # no near pair left
    off = build_pool(_manifest(), {"a": rows})
    assert len(off) == len(rows) - counts["exact_duplicates"] > len(p1)
    assert _manifest().content_hash() == build(Manifest, {  # the new key keeps old manifests' hashes
        "name": "t", "licence": "x", "held_out_fraction": 0.2, "raw_fraction": 0.0,
        "domains": {"a": {"cap_prompts": 1000, "sources": [{"path": "x", "provenance": "p"}]}}}).content_hash()


def test_near_duplicates_across_domains_first_domain_wins_and_system_is_ignored():
    base = "please write a short poem about the quiet harbour at dawn with gulls and boats"
    a = [{"prompt": base, "system": "", "source": "s"}]
    b = [{"prompt": base + " today", "system": "You are terse.", "source": "s"},
         {"prompt": "list three prime numbers larger than one hundred please", "system": "", "source": "s"}]
    report: dict = {}
    pool = build_pool(_manifest(threshold=0.7, domains=("a", "b")), {"a": a, "b": b}, report=report)
    assert [e.domain for e in pool].count("a") == 1 and [e.domain for e in pool].count("b") == 1
    assert report["domains"]["b"]["near_duplicates"] == 1
    strict = build_pool(_manifest(threshold=1.0, domains=("a", "b")), {"a": a, "b": b})
    assert len(strict) == 3  # Jaccard 11/12 < 1.0


def test_bad_threshold_is_a_manifest_problem():
    bad = build(Manifest, {"name": "t", "licence": "x", "dedup": {"near_duplicate_threshold": 1.5, "num_perm": 4},
                           "domains": {"a": {"cap_prompts": 1, "sources": [{"path": "x", "provenance": "p"}]}}})
    problems = check(bad)
    assert any(p.startswith("dedup.near_duplicate_threshold: 1.5") for p in problems)
    assert any(p.startswith("dedup.num_perm: 4") for p in problems)
    with pytest.raises(ValueError, match=r"^threshold 0\.0 is not in \(0, 1\]$"):
        NearDupIndex(0.0)
