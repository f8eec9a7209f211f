import pytest

from eaglenest.config import build
from eaglenest.errors import ManifestError
from eaglenest.ingest.manifest import Manifest, Source
from eaglenest.ingest.pool import build_pool, content_key, load_source, normalise


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


@pytest.mark.parametrize("line, at", [
    ('{"prompt": "\\ud800"}', "field: row 1 of {f}: column 'prompt'"),
    ('{"prompt": "a", "sys": "\\udfff x"}', "system_field: row 1 of {f}: column 'sys'"),
    ('{"msgs": [{"role": "user", "content": "\\ud83d"}]}', "messages_field: row 1 of {f}: message 0 (user) content"),
])
def test_a_lone_surrogate_is_refused_when_a_row_is_read(tmp_path, line, at):
    # JSON escapes can spell one; it passed `ingest validate` and crashed `ingest build` (UnicodeEncodeError).
    path = tmp_path / "src.jsonl"
    path.write_text('{"prompt": "ok", "msgs": [{"role": "user", "content": "ok"}]}\n' + line + "\n")
    src = Source(path=str(path), system_field="sys", messages_field="msgs" if "msgs" in line else "")
    want = f"d.{at.format(f=path)} is not valid Unicode text (a lone surrogate)"
    with pytest.raises(ManifestError) as exc:
        load_source(src, where="d")
    assert str(exc.value) == want


def test_rows_without_a_user_turn_are_counted_as_empty(tmp_path):
    # They were skipped uncounted: an empty pool said "0 rows read" of a source with rows.
    path = tmp_path / "src.jsonl"
    path.write_text('{"m": [{"role": "assistant", "content": "hi"}]}\n{"m": []}\n'
                    '{"m": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]}\n')
    rows = load_source(Source(path=str(path), messages_field="m"), where="d")
    assert [r["prompt"] for r in rows] == ["", "", "q"] and rows[2]["system"] == "s"
    report: dict = {}
    pool = build_pool(_manifest(), {"a": rows}, report=report)
    assert [e.prompt for e in pool] == ["q"]
    assert report["domains"]["a"] == {"rows": 3, "empty": 2, "exact_duplicates": 0, "near_duplicates": 0, "kept": 1,
                                      "held_out": 0}
