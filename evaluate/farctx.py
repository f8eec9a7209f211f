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

The continuation's first tokens are mostly the answer's template ("The code of record 51234 is"),
which the question near the end already gives, so that measure reads ~0 even for a target that
does fetch the value from far back. The **answer-value** measure (``answer_probes``) closes that
gap on the generated material (records / code / recall): the reference answer is teacher-forced
after the whole prompt and after its last ``keep_tokens`` tokens, and only the tokens of the part
that only the evidence supplies (``LongPrompt.answer_value``: the record's value, the helper's
name, the stated fact) are scored. A target that reads the evidence gives those tokens a high
probability with the far part and a low one without it. Cost: the short context's prefill, and one
request per scored answer token after the whole prompt that reads the prompt from vLLM's prefix
cache (``prefix_probs``: the no-speculation pass has just decoded it), so a 32K prompt is not
prefilled a second time.
"""

from __future__ import annotations

import logging
import math

from eaglenest.errors import ConfigError

log = logging.getLogger(__name__)

MEASURE = ("mean probability the target gives the first {probe} tokens of its own greedy continuation, "
           "with the whole prompt (kept) and with only the prompt's last {keep} tokens (far removed)")
ANSWER_MEASURE = ("mean probability of the reference answer's value tokens (the part only the far evidence "
                  "supplies), teacher-forced after the whole prompt (kept) and after its last {keep} tokens "
                  "(far removed)")


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


def value_mask(tok, answer: str, value: str) -> tuple[list[int], list[int]]:
    """The answer's token ids (no special tokens) and a 0/1 mask of the tokens that overlap the last
    occurrence of ``value`` in it (character offsets of a fast tokenizer)."""
    at = answer.rfind(value) if value else -1
    if at < 0:
        raise ConfigError(f"evaluate.farctx: answer value {value!r} is not in the answer {answer!r}")
    enc = tok(answer, add_special_tokens=False, return_offsets_mapping=True)
    end = at + len(value)
    mask = [int(a < end and b > at) for a, b in enc["offset_mapping"]]
    return list(enc["input_ids"]), mask


def answer_probes(bucket_prompts: dict, tok, *, keep_tokens: int, bos_id: int | None,
                  max_len: int | None = None, unscored: dict[str, str] | None = None) -> list[dict]:
    """One row per prompt longer than ``keep_tokens`` with a reference answer and its value: the
    answer's ids up to its value's last token, the value-token mask and the two contexts (whole
    prompt, last ``keep_tokens``). A prompt whose whole context and answer exceed ``max_len`` (the
    engine's) is left out with a warning, and why goes into ``unscored`` ({sample_id: reason}) for
    the report."""
    rows = []
    for prompts in bucket_prompts.values():
        for p in prompts:
            ids = p["prompt_token_ids"]
            if not p.get("answer_value") or not p.get("answer") or len(ids) <= keep_tokens:
                continue
            answer, mask = value_mask(tok, p["answer"], p["answer_value"])
            end = max(i for i, m in enumerate(mask) if m) + 1  # what follows the value is not scored
            answer, mask = answer[:end], mask[:end]
            if max_len is not None and len(ids) + len(answer) > max_len:
                why = (f"its answer's {len(answer)} tokens do not fit the engine's {max_len} positions after its "
                       f"{len(ids)} prompt tokens")
                log.warning("far context: %s: %s; its value is not scored", p["sample_id"], why)
                if unscored is not None:
                    unscored[p["sample_id"]] = why
                continue
            rows.append({"sample_id": p["sample_id"], "answer_ids": answer, "mask": mask,
                         "contexts": (list(ids), far_prompt(ids, keep_tokens, bos_id))})
    return rows


def continuation_probs(llm, pairs: list[tuple[list[int], list[int]]]) -> list[list[float]]:
    """The probability of each continuation token after its context, for ``(context, continuation)``
    pairs: one prefill each, vLLM ``prompt_logprobs``."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    if not pairs:
        return []
    sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([TokensPrompt(prompt_token_ids=c + t) for c, t in pairs], sp, use_tqdm=False)
    res = []
    for (_, cont), o in zip(pairs, outs):
        lps = list(o.prompt_logprobs or [])[-len(cont):]
        res.append([math.exp(lp[t].logprob) for t, lp in zip(cont, lps)])
    return res


def prefix_probs(llm, pairs: list[tuple[list[int], list[int]]]) -> list[list[float]]:
    """The probability of each continuation token after its context, like ``continuation_probs``, for
    contexts the engine has just decoded: one request per continuation token (the context and the
    tokens before it), each returning the log-probability of exactly that token (vLLM's
    ``logprob_token_ids``). The context's KV is read from the prefix cache (whole blocks; the rest,
    under a block plus the continuation, is computed), where ``prompt_logprobs`` would prefill the whole
    context again. A context no longer cached is prefilled once by its first request, its others
    reading it after (the scheduler takes them in order). An engine without prefix caching (some
    hybrid models) gets ``continuation_probs`` instead: one prefill per pair, not one per token."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    if not prefix_caching(llm):
        return continuation_probs(llm, pairs)
    prompts, params = [], []
    for ctx, cont in pairs:
        for i, t in enumerate(cont):
            prompts.append(TokensPrompt(prompt_token_ids=list(ctx) + list(cont[:i])))
            params.append(SamplingParams(temperature=0.0, max_tokens=1, logprob_token_ids=[t], detokenize=False))
    if not prompts:
        return [[] for _ in pairs]
    outs = iter(llm.generate(prompts, params, use_tqdm=False))
    return [[math.exp(next(outs).outputs[0].logprobs[0][t].logprob) for t in cont] for _, cont in pairs]


def prefix_caching(llm) -> bool:
    """Whether ``llm`` (a ``vllm.LLM``) caches prompt prefixes (an engine that does not say is taken to)."""
    cache = getattr(getattr(getattr(llm, "llm_engine", None), "vllm_config", None), "cache_config", None)
    return bool(getattr(cache, "enable_prefix_caching", True))


def score(llm, rows: list[dict]) -> None:
    """Fill each row's ``removed``: the probability of each continuation token after the short context
    (one prefill per row, vLLM ``prompt_logprobs``)."""
    pairs = [(r["prompt_token_ids"][:-len(r["continuation"])], r["continuation"]) for r in rows]
    for r, probs in zip(rows, continuation_probs(llm, pairs)):
        r["removed"] = probs


def score_answers(llm, rows: list[dict]) -> None:
    """Fill each answer row's ``kept`` (after the whole prompt, read from the prefix cache:
    ``prefix_probs``) and ``removed`` (after the short context: one prefill of it)."""
    kept = prefix_probs(llm, [(r["contexts"][0], r["answer_ids"]) for r in rows])
    removed = continuation_probs(llm, [(r["contexts"][1], r["answer_ids"]) for r in rows])
    for r, k, m in zip(rows, kept, removed):
        r["kept"], r["removed"] = k, m


def answer_sums(rows: list[dict]) -> dict[str, dict]:
    """``{sample_id: {answer_kept_sum, answer_removed_sum, answer_tokens}}`` over the value tokens."""
    out = {}
    for r in rows:
        if "removed" not in r:
            continue
        on = [i for i, m in enumerate(r["mask"]) if m]
        out[r["sample_id"]] = {"answer_kept_sum": round(sum(r["kept"][i] for i in on), 6),
                               "answer_removed_sum": round(sum(r["removed"][i] for i in on), 6),
                               "answer_tokens": len(on)}
    return out


def per_prompt_sums(rows: list[dict]) -> dict[str, dict]:
    """``{sample_id: {far_kept_sum, far_removed_sum, far_tokens}}`` of scored rows."""
    return {r["sample_id"]: {"far_kept_sum": round(sum(r["kept"]), 6), "far_removed_sum": round(sum(r["removed"]), 6),
                             "far_tokens": len(r["continuation"])}
            for r in rows if "removed" in r}


def measure(llm, bucket_prompts: dict, outputs: dict, probs: dict, *, keep_tokens: int, probe_tokens: int,
            bos_id: int | None, answers: list[dict] | None = None) -> dict[str, dict]:
    """Score every bucket prompt's continuation with the far part removed; per-prompt sums, with those
    of ``answers`` (rows ``score_answers`` filled, each bucket's right after its decode)."""
    rows = probes(bucket_prompts, outputs, probs, keep_tokens=keep_tokens, probe_tokens=probe_tokens, bos_id=bos_id)
    score(llm, rows)
    out = per_prompt_sums(rows)
    for sid, sums in answer_sums(answers or []).items():
        out.setdefault(sid, {}).update(sums)
    return out


def summary(rows: list[dict], *, keep_tokens: int, probe_tokens: int) -> dict:
    """A bucket's figures from its ``per_prompt`` rows: both confidences, their ratio and difference."""
    scored = [r for r in rows if r.get("far_tokens")]
    out = {"keep_tokens": keep_tokens, "probe_tokens": probe_tokens, "prompts": len(scored)}
    if not scored:
        return {**out, "confidence_kept": None, "confidence_far_removed": None, "ratio": None, "difference": None,
                "note": f"no prompt longer than {keep_tokens} tokens with output to probe", **answer_summary(rows)}
    n = sum(r["far_tokens"] for r in scored)
    kept = sum(r["far_kept_sum"] for r in scored) / n
    removed = sum(r["far_removed_sum"] for r in scored) / n
    return {**out, "confidence_kept": round(kept, 4), "confidence_far_removed": round(removed, 4),
            "ratio": round(removed / kept, 4) if kept else None, "difference": round(kept - removed, 4),
            **answer_summary(rows)}


def answer_summary(rows: list[dict]) -> dict:
    """The answer-value figures of a bucket's ``per_prompt`` rows (empty when none was scored or left
    out); ``answers_unscored``: the prompts whose answer had no room after them (``answer_unscored``)."""
    scored = [r for r in rows if r.get("answer_tokens")]
    unscored = [r["sample_id"] for r in rows if r.get("answer_unscored")]
    out = {"answers_unscored": unscored} if unscored else {}
    if not scored:
        return out
    n = sum(r["answer_tokens"] for r in scored)
    kept = sum(r["answer_kept_sum"] for r in scored) / n
    removed = sum(r["answer_removed_sum"] for r in scored) / n
    return {"answer_prompts": len(scored), "answer_value_kept": round(kept, 4),
            "answer_value_removed": round(removed, 4), "answer_value_difference": round(kept - removed, 4), **out}


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
    out = {"far_context": MEASURE.format(probe=probe_tokens, keep=keep_tokens)}
    if any(r.get("answer_tokens") for row in (report.get("context_buckets") or {}).values()
           for r in row.get("per_prompt") or []):
        out["far_context_answers"] = ANSWER_MEASURE.format(keep=keep_tokens)
    return out
