"""The far-context measure (``evaluate.farctx``): which contexts are scored, how the figures are
summed, and, on the tiny target, that removing what a copy task needs lowers the confidence.

The vLLM side (the lossless check's engine) runs in ``test_vllm.py``; ``prefix_probs`` against a
``prompt_logprobs`` prefill runs here."""

from __future__ import annotations

import json

import pytest

from eaglenest.errors import ConfigError
from eaglenest.evaluate.farctx import (add_to_report, answer_probes, answer_sums, far_prompt, per_prompt_sums,
                                       probes, summary, value_mask)
from eaglenest.evaluate.intervals import bucket_intervals


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


@pytest.mark.parametrize("answer, value", [("The code of record 51234 is 4821.", "4821"),
                                           ("print(merge_items_512(7))", "merge_items_512"),
                                           ("Your favourite colour is dark green.", "dark green")])
def test_value_mask_marks_the_value_tokens_only(tiny_target, answer, value):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_target)
    ids, mask = value_mask(tok, answer, value)
    assert ids == tok(answer, add_special_tokens=False)["input_ids"] and len(mask) == len(ids)
    on = [t for t, m in zip(ids, mask) if m]
    assert on and value in tok.decode(on)  # the marked tokens spell the value ...
    off = tok.decode([t for t, m in zip(ids, mask) if not m])
    assert value not in off and len(tok.decode(on)) < len(answer)  # ... and the template is not marked
    with pytest.raises(ConfigError, match="not in the answer"):
        value_mask(tok, answer, "absent")


def test_answer_probes_pair_the_whole_and_the_short_context(tiny_target):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_target)
    ids = [tok.bos_token_id] + list(range(100, 140))
    prompts = [{"sample_id": "a", "prompt_token_ids": ids, "answer": "The code of record 1 is 42.", "answer_value": "42"},
               {"sample_id": "chat", "prompt_token_ids": ids, "answer": None, "answer_value": None},
               {"sample_id": "short", "prompt_token_ids": ids[:5], "answer": "Your pet is Rex.", "answer_value": "Rex"}]
    (r,) = answer_probes({64: prompts}, tok, keep_tokens=8, bos_id=tok.bos_token_id)
    assert r["sample_id"] == "a" and r["contexts"] == (ids, [tok.bos_token_id, *range(133, 140)])
    assert sum(r["mask"]) >= 1 and len(r["mask"]) == len(r["answer_ids"]) and r["mask"][-1] == 1  # ends at the value
    assert answer_probes({64: prompts}, tok, keep_tokens=8, bos_id=None, max_len=len(ids) + 2) == []  # no room
    r["kept"] = [0.5] * len(r["mask"])
    r["kept"][r["mask"].index(1)] = 0.9
    r["removed"] = [0.5] * len(r["mask"])
    r["removed"][r["mask"].index(1)] = 0.1
    sums = answer_sums([r])["a"]  # only the value's tokens count: the template's 0.5s do not
    n = sum(r["mask"])
    assert sums["answer_tokens"] == n
    assert sums["answer_kept_sum"] == pytest.approx(0.9 + 0.5 * (n - 1))
    assert sums["answer_removed_sum"] == pytest.approx(0.1 + 0.5 * (n - 1))


def test_answer_value_summary_and_paired_interval():
    rows = [{"sample_id": "a", "far_kept_sum": 1.0, "far_removed_sum": 1.0, "far_tokens": 2,
             "answer_kept_sum": 1.8, "answer_removed_sum": 0.2, "answer_tokens": 2},
            {"sample_id": "b", "far_kept_sum": 1.0, "far_removed_sum": 0.9, "far_tokens": 2,
             "answer_kept_sum": 0.9, "answer_removed_sum": 0.3, "answer_tokens": 1},
            {"sample_id": "chat", "far_kept_sum": 1.0, "far_removed_sum": 1.0, "far_tokens": 2}]
    s = summary(rows, keep_tokens=8, probe_tokens=2)
    assert s["answer_prompts"] == 2 and s["answer_value_kept"] == pytest.approx(0.9)
    assert s["answer_value_removed"] == pytest.approx(round(0.5 / 3, 4))
    assert s["answer_value_difference"] == pytest.approx(round(2.2 / 3, 4), abs=1e-4)
    assert "answer_prompts" not in summary(rows[2:], keep_tokens=8, probe_tokens=2)
    iv = bucket_intervals(rows, resamples=200, seed=0)
    lo, hi = iv["answer_value_difference"]  # over the two answered prompts: both differences are large
    assert 0.59 <= lo <= hi <= 0.81, iv
    report = {"context_buckets": {"64": {"per_prompt": [{"sample_id": "a"}]}}}
    pred = add_to_report(report, {"a": rows[0]}, keep_tokens=8, probe_tokens=2, measured=True)
    assert "value tokens" in pred["far_context_answers"]
    assert report["context_buckets"]["64"]["far_context"]["answer_value_difference"] == pytest.approx(0.8)


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


@pytest.mark.slow
def test_prefix_probs_equal_a_prompt_logprobs_prefill(tiny_target):
    """The cached path (one request per answer token over the decoded prompt's cached blocks) gives the
    same probabilities as a ``prompt_logprobs`` prefill of the whole context, for a context just
    decoded, one never seen (cold cache), and a continuation that is the target's own output (its
    blocks cached by the decode too)."""
    import random

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from eaglenest.engine import EngineConfig, close_llm, make_llm
    from eaglenest.evaluate.farctx import continuation_probs, prefix_caching, prefix_probs

    llm = make_llm(str(tiny_target), EngineConfig(max_model_len=512, max_num_seqs=8, memory_fraction=0.1))
    try:
        rng = random.Random(0)
        ctxs = [[1] + [rng.randrange(3, 500) for _ in range(n)] for n in (255, 300)]  # 256: whole blocks
        out = llm.generate([TokensPrompt(prompt_token_ids=ctxs[0])],
                           SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), use_tqdm=False)
        own = list(out[0].outputs[0].token_ids)
        pairs = [(ctxs[0], own[:35]), (ctxs[0], [7, 8, 9] + own[:20]), (ctxs[1], own[:12]), (ctxs[1], [])]
        cached = prefix_probs(llm, pairs)
        full = continuation_probs(llm, pairs[:3]) + [[]]
        assert [len(c) for c in cached] == [len(c) for _, c in pairs] == [len(f) for f in full]
        for a, b in zip(cached, full):
            assert a == pytest.approx(b, abs=1e-4)
        assert max(cached[0]) > 0.5 and min(cached[1][:3]) < 0.5  # the own output is likely, the foreign not
        assert prefix_probs(llm, []) == []
        assert prefix_caching(llm)
    finally:
        close_llm(llm)
    # Without prefix caching each token's request would prefill the whole context: one prefill per pair.
    llm = make_llm(str(tiny_target), EngineConfig(max_model_len=512, max_num_seqs=8, memory_fraction=0.1),
                   enable_prefix_caching=False)
    try:
        assert not prefix_caching(llm)
        uncached = prefix_probs(llm, pairs)
        assert [len(u) for u in uncached] == [len(c) for c in cached]  # zip alone would pass on a short list
        for a, b in zip(uncached, cached):
            assert a == pytest.approx(b, abs=1e-4)
    finally:
        close_llm(llm)
