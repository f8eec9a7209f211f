"""The long_chat composition rule: pure Arrow-batch transform, manifest validation, pool integration."""

import hashlib
import json

import pytest

from eaglenest.config import build, to_dict
from eaglenest.errors import ManifestError
from eaglenest.ingest import compose
from eaglenest.ingest.manifest import Manifest, ManifestProblems, check
from eaglenest.ingest.pool import build_pool


def words(text: str) -> int:
    """A stand-in tokenizer for the pure tests: one token per word (a real one is used end to end)."""
    return len(text.split())


def _rows(n: int):
    return [{"prompt": f"prompt number {i} about {'x ' * (i % 7)}".strip(), "system": "sys" if i % 3 else "",
             "source": "s"} for i in range(n)]


def _compose(rows, **kw):
    args = dict(domain="long", rule="long_chat", target_tokens=[512, 2048], per_length=2, answer_tokens=40,
                count_tokens=words)
    args.update(kw)
    return compose.compose(compose.rows_batch(rows), **args).to_pylist()


def _budget(conv, answer_tokens=40):
    turns = [conv["prompt"], *conv["later_turns"]]
    return words(conv["system"]) + sum(words(t) + compose.TURN_OVERHEAD_TOKENS + answer_tokens for t in turns)


def test_conversations_fill_their_target_and_refer_back_to_the_first_turn():
    convs = _compose(_rows(30))
    assert [c["source"] for c in convs] == ["compose:long_chat:512"] * 2 + ["compose:long_chat:2048"] * 2
    for c in convs:
        length = int(c["source"].rsplit(":", 1)[1])
        # within the target, and no prompt left out that would still have fitted
        assert length - (max(words(r["prompt"]) for r in _rows(30)) + compose.TURN_OVERHEAD_TOKENS + 40) \
            < _budget(c) <= length
        first, last = c["prompt"], c["later_turns"][-1]
        thing = first.split("Please remember this for later: ", 1)[1].split(" is ")[0]
        assert thing in last and "very start of this chat" in last
        assert len(c["later_turns"]) >= 3
    long = [c for c in convs if c["source"].endswith(":2048")]
    assert len(long[0]["later_turns"]) > 30  # rows repeat (30 rows, 2048 tokens)
    assert long[0] != long[1]  # each conversation draws its own fact and order


def test_composition_ignores_file_order_and_is_deterministic():
    rows = _rows(25)
    assert _compose(rows) == _compose(list(reversed(rows))) == _compose(rows)
    assert _compose(rows, seed=1) != _compose(rows)


def test_too_short_a_target_names_the_key():
    with pytest.raises(ManifestError, match=r"domains\.long\.compose\.target_tokens: 300 tokens cannot hold"):
        _compose(_rows(5), target_tokens=[300], answer_tokens=140)


def test_no_rows_names_the_domain():
    with pytest.raises(ManifestError, match=r"domains\.long\.compose: domain 'long' has no prompts"):
        _compose([])


def _manifest(compose_cfg):
    return {"name": "t", "licence": "x", "domains": {"long": {
        "cap_prompts": 10, "held_out_count": 0, "compose": compose_cfg,
        "sources": [{"path": "x", "provenance": "p"}]}}}


@pytest.mark.parametrize("cfg, line", [
    ({"rule": "long_chat"}, "domains.long.compose.target_tokens: give at least one length"),
    ({"target_tokens": [100]}, "domains.long.compose.target_tokens[0]: 100 is not in [256,"),
    ({"target_tokens": [2048, 2048]}, "domains.long.compose.target_tokens: lengths repeat"),
    ({"target_tokens": [2048], "per_length": 0}, "domains.long.compose.per_length: 0 is not in"),
    ({"target_tokens": [2048], "answer_tokens": 0}, "domains.long.compose.answer_tokens: must be at least 1"),
])
def test_bad_compose_values_get_one_line_naming_the_key(cfg, line):
    m = build(Manifest, _manifest(cfg))
    assert any(p.startswith(line) for p in check(m)), check(m)


def test_unknown_rule_and_key_are_refused():
    with pytest.raises(ManifestError, match=r"domains\.long\.compose\.rule: 'stitch' is not one of"):
        build(Manifest, _manifest({"rule": "stitch", "target_tokens": [2048]}), error=ManifestError)
    problems = []
    build(Manifest, _manifest({"target_tokens": [2048], "lenght": 3}), error=ManifestError, problems=problems)
    assert problems == ["domains.long.compose.lenght: unknown key"]
    with pytest.raises(ManifestProblems):
        raise ManifestProblems(check(build(Manifest, _manifest({"target_tokens": [1]}))))


def test_manifests_without_compose_keep_their_hash():
    plain = {"name": "t", "licence": "x", "domains": {"a": {"cap_prompts": 1, "sources": [{"path": "x",
                                                                                           "provenance": "p"}]}}}
    m = build(Manifest, plain)
    d = to_dict(m)
    d.pop("dedup")
    d["domains"]["a"].pop("compose")
    assert m.content_hash() == hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]
    with_rule = build(Manifest, _manifest({"target_tokens": [2048]}))
    assert "compose" in json.dumps(to_dict(with_rule)) and with_rule.content_hash() != m.content_hash()


def test_pool_holds_the_composed_conversations_as_multi_turn_chats():
    m = build(Manifest, _manifest({"target_tokens": [512, 1024], "per_length": 3, "answer_tokens": 30}))
    loaded = compose.apply(m, {"long": _rows(20)}, count_tokens=words)
    pool = build_pool(m, loaded)
    assert len(pool) == 6 and all(e.mode == "chat" and e.split == "train" for e in pool)
    assert all(len(e.later_turns) >= 3 and "very start of this chat" in e.later_turns[-1] for e in pool)
    with pytest.raises(ManifestError, match=r"domains\.long\.compose: needs the target's tokenizer"):
        compose.apply(m, {"long": _rows(20)}, count_tokens=None)
    assert compose.longest_tokens(m) == 1024 + m.generation.max_tokens


def test_prompts_held_out_elsewhere_never_enter_a_composed_chat():
    from eaglenest.text import content_key

    m = build(Manifest, _manifest({"target_tokens": [2048], "per_length": 3, "answer_tokens": 30}))
    rows = _rows(20)
    held = {content_key(r["prompt"]) for r in rows[:10]}
    convs = compose.apply(m, {"long": rows}, count_tokens=words, held_out=held)["long"]
    used = {content_key(t) for c in convs for t in [c["prompt"].split("\n\n", 1)[1], *c["later_turns"][:-1]]}
    assert used and not used & held
    assert used <= {content_key(r["prompt"]) for r in rows[10:]}
