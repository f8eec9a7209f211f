"""How much the target uses far context: its confidence with the far part of a prompt removed vs kept.

For each context-bucket prompt longer than ``keep_tokens``, the target's own greedy continuation
(the first ``probe_tokens`` output tokens of the no-speculation pass) is scored twice:

- **kept**: with the whole prompt; the probabilities that decode already returned (vLLM's
  log-probability of each sampled token, at temperature 0 the top-1 probability);
- **far removed**: with only the prompt's last ``keep_tokens`` tokens (after its BOS token when it
  starts with one), the continuation teacher-forced after them: one extra prefill of
  ``keep_tokens + probe_tokens`` tokens on the same engine, read with vLLM's ``prompt_logprobs``.

A target that uses far context is less sure of its continuation without it: ``difference`` =
kept - removed > 0 and ``ratio`` = removed / kept < 1. On ``chat`` material (unrelated chats) the
answer needs nothing far back, so the two should agree there; on records / code / recall they
should not. Trade-off: the continuation scored is the target's own, right or wrong, so this says
whether the far part changes the target's output, not whether the target answers correctly
(``answer_found`` in the per-prompt rows says that). The cost stays bounded by the probe length.
"""

from __future__ import annotations

import math

MEASURE = ("mean probability the target gives the first {probe} tokens of its own greedy continuation, "
           "with the whole prompt (kept) and with only the prompt's last {keep} tokens (far removed)")


def far_prompt(ids: list[int], keep_tokens: int, bos_id: int | None) -> list[int]:
    """The last ``keep_tokens`` tokens of ``ids``, the BOS token first when ``ids`` starts with it."""
    if len(ids) <= keep_tokens:
        return list(ids)
    if bos_id is not None and ids[:1] == [bos_id]:
        return ids[:1] + ids[len(ids) - (keep_tokens - 1):]
    return ids[len(ids) - keep_tokens:]


def probes(bucket_prompts: dict, outputs: dict, probs: dict, *, keep_tokens: int, probe_tokens: int,
           bos_id: int | None) -> list[dict]:
    """One request per prompt longer than ``keep_tokens`` with output: the short context followed by
    the continuation, and the kept-context probabilities of that continuation."""
    rows = []
    for prompts in bucket_prompts.values():
        for p in prompts:
            ids, out = p["prompt_token_ids"], list(outputs.get(p["sample_id"]) or [])[:probe_tokens]
            kept = list(probs.get(p["sample_id"]) or [])[:len(out)]
            if len(ids) <= keep_tokens or not out or len(kept) != len(out):
                continue
            rows.append({"sample_id": p["sample_id"], "prompt_token_ids": far_prompt(ids, keep_tokens, bos_id) + out,
                         "continuation": out, "kept": kept})
    return rows


def score(llm, rows: list[dict]) -> None:
    """Fill each row's ``removed``: the probability of each continuation token after the short context
    (one prefill per row, vLLM ``prompt_logprobs``)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    if not rows:
        return
    sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in rows], sp, use_tqdm=False)
    for r, o in zip(rows, outs):
        lps = list(o.prompt_logprobs or [])[-len(r["continuation"]):]
        r["removed"] = [math.exp(lp[t].logprob) for t, lp in zip(r["continuation"], lps)]


def per_prompt_sums(rows: list[dict]) -> dict[str, dict]:
    """``{sample_id: {far_kept_sum, far_removed_sum, far_tokens}}`` of scored rows."""
    return {r["sample_id"]: {"far_kept_sum": round(sum(r["kept"]), 6), "far_removed_sum": round(sum(r["removed"]), 6),
                             "far_tokens": len(r["continuation"])}
            for r in rows if "removed" in r}


def measure(llm, bucket_prompts: dict, outputs: dict, probs: dict, *, keep_tokens: int, probe_tokens: int,
            bos_id: int | None) -> dict[str, dict]:
    """Score every bucket prompt's continuation with the far part removed; per-prompt sums."""
    rows = probes(bucket_prompts, outputs, probs, keep_tokens=keep_tokens, probe_tokens=probe_tokens, bos_id=bos_id)
    score(llm, rows)
    return per_prompt_sums(rows)


def summary(rows: list[dict], *, keep_tokens: int, probe_tokens: int) -> dict:
    """A bucket's figures from its ``per_prompt`` rows: both confidences, their ratio and difference."""
    scored = [r for r in rows if r.get("far_tokens")]
    out = {"keep_tokens": keep_tokens, "probe_tokens": probe_tokens, "prompts": len(scored)}
    if not scored:
        return {**out, "confidence_kept": None, "confidence_far_removed": None, "ratio": None, "difference": None,
                "note": f"no prompt longer than {keep_tokens} tokens with output to probe"}
    n = sum(r["far_tokens"] for r in scored)
    kept = sum(r["far_kept_sum"] for r in scored) / n
    removed = sum(r["far_removed_sum"] for r in scored) / n
    return {**out, "confidence_kept": round(kept, 4), "confidence_far_removed": round(removed, 4),
            "ratio": round(removed / kept, 4) if kept else None, "difference": round(kept - removed, 4)}


def add_to_report(report: dict, far: dict[str, dict], *, keep_tokens: int, probe_tokens: int, measured: bool) -> dict:
    """Merge per-prompt sums into the buckets' ``per_prompt`` rows and put each bucket's
    ``far_context`` summary; returns what ``report["predictability"]`` says of the measure."""
    if not keep_tokens:
        return {"far_context_skipped": "evaluate.far_context_keep_tokens=0"}
    if not measured:
        return {"far_context_skipped": "needs the no-speculation pass (evaluate.check_lossless=true)"}
    for row in (report.get("context_buckets") or {}).values():
        rows = row.get("per_prompt") or []
        for r in rows:
            r.update(far.get(r["sample_id"], {}))
        row["far_context"] = summary(rows, keep_tokens=keep_tokens, probe_tokens=probe_tokens)
    return {"far_context": MEASURE.format(probe=probe_tokens, keep=keep_tokens)}
