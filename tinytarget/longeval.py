"""Measure a target on the long-context buckets the way ``evaluate al`` does, with transformers.

Per bucket (1K .. 32K): the prompts of ``evaluate.buckets.build_bucket_prompts`` (same seeds as
``evaluate al`` with ``engine.seed=0``, so the figures describe the material the evaluation uses),
each decoded greedily for up to ``max_new_tokens`` tokens with a KV cache:

- ``target_confidence``: the mean probability of the target's own output tokens (its top-1
  probability), pooled over the bucket's prompts, as ``evaluate.run.predictability`` pools it;
- ``answer_found``: how many outputs hold the material's reference answer (``bucket_rows``' rule);
- ``far_context``: ``evaluate.farctx``'s measures: the first ``probe_tokens`` output tokens scored
  again after only the prompt's last ``keep_tokens`` tokens (``probes`` / ``summary``), and the
  reference answer's value tokens after the whole prompt and after its last ``keep_tokens`` tokens
  (``answer_probes``: ``answer_value_kept`` / ``answer_value_removed``);
- ``intervals``: ``evaluate.intervals.bucket_intervals`` over the bucket's prompts.

Trade-off: a plain transformers forward instead of a vLLM engine, so the build needs no engine and
the numbers can sit in the model card; the ``chat`` material is the corpus' held-out chats with
their reference answers, where ``evaluate al`` uses the store's held-out chats and the target's
own answers.
"""

from __future__ import annotations

import logging
import time

from eaglenest.evaluate import farctx
from eaglenest.evaluate.buckets import bucket_rows, build_bucket_prompts
from eaglenest.evaluate.intervals import bucket_intervals
from eaglenest.tinytarget import longdata

log = logging.getLogger(__name__)

BUCKETS = (1024, 2048, 4096, 8192, 16384, 32768)
KINDS = ("records", "code", "recall", "chat")
#: Output tokens decoded per prompt (a bucket's prompt leaves room for them within max_positions).
MAX_NEW_TOKENS = 64


def greedy(model, ids: list[int], *, max_new_tokens: int, eos_id: int, forced: list[int] | None = None
           ) -> tuple[list[int], list[float], list[float] | None]:
    """Greedy continuation of ``ids``, the probability of each output token (KV-cached decode) and,
    with ``forced``, the probability of each ``forced`` token teacher-forced after ``ids``, from
    the same prefill (its cache extended by ``forced``, then cropped back before decoding)."""
    import torch

    out_ids, probs, forced_probs = [], [], None
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), use_cache=True, logits_to_keep=1)
        if forced:
            cache = out.past_key_values
            tail = model(input_ids=torch.tensor([forced]), past_key_values=cache, use_cache=True).logits[0, :-1]
            p = torch.cat([out.logits[0, -1:], tail]).float().softmax(-1)
            forced_probs = [float(p[i, t]) for i, t in enumerate(forced)]
            cache.crop(len(ids))
        for _ in range(max_new_tokens):
            p = out.logits[0, -1].float().softmax(-1)
            t = int(p.argmax())
            out_ids.append(t)
            probs.append(float(p[t]))
            if t == eos_id:
                break
            out = model(input_ids=torch.tensor([[t]]), past_key_values=out.past_key_values, use_cache=True)
    return out_ids, probs, forced_probs


def continuation_probs(model, ids: list[int], cont: list[int]) -> list[float]:
    """Probability of each ``cont`` token after ``ids`` (one teacher-forced forward)."""
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids + cont]), logits_to_keep=len(cont) + 1).logits[0]
    p = logits[:-1].float().softmax(-1)
    return [float(p[i, t]) for i, t in enumerate(cont)]


def measure(model, hf_tok, material, *, buckets=BUCKETS, per_bucket: int = 4, kinds=KINDS, seed: int = 0,
            max_positions: int = 32768, max_new_tokens: int = MAX_NEW_TOKENS, keep_tokens: int = 512,
            probe_tokens: int = 8, resamples: int = 1000) -> dict[str, dict]:
    """``{bucket: figures}`` for ``model`` on the long-context buckets (see the module docstring)."""
    prompts = build_bucket_prompts(hf_tok, material, tuple(buckets), per_bucket=per_bucket, kinds=tuple(kinds),
                                   max_positions=max_positions, max_tokens=max_new_tokens, seed=seed)
    out: dict[str, dict] = {}
    for bucket, ps in prompts.items():
        t0 = time.perf_counter()
        toks, probs = {}, {}
        answers = {r["sample_id"]: r for r in farctx.answer_probes({bucket: ps}, hf_tok, keep_tokens=keep_tokens,
                                                                   bos_id=hf_tok.bos_token_id)}
        for p in ps:
            a = answers.get(p["sample_id"])
            toks[p["sample_id"]], probs[p["sample_id"]], kept = greedy(
                model, p["prompt_token_ids"], max_new_tokens=max_new_tokens, eos_id=hf_tok.eos_token_id,
                forced=a["answer_ids"] if a else None)
            if a:  # the whole prompt's answer probabilities from the decode's own prefill
                a["kept"] = kept
                a["removed"] = continuation_probs(model, a["contexts"][1], a["answer_ids"])
        far_rows = farctx.probes({bucket: ps}, toks, probs, keep_tokens=keep_tokens, probe_tokens=probe_tokens,
                                 bos_id=hf_tok.bos_token_id)
        for r in far_rows:
            n = len(r["continuation"])
            r["removed"] = continuation_probs(model, r["prompt_token_ids"][:-n], r["continuation"])
        far = farctx.per_prompt_sums(far_rows)
        for sid, sums in farctx.answer_sums(list(answers.values())).items():
            far.setdefault(sid, {}).update(sums)
        rows = bucket_rows(ps, [toks[p["sample_id"]] for p in ps], {}, hf_tok)
        for r in rows:
            vals = probs[r["sample_id"]]
            r.update(confidence_sum=round(sum(vals), 6), confidence_tokens=len(vals), **far.get(r["sample_id"], {}))
        out[str(bucket)] = _figures(rows, bucket=bucket, prompt_tokens=len(ps[0]["prompt_token_ids"]),
                                    keep_tokens=keep_tokens, probe_tokens=probe_tokens, resamples=resamples,
                                    seed=seed, seconds=time.perf_counter() - t0)
        fig = out[str(bucket)]
        log.info("bucket %d: confidence %.4f, answers %s, far %s, answer value %s -> %s (%.0f s)", bucket,
                 fig["target_confidence"], fig["answer_found"], fig["far_context"].get("difference"),
                 fig["far_context"].get("answer_value_kept"), fig["far_context"].get("answer_value_removed"),
                 fig["seconds"])
    return out


def _figures(rows: list[dict], *, bucket: int, prompt_tokens: int, keep_tokens: int, probe_tokens: int,
             resamples: int, seed: int, seconds: float) -> dict:
    conf = sum(r["confidence_sum"] for r in rows) / max(1, sum(r["confidence_tokens"] for r in rows))
    by_kind: dict[str, list[float]] = {}
    for r in rows:
        acc = by_kind.setdefault(r["material"], [0.0, 0])
        acc[0] += r["confidence_sum"]
        acc[1] += r["confidence_tokens"]
    judged = [r for r in rows if r["answer_found"] is not None]
    return {"prompt_tokens": prompt_tokens, "prompts": len(rows), "target_confidence": round(conf, 4),
            "confidence_by_material": {k: round(s / max(1, n), 4) for k, (s, n) in sorted(by_kind.items())},
            "answer_found": f"{sum(bool(r['answer_found']) for r in judged)}/{len(judged)}",
            "far_context": farctx.summary(rows, keep_tokens=keep_tokens, probe_tokens=probe_tokens),
            "intervals": bucket_intervals(rows, resamples=resamples, seed=f"{seed}:{bucket}"),
            "seconds": round(seconds, 1), "per_prompt": rows}


#: Held-out seeds of the copy probe's rows (training rows use longdata.TRAIN_SEED_BASE + row, far below).
COPY_PROBE_SEED = 3_000_000_000


def copy_probe(model, hf_tok, docs, *, lengths=(128, 512, 1024), rows: int = 4) -> dict[str, dict]:
    """Whether the model copies from its context at all: mean loss (nats per token) and top-1
    accuracy on the marked tokens of held-out ``repeat`` and ``copy`` rows (``longdata``) of each
    length. Uniform guessing over the vocabulary is ``ln(V)`` (7.6 here); a copy circuit drives both
    losses towards 0 and the accuracies towards 1."""
    import torch

    makers = {"repeat": lambda n, s: longdata.repeat_row(hf_tok, n, seed=s),
              "copy": lambda n, s: longdata.copy_row(hf_tok, n, seed=s, docs=docs)}
    out: dict[str, dict] = {}
    for kind, make in makers.items():
        for n in lengths:
            made = [make(n, COPY_PROBE_SEED + i) for i in range(rows)]
            ids = torch.tensor([m[0] for m in made])
            mask = torch.tensor([m[1] for m in made], dtype=torch.float32)[:, 1:]
            with torch.no_grad():
                logits = model(input_ids=ids).logits[:, :-1].float()
            ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                                   reduction="none").view_as(mask)
            hit = (logits.argmax(-1) == ids[:, 1:]).float()
            out.setdefault(kind, {})[str(n)] = {"loss": round(float((ce * mask).sum() / mask.sum()), 4),
                                                "accuracy": round(float((hit * mask).sum() / mask.sum()), 4)}
    return out


def ratio_to_first(figures: dict[str, dict]) -> dict[str, float]:
    """Each bucket's ``target_confidence`` over the shortest bucket's."""
    ordered = sorted(figures, key=int)
    first = figures[ordered[0]]["target_confidence"]
    return {b: round(figures[b]["target_confidence"] / first, 4) for b in ordered}
