"""The far-context measure (``evaluate.farctx``): which contexts are scored, how the figures are
summed, and, on the tiny target, that removing what a copy task needs lowers the confidence.

The vLLM side (``prompt_logprobs`` on the lossless check's engine) runs in ``test_vllm.py``."""

from __future__ import annotations

import json

import pytest

from eaglenest.evaluate.farctx import add_to_report, far_prompt, per_prompt_sums, probes, summary


def test_far_prompt_keeps_bos_and_the_last_tokens():
    ids = [1] + list(range(10, 30))
    assert far_prompt(ids, 4, bos_id=1) == [1, 27, 28, 29]  # BOS + the last 3: 4 tokens in all
    assert far_prompt(ids[1:], 4, bos_id=1) == [26, 27, 28, 29]  # no BOS to keep
    assert far_prompt(ids, 4, bos_id=None) == [26, 27, 28, 29]
    assert far_prompt(ids[:3], 4, bos_id=1) == ids[:3]  # already short: unchanged


def test_probes_score_the_kept_continuation_after_the_short_context():
    long_p = {"sample_id": "a", "prompt_token_ids": [1] + list(range(100, 140))}
    short_p = {"sample_id": "b", "prompt_token_ids": [1, 5, 6]}  # not longer than keep: nothing is far
    silent = {"sample_id": "c", "prompt_token_ids": [1] + list(range(40))}  # no output to score
    outputs = {"a": [7, 8, 9, 10, 11], "b": [7], "c": []}
    probs = {"a": [0.9, 0.8, 0.7, 0.6, 0.5], "b": [0.9], "c": []}
    rows = probes({64: [long_p, short_p, silent]}, outputs, probs, keep_tokens=8, probe_tokens=3, bos_id=1)
    assert [r["sample_id"] for r in rows] == ["a"]
    (r,) = rows
    assert r["continuation"] == [7, 8, 9] and r["kept"] == [0.9, 0.8, 0.7]  # the first probe_tokens
    assert r["prompt_token_ids"] == [1, *range(133, 140), 7, 8, 9]  # 8 context tokens, then the continuation
    r["removed"] = [0.3, 0.2, 0.1]
    assert per_prompt_sums(rows) == {"a": {"far_kept_sum": 2.4, "far_removed_sum": 0.6, "far_tokens": 3}}


def test_summary_and_report_fields():
    rows = [{"sample_id": "a", "far_kept_sum": 2.4, "far_removed_sum": 0.6, "far_tokens": 3},
            {"sample_id": "b", "far_kept_sum": 0.9, "far_removed_sum": 0.9, "far_tokens": 1},
            {"sample_id": "c"}]  # not probed (short)
    s = summary(rows, keep_tokens=8, probe_tokens=3)
    assert s["prompts"] == 2 and s["confidence_kept"] == pytest.approx(3.3 / 4)
    assert s["confidence_far_removed"] == pytest.approx(1.5 / 4)
    assert s["ratio"] == pytest.approx(round(1.5 / 3.3, 4)) and s["difference"] == pytest.approx(0.45)
    assert summary([{"sample_id": "c"}], keep_tokens=8, probe_tokens=3)["note"].startswith("no prompt longer")

    report = {"context_buckets": {"64": {"per_prompt": [{"sample_id": "a"}, {"sample_id": "c"}]}}}
    pred = add_to_report(report, {"a": rows[0]}, keep_tokens=8, probe_tokens=3, measured=True)
    assert "last 8 tokens" in pred["far_context"]
    bucket = report["context_buckets"]["64"]
    assert bucket["per_prompt"][0]["far_tokens"] == 3 and bucket["far_context"]["difference"] == pytest.approx(0.6)
    assert "keep_tokens=0" in add_to_report(report, {}, keep_tokens=0, probe_tokens=3, measured=True)["far_context_skipped"]
    assert "check_lossless" in add_to_report(report, {}, keep_tokens=8, probe_tokens=3,
                                             measured=False)["far_context_skipped"]


def test_tiny_target_loses_confidence_without_what_it_copies(tiny_target, root):
    """A copy task the tiny target learned (a JSON record of the values named in the prompt): its
    own greedy continuation, scored by a plain transformers forward with the whole prompt and with
    only the prompt's last 6 tokens (the chat template's tail: the values are gone). The measure's
    mechanics are those of ``probes``; the difference must be clearly positive on every prompt."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_target)
    model = AutoModelForCausalLM.from_pretrained(tiny_target).eval()
    lines = (root / "recipes" / "data" / "records.jsonl").read_text().splitlines()[:4]

    kept, removed = [], []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: one thread is far faster on a busy 2-core machine
    try:
        rows = [_copy_row(tok, model, json.loads(line)["prompt"]) for line in lines]
    finally:
        torch.set_num_threads(threads)
    for ids, row in rows:
        short = row["prompt_token_ids"][:-len(row["continuation"])]
        assert len(short) == 6 and short[0] == tok.bos_token_id and short[1:] == ids[-5:]
        kept.append(sum(row["kept"]) / len(row["kept"]))
        removed.append(sum(row["removed"]) / len(row["removed"]))
    assert all(k > r + 0.03 for k, r in zip(kept, removed)), (kept, removed)
    assert sum(kept) / 4 - sum(removed) / 4 > 0.08, (kept, removed)


def _probs(model, ids, cont):
    """Probability of each ``cont`` token after ``ids`` (one teacher-forced forward)."""
    import torch

    with torch.no_grad():
        logp = model(torch.tensor([ids + cont])).logits[0].float().log_softmax(-1)
    return [logp[len(ids) - 1 + i, t].exp().item() for i, t in enumerate(cont)]


def _copy_row(tok, model, prompt: str):
    """(prompt ids, probe row with ``removed`` scored) for one records prompt, keep_tokens=6."""
    import torch

    text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids):].tolist()
    (row,) = probes({0: [{"sample_id": "x", "prompt_token_ids": ids}]}, {"x": out}, {"x": _probs(model, ids, out)},
                    keep_tokens=6, probe_tokens=12, bos_id=tok.bos_token_id)
    row["removed"] = _probs(model, row["prompt_token_ids"][:-len(out)], out)
    return ids, row
