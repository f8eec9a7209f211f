"""The long_chat composition rule: pure Arrow-batch transform, manifest validation, pool integration."""

import hashlib
import json

import pytest

from eaglenest.config import build, to_dict
from eaglenest.errors import ManifestError
from eaglenest.ingest import compose
from eaglenest.ingest.manifest import MAX_COMPOSE_TOKENS, Manifest, check
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
    problems = check(build(Manifest, _manifest({"target_tokens": [1]})))
    assert f"domains.long.compose.target_tokens[0]: 1 is not in [256, {MAX_COMPOSE_TOKENS}]" in problems, problems


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


def _docs(**kw):
    args = dict(domain="docs", rule="documents", target_tokens=[512, 2048], per_length=2, answer_tokens=40,
                count_tokens=words)
    args.update(kw)
    return compose.compose(compose.rows_batch([]), **args).to_pylist()


def test_documents_fill_their_length_and_ask_about_something_near_their_start():
    docs = _docs()
    assert [d["source"] for d in docs] == [f"compose:documents:{k}:{n}" for n in (512, 2048) for _ in range(2)
                                           for k in ("records", "code")]
    for d in docs:
        n = int(d["source"].rsplit(":", 1)[1])
        budget = n - 40 - compose.TURN_OVERHEAD_TOKENS
        assert budget - 20 < words(d["prompt"]) <= budget  # a unit is < 20 words: no room left unused
        assert d["later_turns"] == [] and d["system"] == ""
        text, question = d["prompt"].rsplit("\n", 1)
        if ":records:" in d["source"]:
            rid = question.split("of record ")[1].rstrip("?")
            lines = [ln for ln in text.splitlines() if ln.startswith("Record ")]
            at = [i for i, ln in enumerate(lines) if ln.startswith(f"Record {rid}:")]
            assert len(at) == 1 and 0 < at[0] <= 0.15 * len(lines) + 1  # once, near the start
        else:
            doc = question.split('documented as "')[1].split('"')[0]
            defs = text.count("def ")
            assert text.count(f'"""{doc}"""') == 1
            assert 0 < text[:text.index(doc)].count("def ") <= 0.15 * defs + 2
    assert len({d["prompt"] for d in docs}) == len(docs)


def test_documents_are_deterministic_and_never_the_evaluations_prompts():
    assert _docs() == _docs() and _docs(seed=1) != _docs()
    assert [d["source"] for d in _docs(kinds=["code"])] == [f"compose:documents:code:{n}" for n in (512, 512, 2048, 2048)]
    # the evaluation draws its material from longctx seeds; a document's from its own names
    import random

    from eaglenest.material import SPECS
    eval_questions = {SPECS[k](random.Random(f"longctx:{k}:{s}"), ()).question for k in ("records", "code")
                      for s in range(200)}
    assert not {d["prompt"].rsplit("\n", 1)[1] for d in _docs(per_length=5)} & {q.strip() for q in eval_questions}


def test_documents_too_short_a_length_names_the_key():
    with pytest.raises(ManifestError, match=r"domains\.docs\.compose\.target_tokens: 300: 300 tokens|"
                                            r"domains\.docs\.compose\.target_tokens: 300:"):
        _docs(target_tokens=[300], answer_tokens=290)


def _docs_manifest(compose_cfg, sources=()):
    return {"name": "t", "licence": "x", "domains": {"docs": {
        "cap_prompts": 10, "held_out_count": 0, "compose": compose_cfg, "sources": list(sources)}}}


@pytest.mark.parametrize("cfg, sources, line", [
    ({"rule": "documents", "target_tokens": [1024]}, [{"path": "x", "provenance": "p"}],
     "domains.docs.sources: compose.rule documents generates its prompts"),
    ({"rule": "documents", "target_tokens": [1024], "kinds": ["recall"]}, [],
     "domains.docs.compose.kinds[0]: 'recall' is not a document kind"),
    ({"rule": "documents", "target_tokens": [1024], "kinds": []}, [], "domains.docs.compose.kinds: give at least one"),
    ({"rule": "documents", "target_tokens": [1024], "kinds": ["code", "code"]}, [], "domains.docs.compose.kinds: kinds repeat"),
    ({"rule": "long_chat", "target_tokens": [1024], "kinds": ["code"]}, [{"path": "x", "provenance": "p"}],
     "domains.docs.compose.kinds: only compose.rule documents"),
    ({"rule": "long_chat", "target_tokens": [1024]}, [], "domains.docs.sources: at least one source is required"),
])
def test_bad_documents_values_get_one_line_naming_the_key(cfg, sources, line):
    m = build(Manifest, _docs_manifest(cfg, sources))
    assert any(p.startswith(line) for p in check(m)), check(m)


def test_a_documents_domain_needs_no_sources_and_enters_the_pool_as_single_turn_chats():
    m = build(Manifest, _docs_manifest({"rule": "documents", "target_tokens": [512, 1024], "per_length": 2,
                                        "answer_tokens": 30}))
    assert check(m) == []
    loaded = compose.apply(m, {"docs": []}, count_tokens=words)
    pool = build_pool(m, loaded)
    assert len(pool) == 8 and all(e.split == "train" and not e.later_turns for e in pool)
    assert {e.mode for e in pool} == {"chat", "raw"}  # raw_fraction (0.2) applies as to any prompt
    assert {e.prompt.rsplit("\n", 1)[1].split(" ")[0] for e in pool} == {"In", "Using"}  # records, code questions


def test_long_chat_manifests_keep_their_hash_with_the_documents_rule_added():
    m = build(Manifest, _manifest({"target_tokens": [2048]}))
    d = to_dict(m)
    d.pop("dedup")
    d["domains"]["long"]["compose"].pop("kinds")
    assert m.content_hash() == hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]
