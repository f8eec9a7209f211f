"""Long-context material (``evaluate.longctx``) and the buckets built from it, on the tiny target's
tokenizer: exact lengths, evidence far back (measured in tokens), determinism per seed."""

from __future__ import annotations

import re

import pytest
from transformers import AutoTokenizer

from eaglenest.errors import ConfigError
from eaglenest.evaluate.buckets import build_bucket_prompts
from eaglenest.evaluate.config import MIN_BUCKET_PROMPTS, EvaluateConfig
from eaglenest.evaluate.longctx import KINDS, generate

MATERIAL = [([{"role": "user", "content": f"Tell me fact {i}."}], f"Fact {i} is that owls hunt at night.")
            for i in range(6)]


@pytest.fixture(scope="module")
def tok(tiny_target):
    return AutoTokenizer.from_pretrained(tiny_target)


def _needle(kind: str, answer: str) -> str:
    """The text the answer needs, which must occur once in the prompt, inside the evidence."""
    if kind == "records":
        return "Record " + re.search(r"record (\d+)", answer).group(1) + ":"
    if kind == "code":
        return "def " + re.match(r"print\((\w+)\(", answer).group(1) + "("
    thing, value = re.match(r"Your (.+) is (.+)\.$", answer).groups()
    return f"my {thing} is {value}"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("length", [1024, 4096])
def test_evidence_lies_far_back(tok, kind, length):
    p = generate(kind, tok, length, seed=3, material=MATERIAL)
    ids = p.prompt_token_ids
    assert len(ids) == length and ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert tok.decode(ids).endswith("<|assistant|>\n")  # ends where the answer starts
    # The evidence is most of the prompt away from the answer, and beyond the far-context probe's
    # default 512 kept tokens.
    assert p.evidence_distance_tokens >= 0.75 * length and p.evidence_distance_tokens > 512
    start, end = p.evidence
    needle = _needle(kind, p.answer)
    assert needle in tok.decode(ids[start:end])
    # Nowhere else: not before the evidence, not between it and the end (the question names it
    # only by id / docstring / "the start of this chat").
    assert needle not in tok.decode(ids[:start]) and needle not in tok.decode(ids[end:])
    assert tok.decode(ids).count(needle) == 1


@pytest.mark.parametrize("kind", KINDS)
def test_answer_value_is_what_only_the_evidence_supplies(tok, kind):
    p = generate(kind, tok, 1024, seed=5, material=MATERIAL)
    assert p.answer_value and p.answer_value in p.answer
    start, end = p.evidence
    ids = p.prompt_token_ids
    assert p.answer_value in tok.decode(ids[start:end])  # the evidence holds it
    assert p.answer_value not in tok.decode(ids[end:])  # the question near the end does not


@pytest.mark.parametrize("kind", KINDS)
def test_deterministic_per_seed(tok, kind):
    a = generate(kind, tok, 2048, seed=7, material=MATERIAL)
    b = generate(kind, tok, 2048, seed=7, material=MATERIAL)
    c = generate(kind, tok, 2048, seed=8, material=MATERIAL)
    assert a == b
    assert a.prompt_token_ids != c.prompt_token_ids and a.answer != c.answer


@pytest.mark.parametrize("length", [300, 777, 5000, 32768])
def test_fills_odd_lengths_exactly(tok, length):
    """Filler units fit to the bucket; the rest is the tail of one more unit, spliced in as ids."""
    for kind in KINDS:
        p = generate(kind, tok, length, seed=1)  # recall without held-out material: generated turns
        assert len(p.prompt_token_ids) == length, kind
        assert p.evidence[1] <= length - 20  # the question (and the chat template's tail) follow


def test_recall_reports_material_passes(tok):
    few = generate("recall", tok, 4096, seed=0, material=MATERIAL[:2])
    assert few.material_passes > 1  # two held-out chats cycled to fill 4K tokens
    assert generate("records", tok, 1024, seed=0).material_passes == 0


def test_too_short_or_unknown_is_refused(tok):
    with pytest.raises(ConfigError, match="too short"):
        generate("code", tok, 120, seed=0)
    with pytest.raises(ConfigError, match="unknown kind"):
        generate("poems", tok, 1024, seed=0)


def test_buckets_mix_kinds_identically(tok):
    kinds = ("records", "code", "recall", "chat")
    out = build_bucket_prompts(tok, MATERIAL, (1024, 2048), per_bucket=5, max_positions=4096, max_tokens=32,
                               seed=0, kinds=kinds)
    for bucket, rows in out.items():
        assert [r["material"] for r in rows] == [*kinds, "records"]  # the same mix in every bucket
        assert all(len(r["prompt_token_ids"]) == bucket for r in rows)
        assert [r["answer"] is None for r in rows] == [False, False, False, True, False]
        assert all(r["evidence_distance_tokens"] >= 0.75 * bucket for r in rows if r["answer"])
    assert out[1024][0]["prompt_token_ids"] != out[1024][4]["prompt_token_ids"]  # prompts differ
    # Paired across buckets: prompt i asks the same question at every length, with more context before it.
    for i, (short, long) in enumerate(zip(out[1024], out[2048])):
        assert short["pair"] == long["pair"] == i and short["answer"] == long["answer"]
        end = tok.decode(short["prompt_token_ids"][-12:])
        assert tok.decode(long["prompt_token_ids"][-12:]) == end
        assert short["prompt_token_ids"] != long["prompt_token_ids"][-1024:] or short["material"] == "chat"
    # A chat prompt is the same conversation cut further back: its latest turns are common to both.
    chat_short, chat_long = out[1024][3]["prompt_token_ids"], out[2048][3]["prompt_token_ids"]
    assert chat_long[-900:] == chat_short[-900:] and chat_long[-1100:] != chat_short[-1100:]
    # Generated kinds need no held-out material; chat does.
    assert build_bucket_prompts(tok, [], (1024,), per_bucket=1, max_positions=4096, max_tokens=32, kinds=("code",))
    with pytest.raises(ConfigError, match="no held-out material"):
        build_bucket_prompts(tok, [], (1024,), per_bucket=1, max_positions=4096, max_tokens=32, kinds=("chat",))


def test_config_keys(root):
    from eaglenest.recipe import load_recipe

    assert EvaluateConfig().bucket_material == ("records", "code", "recall", "chat")
    # The long-context recipe: a measurement in every bucket, on the demo's own draft and store.
    long, toy = load_recipe(root / "recipes" / "long_eval.yaml"), load_recipe(root / "recipes" / "toy.yaml")
    assert long.evaluate.bucket_prompts >= MIN_BUCKET_PROMPTS and len(long.evaluate.context_buckets) == 6
    assert (long.run, long.ingest, long.train) == (toy.run, toy.ingest, toy.train)
    with pytest.raises(ConfigError, match="evaluate.bucket_material"):
        EvaluateConfig(bucket_material=("records", "records"))
    with pytest.raises(ConfigError, match="evaluate.bootstrap_resamples"):
        EvaluateConfig(bootstrap_resamples=10)
    with pytest.raises(ConfigError, match="evaluate.far_context_keep_tokens"):
        EvaluateConfig(far_context_probe_tokens=0)
