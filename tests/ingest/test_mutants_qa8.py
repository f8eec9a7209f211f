"""The prompt pool's core choices against references computed here from first principles (mutation audit).

Each test recomputes what docs/manifest.md "How the pool is built" says (hash order, caps, the held-out
and raw hashes, sample ids) with hashlib and plain loops, and compares the pool with it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

from eaglenest.config import build
from eaglenest.hf import load_tokenizer
from eaglenest.ingest.manifest import Generation, Manifest
from eaglenest.ingest.neardup import NearDupIndex, jaccard, shingles
from eaglenest.ingest.pool import PoolEntry, build_pool, raw_text
from eaglenest.ingest import compose, contamination
from eaglenest.ingest.reasoning import ThinkCheck
from eaglenest.ingest.regen import gen_params_id, heldout_row, regenerate
from eaglenest.text import content_key

from ingest_helpers import Scripted  # tests/ingest on sys.path via conftest


def _manifest(domains: dict, **top) -> Manifest:
    return build(Manifest, {"name": "t", "licence": "x", "raw_fraction": 0.0, **top, "domains": domains})


def _domain(**kw) -> dict:
    return {"cap_prompts": 1000, "sources": [{"path": "x", "provenance": "p"}], **kw}


def _rows(prompts, system: str = "") -> list[dict]:
    return [{"prompt": p, "system": system, "source": "s"} for p in prompts]


def _words(text: str) -> int:
    return len(text.split())


def _unit(key: str, salt: str) -> float:
    """The documented second hash: the first 48 bits of sha256("<salt>:<key>") as a share of 2**48."""
    return int(hashlib.sha256(f"{salt}:{key}".encode()).hexdigest()[:12], 16) / 2.0 ** 48


def test_a_token_cap_stops_at_the_first_prompt_that_overflows_it_in_hash_order():
    prompts = [(f"question {i} " + "word " * (1 + (i * 7) % 23)).strip() for i in range(60)]
    by_hash = sorted(prompts, key=content_key)
    cap, total, want = 200, 0, []
    for p in by_hash:  # the reference: the longest prefix in hash order within the cap
        if total + _words(p) > cap:
            break
        total += _words(p)
        want.append(p)
    rest = by_hash[len(want):]
    assert any(total + _words(p) <= cap for p in rest[1:])  # a later, shorter prompt would fit: the case here
    pool = build_pool(_manifest({"a": _domain(cap_prompts=None, cap_tokens=cap)}, held_out_fraction=0.0),
                      {"a": _rows(prompts)}, count_tokens=_words)
    assert [e.prompt for e in pool] == want


def test_sample_ids_splits_and_modes_follow_the_documented_hashes():
    prompts = [f"prompt number {i} about topic {i * 13}" for i in range(400)]
    pool = build_pool(_manifest({"a": _domain()}, held_out_fraction=0.3, raw_fraction=0.4), {"a": _rows(prompts)})
    assert len(pool) == len(prompts)
    for e in pool:
        key = content_key(e.prompt)
        assert e.sample_id == f"a-{key[:16]}"
        assert e.split == ("heldout" if _unit(key, "heldout") < 0.3 else "train")
        assert e.mode == ("raw" if e.split == "train" and _unit(key, "raw") < 0.4 else "chat")
    assert {e.split for e in pool} == {"heldout", "train"} and {e.mode for e in pool} == {"raw", "chat"}


def test_a_held_out_count_takes_the_lowest_of_the_held_out_hash():
    prompts = [f"prompt number {i} about topic {i * 13}" for i in range(50)]
    pool = build_pool(_manifest({"a": _domain(held_out_count=7)}), {"a": _rows(prompts)})
    want = sorted(prompts, key=lambda p: _unit(content_key(p), "heldout"))[:7]
    assert sorted(e.prompt for e in pool if e.split == "heldout") == sorted(want)
    assert sorted(want) != sorted(sorted(prompts, key=content_key)[:7])  # another order would tell


def test_a_near_twin_of_a_prompt_an_earlier_domain_leaves_out_by_its_cap_is_kept():
    # docs: a prompt is dropped when near one "already kept, in this domain or chosen by an earlier one"
    base = [f"please explain in simple words how the number {i} relates to topic {i * 31} today" for i in range(8)]
    twins = [p + " thanks" for p in base]
    assert all(jaccard(shingles(a), shingles(b)) >= 0.8 for a, b in zip(base, twins))
    m = _manifest({"a": _domain(cap_prompts=3), "b": _domain()}, held_out_fraction=0.0,
                  dedup={"near_duplicate_threshold": 0.8})
    pool = build_pool(m, {"a": _rows(base), "b": _rows(twins)})
    chosen = sorted(base, key=content_key)[:3]
    assert sorted(e.prompt for e in pool if e.domain == "a") == sorted(chosen)
    kept_twins = sorted(t for b, t in zip(base, twins) if b not in chosen)
    assert sorted(e.prompt for e in pool if e.domain == "b") == kept_twins


def test_a_raw_completion_is_the_system_prompt_a_blank_line_and_the_prompt():
    # docs/evaluate.md: held-out raw prompts are decoded "as the raw completions ingest sent (system prompt,
    # blank line, prompt)"; both sides build it here, so a stored raw row must read back the same way.
    entry = PoolEntry(sample_id="a-0", domain="a", source="s", split="train", mode="raw", system="Be brief.",
                      prompt="What is 2 + 2?")
    text = raw_text(entry)
    assert text.startswith("Be brief.\n\n") and text.removeprefix("Be brief.\n\n").strip() == "What is 2 + 2?"
    assert raw_text(dataclasses.replace(entry, system="")).strip() == "What is 2 + 2?"


def test_a_domains_held_out_setting_beats_the_manifests_either_way():
    prompts = [f"prompt number {i} about topic {i * 13}" for i in range(40)]
    rows = {d: _rows([f"{d}: {p}" for p in prompts]) for d in ("a", "b", "c")}
    m = _manifest({"a": _domain(held_out_fraction=0.0), "b": _domain(), "c": _domain(held_out_count=5)},
                  held_out_count=3)
    held = {d: sum(e.split == "heldout" for e in build_pool(m, rows) if e.domain == d) for d in rows}
    assert held == {"a": 0, "b": 3, "c": 5}
    m = _manifest({"a": _domain(held_out_count=2), "b": _domain()}, held_out_fraction=0.5)
    pool = build_pool(m, {d: rows[d] for d in ("a", "b")})
    assert sum(e.split == "heldout" for e in pool if e.domain == "a") == 2
    want_b = sum(_unit(content_key(r["prompt"]), "heldout") < 0.5 for r in rows["b"])
    assert sum(e.split == "heldout" for e in pool if e.domain == "b") == want_b


def test_a_domains_raw_fraction_beats_the_manifests():
    prompts = [f"prompt number {i} about topic {i * 13}" for i in range(200)]
    m = _manifest({"a": _domain(raw_fraction=0.0), "b": _domain(), "c": _domain(raw_fraction=0.7)},
                  held_out_fraction=0.0, raw_fraction=0.3)
    pool = build_pool(m, {d: _rows([f"{d}: {p}" for p in prompts]) for d in ("a", "b", "c")})
    for domain, share in (("a", 0.0), ("b", 0.3), ("c", 0.7)):
        raw = {e.prompt for e in pool if e.domain == domain and e.mode == "raw"}
        assert raw == {e.prompt for e in pool if e.domain == domain and _unit(content_key(e.prompt), "raw") < share}
    assert {e.mode for e in pool if e.domain == "c"} == {"raw", "chat"}


def test_the_manifest_hash_changes_with_every_setting_that_changes_the_pool():
    base = {"name": "t", "licence": "x", "domains": {"a": _domain()}}
    changes = [{"dedup": {"near_duplicate_threshold": 0.8}}, {"dedup": {"shingle_words": 3}},
               {"held_out_fraction": 0.3}, {"raw_fraction": 0.5}, {"generation": {"seed": 1}},
               {"contamination": {"action": "error"}}, {"domains": {"a": _domain(cap_prompts=7)}},
               {"domains": {"a": _domain(held_out_count=2)}}]
    hashes = [build(Manifest, {**base, **c}).content_hash() for c in changes]
    assert len(set(hashes)) == len(changes) and build(Manifest, base).content_hash() not in hashes
    assert build(Manifest, {**base, "dedup": {}}).content_hash() == build(Manifest, base).content_hash()


class _Recording(Scripted):
    """The scripted backend (ingest_helpers.py), keeping what each request sent."""

    def submit(self, key, kind, payload, gen):
        self.sent = [*getattr(self, "sent", []), json.loads(json.dumps(payload))]
        super().submit(key, kind, payload, gen)


def test_a_conversation_is_answered_turn_by_turn_each_request_holding_the_earlier_answers(tiny_target):
    tok = load_tokenizer(tiny_target, trust_remote_code=False)
    backend = _Recording(tok)
    e = PoolEntry(sample_id="a-1", domain="a", source="s", split="train", mode="chat", system="S", prompt="one",
                  later_turns=("two", "three"))
    (row,), failures = regenerate(backend, [e], Generation(), "g")
    assert failures == []
    turns = [[{"role": "system", "content": "S"}, {"role": "user", "content": "one"}]]
    for t in ("two", "three"):  # the reference: each request is the last one, its answer, the next turn
        turns.append([*turns[-1], {"role": "assistant", "content": "fine."}, {"role": "user", "content": t}])
    assert backend.sent == turns
    assert json.loads(row["messages_json"]) == [*turns[-1], {"role": "assistant", "content": "fine."}]
    assert row["prompt_token_ids"] == tok("three")["input_ids"]  # the last request's (the scripted backend's ids)
    assert row["response_token_ids"] == tok("fine.")["input_ids"]


def test_a_held_out_conversation_is_stored_with_every_user_turn_unanswered():
    e = PoolEntry(sample_id="a-1", domain="a", source="s", split="heldout", mode="chat", system="", prompt="one",
                  later_turns=("two", "three"))
    row = heldout_row(e, "g")
    assert json.loads(row["messages_json"]) == [{"role": "user", "content": t} for t in ("one", "two", "three")]
    assert row["prompt_token_ids"] == row["response_token_ids"] == [] and row["finish_reason"] == ""


def test_a_near_duplicate_threshold_of_one_drops_an_evaluation_prompt_with_other_punctuation(tmp_path):
    # (0, 1] is the documented range: at 1.0, the same words in the same order are a near duplicate.
    question = "What is the capital city of France, and why did it become the capital?"
    twin = "what is the capital city of france and why did it become the capital"
    assert content_key(question) != content_key(twin) and jaccard(shingles(question), shingles(twin)) == 1.0
    (tmp_path / "q.jsonl").write_text(json.dumps({"turns": [question]}) + "\n")
    m = _manifest({"a": _domain()}, held_out_fraction=0.0, contamination={
        "speed_bench": [str(tmp_path / "q.jsonl")], "near_duplicate_threshold": 1.0})
    pool = build_pool(m, {"a": _rows([twin, "an unrelated prompt about the weather in spring"])})
    kept, report = contamination.check(pool, m)
    assert [e.prompt for e in kept] == ["an unrelated prompt about the weather in spring"]
    assert report["by_reason"] == {"near:eval": 1}


def test_a_generation_prompt_is_open_only_when_it_ends_in_the_open_tag():
    check = ThinkCheck("<think>", "</think>", target="unused")
    assert check.opens_block("<|user|>\nhi<|end|>\n<|assistant|>\n<think>\n")
    assert not check.opens_block("<|user|>\nwhat does <think> mean?<|end|>\n<|assistant|>\n")
    assert not check.opens_block("<|assistant|>\n<think>\n\n</think>\n\n")


def test_shingles_are_every_run_of_n_words():
    words = "The quick brown fox jumps over the lazy dog".split()
    assert shingles(" ".join(words), 5) == {" ".join(words[i:i + 5]).lower() for i in range(len(words) - 4)}
    assert shingles("Two words", 5) == {"two words"}


def test_near_duplicates_at_exactly_the_threshold_are_dropped():
    # docs/manifest.md: a prompt goes when its similarity "reaches the threshold": at 1.0, the same words.
    prompts = ["Explain, briefly, how a bicycle gear works on a steep hill.",
               "explain briefly how a bicycle gear works on a steep hill",
               "Describe the water cycle for a class of ten year old children."]
    m = _manifest({"a": _domain()}, held_out_fraction=0.0, dedup={"near_duplicate_threshold": 1.0})
    report: dict = {}
    pool = build_pool(m, {"a": _rows(prompts)}, report=report)
    assert report["domains"]["a"]["near_duplicates"] == 1
    kept_twin = min(prompts[:2], key=content_key)  # the earlier in hash order stays
    assert sorted(e.prompt for e in pool) == sorted([kept_twin, prompts[2]])


def test_the_index_names_the_earliest_added_of_several_near_texts():
    index = NearDupIndex(0.5)
    first, second = "one two three four five six seven eight", "one two three four five six seven nine"
    index.add("first", index.sketch(first))
    index.add("second", index.sketch(second))
    assert index.find(index.sketch("one two three four five six seven")) == "first"  # 0.75 to both


def test_a_composed_chat_takes_every_prompt_its_budget_still_holds():
    # docs/manifest.md: each turn costs its prompt's tokens, 8 template tokens and answer_tokens; prompts are
    # added "while the budget stays within the target" (the system prompt counted once): a prompt that fills
    # it exactly is added too.
    rows = [{"prompt": f"question {i}", "system": "Answer in one short sentence.", "later_turns": [], "source": "s"}
            for i in range(10)]
    answer, unit = 10, 2 + compose.TURN_OVERHEAD_TOKENS + 10  # every prompt is two words
    lengths = range(260, 290)  # 10 chats each, their facts of several lengths: some end a pass one prompt short
    convs = compose.compose(compose.rows_batch(rows), domain="d", rule="long_chat", target_tokens=list(lengths),
                            per_length=10, answer_tokens=answer, count_tokens=_words).to_pylist()
    assert len(convs) == 10 * len(lengths)
    for length, c in zip((n for n in lengths for _ in range(10)), convs):
        used = _words(c["system"]) + sum(_words(t) + compose.TURN_OVERHEAD_TOKENS + answer
                                         for t in [c["prompt"], *c["later_turns"]])
        assert used <= length and length - used < unit, (length, used)


def test_the_generation_id_changes_with_every_sampling_setting():
    base = Generation()
    variants = [Generation(temperature=0.5), Generation(max_tokens=7), Generation(seed=1), Generation(reasoning="on")]
    ids = {gen_params_id(g, "template") for g in variants}
    ids |= {gen_params_id(base, "other template"), gen_params_id(base, "template", {"x": 1})}
    assert len(ids) == 6 and gen_params_id(base, "template") not in ids
    assert gen_params_id(base, "template") == gen_params_id(Generation(), "template", {})


def _long_chat(seed: int = 0) -> Manifest:
    return _manifest({"long": _domain(held_out_count=0, compose={
        "rule": "long_chat", "target_tokens": [400, 800], "per_length": 3, "answer_tokens": 10})},
        generation={"seed": seed})


def test_a_held_out_later_turn_keeps_its_whole_row_out_of_composed_chats():
    rows = [{"prompt": f"opening {i}", "later_turns": [f"follow up question {i}"], "system": "", "source": "s"}
            for i in range(12)]
    held = {content_key("follow up question 3"), content_key("opening 5")}
    convs = compose.apply(_long_chat(), {"long": rows}, count_tokens=_words, held_out=held)["long"]
    turns = [t for c in convs for t in [c["prompt"], *c["later_turns"]]]
    assert turns and not [t for t in turns if t.endswith(("follow up question 3", "opening 5", "opening 3"))]
    assert [t for t in turns if t.endswith("opening 4")]  # the other rows are used


def test_the_generation_seed_reshuffles_composed_chats():
    rows = [{"prompt": f"question number {i}", "system": "", "later_turns": [], "source": "s"} for i in range(30)]
    one = compose.apply(_long_chat(0), {"long": rows}, count_tokens=_words)["long"]
    assert one == compose.apply(_long_chat(0), {"long": rows}, count_tokens=_words)["long"]
    assert one != compose.apply(_long_chat(1), {"long": rows}, count_tokens=_words)["long"]
