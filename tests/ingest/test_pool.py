from eaglenest.config import build
from eaglenest.ingest.manifest import Manifest
from eaglenest.ingest.pool import build_pool, content_key, normalise


def _manifest(cap=100, held=0.25, raw=0.2):
    return build(Manifest, {"name": "t", "licence": "x", "held_out_fraction": held, "raw_fraction": raw,
                            "domains": {"a": {"cap_prompts": cap, "sources": [{"path": "x", "provenance": "p"}]},
                                        "b": {"cap_prompts": cap, "sources": [{"path": "y", "provenance": "p"}]}}})


def _rows(n, prefix="prompt"):
    return [{"prompt": f"{prefix} number {i}", "system": "", "source": "s"} for i in range(n)]


def test_normalise_and_key():
    assert normalise("  a \r\nb  \n") == "a\nb"
    assert content_key("Hello   World") == content_key("hello world")
    assert content_key("hello") != content_key("hello!")


def test_pool_is_deterministic_and_order_independent():
    m = _manifest()
    rows = _rows(200)
    p1 = build_pool(m, {"a": rows})
    p2 = build_pool(m, {"a": list(reversed(rows))})
    assert p1 == p2
    assert len(p1) == 100  # cap
    assert len({e.sample_id for e in p1}) == 100


def test_exact_duplicates_dropped_within_and_across_domains():
    m = _manifest()
    rows = _rows(10) + [{"prompt": "PROMPT  number 3", "system": "", "source": "s2"}]
    pool = build_pool(m, {"a": rows, "b": _rows(10)})
    assert sum(e.domain == "a" for e in pool) == 10
    assert sum(e.domain == "b" for e in pool) == 0  # all of b duplicate a


def test_heldout_and_raw_fractions_roughly_respected():
    pool = build_pool(_manifest(cap=1000, held=0.25, raw=0.2), {"a": _rows(1000)})
    held = sum(e.split == "heldout" for e in pool) / len(pool)
    assert 0.2 < held < 0.3
    train = [e for e in pool if e.split == "train"]
    raw = sum(e.mode == "raw" for e in train) / len(train)
    assert 0.15 < raw < 0.25
    assert all(e.mode == "chat" for e in pool if e.split == "heldout")


def test_heldout_choice_is_stable_when_sources_grow():
    m = _manifest(cap=10_000)
    small = {e.sample_id: e.split for e in build_pool(m, {"a": _rows(50)})}
    big = {e.sample_id: e.split for e in build_pool(m, {"a": _rows(300)})}
    assert all(big[k] == v for k, v in small.items())
