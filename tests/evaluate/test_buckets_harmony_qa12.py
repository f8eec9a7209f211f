"""``chat`` bucket prompts of a harmony-format target (gpt-oss): each earlier answer in the history is its
``final`` channel, as gpt-oss's template renders an earlier turn, not the channels run together."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from eaglenest.evaluate.buckets import build_bucket_prompts, heldout_material
from eaglenest.hf import load_tokenizer

INGEST_TESTS = str(Path(__file__).resolve().parents[1] / "ingest")
if INGEST_TESTS not in sys.path:  # the ingest tests' helpers: the offline harmony-format target
    sys.path.insert(0, INGEST_TESTS)

from ingest_helpers import harmony_target  # noqa: E402

QUESTIONS = ["What is 2 + 2?", "Name a colour.", "Say hello.", "Count to three."]


def _pool_and_outputs(tok):
    """Held-out prompts and the target's answers to them (token ids), each with an analysis and a final channel."""
    pool = [{"sample_id": f"h-{k}", "messages": [{"role": "user", "content": q}]} for k, q in enumerate(QUESTIONS)]
    outputs = {p["sample_id"]: tok(f"<|channel|>analysis<|message|>Ponder item {k} slowly.<|end|>"
                                   f"<|start|>assistant<|channel|>final<|message|>Answer {k}.<|return|>",
                                   add_special_tokens=False)["input_ids"] for k, p in enumerate(pool)}
    return pool, outputs


@pytest.mark.parametrize("special", [True, False], ids=["special tokens", "plain-text tags"])
def test_chat_bucket_history_of_a_harmony_target_holds_final_channels(tmp_path, tiny_target, special):
    # The material was each answer decoded with its special tokens skipped: "analysisPonder item 0
    # slowly.assistantfinalAnswer 0.", rendered into the bucket's history as one final channel (the target
    # asked to continue a conversation it never had); with plain-text tags the content held channel tags,
    # which gpt-oss's template refuses (the evaluation stopped with a Jinja error).
    root = harmony_target(tmp_path, tiny_target, special=special)
    tok = load_tokenizer(root, trust_remote_code=False)
    pool, outputs = _pool_and_outputs(tok)
    material = heldout_material(tok, pool, outputs, target=str(root))
    assert material == [(p["messages"], f"Answer {k}.") for k, p in enumerate(pool)]
    (prompt,) = build_bucket_prompts(tok, material, (200,), per_bucket=1, max_positions=4096, max_tokens=16,
                                     kinds=("chat",))[200]
    text = tok.decode(prompt["prompt_token_ids"], skip_special_tokens=False)
    assert len(prompt["prompt_token_ids"]) == 200
    assert "Ponder" not in text and "analysis" not in text and "assistantfinal" not in text, text
    finals = [k for k in range(len(QUESTIONS)) if f"<|channel|>final<|message|>Answer {k}.<|end|>" in text]
    assert len(finals) >= 2, text  # earlier turns are in the history, each as its final channel


def test_a_target_without_channels_keeps_its_answers_as_decoded(tiny_target):
    tok = load_tokenizer(tiny_target, trust_remote_code=False)
    pool = [{"sample_id": "p-0", "messages": [{"role": "user", "content": "Hi."}]}]
    ids = tok("A plain answer, no channels.", add_special_tokens=False)["input_ids"]
    assert heldout_material(tok, pool, {"p-0": ids}, target=str(tiny_target)) == [
        (pool[0]["messages"], tok.decode(ids, skip_special_tokens=True))]
    assert heldout_material(tok, [], {}, target=str(tiny_target)) == []


def test_evaluate_builds_its_chat_buckets_from_final_channels(tmp_path, tiny_target):
    """What ``evaluate al`` builds its buckets with (``run._bucket_prompts``, held-out answers: no engine)."""
    import dataclasses

    from eaglenest.evaluate import run
    from eaglenest.evaluate.config import EvaluateConfig

    root = harmony_target(tmp_path, tiny_target)
    tok = load_tokenizer(root, trust_remote_code=False)
    pool, outputs = _pool_and_outputs(tok)
    cfg = dataclasses.replace(EvaluateConfig(), context_buckets=(200,), bucket_material=("chat",), bucket_prompts=1,
                              bucket_max_tokens=16)
    (prompt,) = run._bucket_prompts(None, tok, pool, outputs, cfg, 4096, target=str(root))[200]
    text = tok.decode(prompt["prompt_token_ids"], skip_special_tokens=False)
    assert "Ponder" not in text and "<|channel|>final<|message|>Answer" in text, text
