"""``evaluate al``: serve target + draft with vLLM, decode prompt groups and context buckets, report AL.

One engine with the draft decodes each group in turn (a manifest domain, or an MT-Bench /
SPEED-Bench category), then one group per context bucket (1K .. 32K prompt tokens of long-range
material, see ``buckets``). Counter deltas give the pooled AL of a group; vLLM's
per-request spec-decode metrics give the per-request average. Optionally a second engine without
speculation decodes the same prompts so the report can state whether speculation was lossless
(token-for-token identical greedy output); it also scores the bucket prompts with their far part
removed (``farctx``). Buckets get 95% intervals over their prompts (``intervals``). Both engines
share one ``max_model_len`` that fits the longest bucket; at most one engine is alive at a time.

Held-out prompts are decoded in the mode ingest stored them in (chat through the template, raw as
completions); a group holding both decodes each mode on its own, so the report gives AL per mode
(``modes``, pooled over the groups) as well as per group: one more ``generate`` call per such group.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

from eaglenest.engine import close_llm, make_llm, speculative_config
from eaglenest.errors import EaglenestError
from eaglenest.evaluate import farctx, ngram
from eaglenest.evaluate.al import per_request_summary
from eaglenest.evaluate.buckets import (bucket_lengths, bucket_rows, build_bucket_prompts, heldout_material,
                                        merged_buckets)
from eaglenest.evaluate.intervals import add_intervals, per_prompt, spec_counts
from eaglenest.evaluate.plan import plan
from eaglenest.evaluate.prompts import heldout, mode_of
from eaglenest.evaluate.settings import with_draft_k
from eaglenest.featurestore.table import store
from eaglenest.hf import check_remote_code, load_tokenizer
from eaglenest.serve.draft_files import check_draft_dir, local_target_config
from eaglenest.specdecode import SpecCounters, read_counters

log = logging.getLogger(__name__)

AVERAGES = {
    "acceptance_length": "pooled over draft rounds: 1 + accepted / rounds, from vLLM's counters",
    "acceptance_length_per_request": "mean over requests of each request's AL, from vLLM's "
                                     "per-request spec-decode metrics",
}


def eval_prompts(store_uri: str, split: str, max_per_domain: int) -> dict[str, list[dict]]:
    """Held-out conversations to decode, grouped by domain, in a stable order."""
    groups = heldout(store_uri, split)
    if max_per_domain > 0:
        groups = {d: ps[:max_per_domain] for d, ps in groups.items()}
    return dict(sorted(groups.items()))


def _params(cfg, max_tokens: int, logprobs: int | None = None):
    from vllm import SamplingParams

    return SamplingParams(temperature=cfg.temperature, max_tokens=max_tokens, seed=0, logprobs=logprobs)


def _decode(llm, prompts: list[dict], cfg, *, max_tokens: int | None = None, logprobs: int | None = None) -> list:
    """Decode chat, raw (``raw_text``, tokenized by vLLM as ingest's raw requests were) or token-id
    prompts, mixed; returns vLLM RequestOutputs in prompt order."""
    from vllm.inputs import TokensPrompt

    sp = _params(cfg, max_tokens or cfg.max_tokens, logprobs)
    plain = [i for i, p in enumerate(prompts) if "prompt_token_ids" in p or "raw_text" in p]
    chat = sorted(set(range(len(prompts))) - set(plain))
    outs: dict[int, object] = {}
    if plain:
        got = llm.generate([TokensPrompt(prompt_token_ids=prompts[i]["prompt_token_ids"])
                            if "prompt_token_ids" in prompts[i] else prompts[i]["raw_text"] for i in plain], sp,
                           use_tqdm=False)
        outs.update(zip(plain, got))
    if chat:  # rendered by vLLM with the target's template and evaluate.chat_template_kwargs
        got = llm.chat([prompts[i]["messages"] for i in chat], sp, use_tqdm=False,
                       chat_template_kwargs=cfg.chat_template_kwargs or None)
        outs.update(zip(chat, got))
    return [outs[i] for i in range(len(prompts))]


def _measure(llm, prompts, cfg, *, max_tokens=None, prompt_ids: dict | None = None, per_request: dict | None = None,
             metrics: list | None = None) -> tuple[dict, list[list[int]], SpecCounters]:
    """One group's row (counter deltas, per-request averages), its outputs' token ids and its counter
    delta; ``metrics``, when given, gets each request's spec-decode metrics."""
    before = read_counters(llm)
    reqs = _decode(llm, prompts, cfg, max_tokens=max_tokens)
    delta = read_counters(llm) - before
    outs = [r.outputs[0] for r in reqs]
    toks = [list(o.token_ids) for o in outs]
    if prompt_ids is not None:
        prompt_ids.update({p["sample_id"]: list(r.prompt_token_ids or ()) for p, r in zip(prompts, reqs)})
    if per_request is not None:  # per prompt, what the row pools: draft rounds, accepted tokens, output tokens
        per_request.update({p["sample_id"]: {**spec_counts(getattr(o, "spec_decode_metrics", None)),
                                             "output_tokens": len(t)} for p, o, t in zip(prompts, outs, toks)})
    got = [getattr(o, "spec_decode_metrics", None) for o in outs]
    if metrics is not None:
        metrics += got
    row = {"prompts": len(prompts), "output_tokens": sum(map(len, toks)), **delta.summary(),
           **per_request_summary(got)}
    return row, toks, delta


class _Mode:
    """What one decoding mode pooled over the groups: prompts, output tokens, counter delta, request metrics."""

    def __init__(self) -> None:
        self.prompts, self.output_tokens, self.delta, self.metrics = 0, 0, SpecCounters(0, 0, 0, ()), []

    def row(self) -> dict:
        return {"prompts": self.prompts, "output_tokens": self.output_tokens, **self.delta.summary(),
                **per_request_summary(self.metrics)}


def _pooled(modes) -> dict:
    """The ``overall`` row: every group's requests pooled (the modes hold them all), shaped like a group's
    row (output tokens, the pooled histogram, per-request median / min / max), from the requests themselves,
    not from the groups' rounded means."""
    every = _Mode()
    for m in modes:
        every.prompts, every.output_tokens = every.prompts + m.prompts, every.output_tokens + m.output_tokens
        every.delta, every.metrics = every.delta + m.delta, every.metrics + m.metrics
    return every.row()


def _measure_modes(llm, prompts, cfg, *, prompt_ids: dict, modes: dict[str, _Mode]
                   ) -> tuple[dict, list[list[int]], SpecCounters]:
    """:func:`_measure` of a group whose prompts are decoded in one mode or in both (chat through the
    template, raw as completions: as ingest stored each): each mode is measured on its own and pooled into
    ``modes``; the group's row pools both, with a row per mode under its ``modes`` when it holds both."""
    parts: dict[str, list[dict]] = {}
    for p in prompts:
        parts.setdefault(mode_of(p), []).append(p)
    rows, outs, total, metrics = {}, {}, SpecCounters(0, 0, 0, ()), []
    for mode, ps in sorted(parts.items()):
        got: list = []
        rows[mode], toks, delta = _measure(llm, ps, cfg, prompt_ids=prompt_ids, metrics=got)
        m = modes.setdefault(mode, _Mode())
        m.prompts, m.output_tokens = m.prompts + len(ps), m.output_tokens + rows[mode]["output_tokens"]
        m.delta, m.metrics = m.delta + delta, m.metrics + got
        outs.update({p["sample_id"]: t for p, t in zip(ps, toks)})
        total, metrics = total + delta, metrics + got
    toks = [outs[p["sample_id"]] for p in prompts]
    if len(rows) == 1:
        return next(iter(rows.values())), toks, total
    row = {"prompts": len(prompts), "output_tokens": sum(map(len, toks)), **total.summary(),
           **per_request_summary(metrics), "modes": rows}
    return row, toks, total


def evaluate_al(*, target: str, draft: str, store_uri: str, cfg, features_table: str = "features",
                trust_remote_code: bool = False) -> dict:
    """AL report of ``draft`` on ``target``; ``trust_remote_code`` is ``run.trust_remote_code``, and
    chat prompts render with ``cfg.chat_template_kwargs`` (resolved by ``evaluate.settings``; None: none)."""
    check_remote_code(target, trust_remote_code=trust_remote_code)
    if not (Path(draft) / "config.json").is_file():
        raise EaglenestError(f"no exported draft at {draft}: run `serve export` first")
    cfg = with_draft_k(cfg, draft)  # evaluate.num_speculative_tokens null: the draft's recorded default
    groups, prompt_info, tok, max_pos, engine, pool = plan(cfg, target=target, store_uri=store_uri,
                                                           trust_remote_code=trust_remote_code, draft=draft)
    check_draft_dir(draft, local_target_config(target))  # what vLLM would fail on, before the engine starts
    t0 = time.time()
    spec = speculative_config(draft, cfg.num_speculative_tokens)  # + parallel_drafting for a P-EAGLE draft
    llm = make_llm(target, engine, trust_remote_code=trust_remote_code, where="evaluate.engine",
                   speculative_config=spec, disable_log_stats=False,
                   per_request_spec_decode_metrics="summary")
    domains, buckets, outputs = {}, {}, {}
    bucket_prompts: dict[int, list[dict]] = {}
    prompt_ids: dict[str, list[int]] = {}
    modes: dict[str, _Mode] = {}
    try:
        for name, prompts in groups.items():
            row, toks, _ = _measure_modes(llm, prompts, cfg, prompt_ids=prompt_ids, modes=modes)
            outputs.update({p["sample_id"]: t for p, t in zip(prompts, toks)})
            domains[name] = row
            log.info("%s: AL %.3f over %d prompts", name, row["acceptance_length"] or 0, len(prompts))
        if cfg.context_buckets:
            bucket_prompts = _bucket_prompts(llm, tok, pool, outputs, cfg, max_pos, target=target,
                                             trust_remote_code=trust_remote_code)
            for b, prompts in bucket_prompts.items():
                counts: dict = {}
                row, toks, _ = _measure(llm, prompts, cfg, max_tokens=cfg.bucket_max_tokens, prompt_ids=prompt_ids,
                                        per_request=counts)
                row["prompt_tokens"] = len(prompts[0]["prompt_token_ids"])
                row["material_passes"] = max(p["material_passes"] for p in prompts)
                row["per_prompt"] = bucket_rows(prompts, toks, counts, tok)
                outputs.update({p["sample_id"]: t for p, t in zip(prompts, toks)})
                buckets[str(b)] = row
                log.info("context %d: AL %.3f", b, row["acceptance_length"] or 0)
    finally:
        close_llm(llm)
    report = {
        "target": target, "draft": draft, "split": cfg.split, "prompts": prompt_info,
        "num_speculative_tokens": cfg.num_speculative_tokens, "temperature": cfg.temperature,
        "chat_template_kwargs": cfg.chat_template_kwargs or {},
        "max_tokens": cfg.max_tokens, "bucket_max_tokens": cfg.bucket_max_tokens,
        "al_average": AVERAGES["acceptance_length"], "averages": AVERAGES,
        "overall": _pooled(modes.values()),
        "domains": domains, "modes": {mode: m.row() for mode, m in sorted(modes.items())}, "context_buckets": buckets,
        "seconds_speculative": round(time.time() - t0, 2),
    }
    if buckets:  # buckets shortened to one length on a short-context target: decoded once, under the first
        report["context_buckets_merged"] = merged_into(cfg, max_pos)
    pred: dict = {}
    far: dict = {}
    if cfg.check_lossless:
        report["lossless"], probs = _check_lossless(target, engine, groups, bucket_prompts, outputs, cfg,
                                                    trust_remote_code=trust_remote_code, far=far)
        pred.update(predictability(report, groups, bucket_prompts, probs))
    if cfg.ngram_order > 0:
        pred.update(ngram_predictability(report, groups, bucket_prompts, outputs, prompt_ids, cfg,
                                         store_uri=store_uri, table=features_table))
    if buckets:
        pred.update(farctx.add_to_report(report, far, keep_tokens=cfg.far_context_keep_tokens,
                                         probe_tokens=cfg.far_context_probe_tokens, measured=cfg.check_lossless))
        add_intervals(report, resamples=cfg.bootstrap_resamples, seed=cfg.engine.seed)
    if pred:
        report["predictability"] = pred
    return report


def merged_into(cfg, max_pos: int) -> dict[str, list[int]]:
    """``{reported bucket: [buckets shortened to its length]}`` (``buckets.merged_buckets``), report.json's
    ``context_buckets_merged``: a bucket asked for is never missing from the report without a word."""
    lengths = bucket_lengths(cfg.context_buckets, max_positions=max_pos, max_tokens=cfg.bucket_max_tokens)
    return {str(first): others for first, others in merged_buckets(lengths).items()}


#: What ``target_confidence`` is, written into every report that has it.
CONFIDENCE = ("mean probability the target gives its own output token, over the output tokens of the "
              "group's prompts, from the no-speculation pass (at temperature 0 the greedy token's "
              "probability, i.e. the target's top-1 probability)")


def predictability(report: dict, groups: dict, bucket_prompts: dict, probs: dict[str, list[float]]) -> dict:
    """Put each group's target confidence beside its AL and rank-correlate the two over groups.

    A draft can only be as good as the target is predictable: where the target is unsure of its
    next token, the draft's guess is accepted less often. Reporting the measured predictability
    beside AL lets a reader check whether AL follows it, instead of assuming it does.
    """
    def mean(ids):
        vals = [x for i in ids for x in probs.get(i, ())]
        return round(sum(vals) / len(vals), 4) if vals else None

    for name, prompts in groups.items():
        report["domains"][name]["target_confidence"] = mean(p["sample_id"] for p in prompts)
    for row, prompts in _mode_rows(report, groups):
        row["target_confidence"] = mean(p["sample_id"] for p in prompts)
    # over every group's tokens, as ngram_al is pooled overall (the buckets are not in "overall")
    report["overall"]["target_confidence"] = mean(p["sample_id"] for ps in groups.values() for p in ps)
    for b, prompts in bucket_prompts.items():
        report["context_buckets"][str(b)]["target_confidence"] = mean(p["sample_id"] for p in prompts)
        for p in prompts:  # per-prompt sums for the bucket's interval
            vals = probs.get(p["sample_id"], ())
            per_prompt(report, b, p["sample_id"]).update(confidence_sum=round(sum(vals), 6),
                                                         confidence_tokens=len(vals))
    return {"measure": CONFIDENCE, "spearman_al_vs_confidence": _rank_vs_al(report, "target_confidence")}


def _mode_rows(report: dict, groups: dict) -> list[tuple[dict, list[dict]]]:
    """(row, its prompts) of every per-mode row, rows like a group's: ``report["modes"]`` (pooled over the
    groups) and the own ``modes`` of a group holding both, so a measure put on the groups is put on them too."""
    def by_mode(prompts) -> dict[str, list[dict]]:
        out: dict[str, list[dict]] = {}
        for p in prompts:
            out.setdefault(mode_of(p), []).append(p)
        return out

    rows = [(report["modes"][m], ps) for m, ps in by_mode(p for ps in groups.values() for p in ps).items()
            if m in (report.get("modes") or {})]
    for name, prompts in groups.items():
        own = report["domains"][name].get("modes") or {}
        rows += [(own[m], ps) for m, ps in by_mode(prompts).items() if m in own]
    return rows


def _rank_vs_al(report: dict, key: str) -> float | None:
    """Spearman of the groups' ``key`` against their pooled AL (None with fewer than 3 groups)."""
    pairs = [(d[key], d["acceptance_length"]) for d in report["domains"].values()
             if d.get(key) is not None and d.get("acceptance_length") is not None]
    return spearman(*zip(*pairs)) if len(pairs) >= 3 else None


def ngram_predictability(report: dict, groups: dict, bucket_prompts: dict, outputs: dict, prompt_ids: dict,
                         cfg, *, store_uri: str, table: str) -> dict:
    """Put each group's ``ngram_al`` (``evaluate.ngram``) beside its AL and rank-correlate them.

    Replays the same outputs the draft was measured on, with an n-gram table fitted on the
    training pool as the drafter. Without a features table (nothing to fit on) the report says so."""
    if not store.exists(store_uri, table):
        return {"ngram": None, "ngram_skipped": f"no features table '{table}' in {store_uri} to fit on"}
    fitted, version = ngram.fit_from_store(store_uri, table, order=cfg.ngram_order, max_tokens=cfg.ngram_fit_tokens)
    if not fitted.fit_tokens:  # an empty table guesses nothing: its AL of 1.0 would read as a measured floor
        return {"ngram": None, "ngram_skipped": f"no loss tokens in the training split of '{table}' v{version} "
                                                f"in {store_uri} to fit on"}
    k = cfg.num_speculative_tokens

    def replay(prompts) -> ngram.Replay:
        return sum((ngram.simulate(fitted, prompt_ids.get(p["sample_id"], []), outputs[p["sample_id"]], k)
                    for p in prompts), ngram.Replay(by_position=[0] * k))

    def fields(r: ngram.Replay) -> dict:
        return {"ngram_al": r.acceptance_length,
                "ngram_acceptance_by_position": [round(x / r.rounds, 4) for x in r.by_position] if r.rounds else []}

    per_group = {name: replay(prompts) for name, prompts in groups.items()}
    for name, r in per_group.items():
        report["domains"][name].update(fields(r))
    for row, prompts in _mode_rows(report, groups):
        row.update(fields(replay(prompts)))
    for b, prompts in bucket_prompts.items():
        per = {p["sample_id"]: replay([p]) for p in prompts}
        report["context_buckets"][str(b)].update(fields(sum(per.values(), ngram.Replay(by_position=[0] * k))))
        for sid, r in per.items():  # per-prompt counts for the bucket's interval
            per_prompt(report, b, sid).update(ngram_rounds=r.rounds, ngram_accepted=r.accepted)
    report["overall"].update(fields(sum(per_group.values(), ngram.Replay(by_position=[0] * k))))
    measure = ngram.MEASURE.format(order=cfg.ngram_order, fit_tokens=fitted.fit_tokens, table=table,
                                   version=version, k=k)
    return {"ngram": {"measure": measure, "order": cfg.ngram_order, "fit_tokens": fitted.fit_tokens,
                      "table": table, "version": version},
            "spearman_al_vs_ngram": _rank_vs_al(report, "ngram_al")}


def spearman(xs, ys) -> float | None:
    """Spearman rank correlation (average ranks for ties); None when either side is constant."""
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    rx, ry = ranks(list(xs)), ranks(list(ys))
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    vx, vy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    return round(cov / (vx * vy) ** 0.5, 4) if vx and vy else None


def _bucket_prompts(llm, tok, pool: list[dict], outputs: dict, cfg, max_pos: int, *, target: str,
                    trust_remote_code: bool = False) -> dict[int, list[dict]]:
    """The context buckets' prompts from ``pool`` (``buckets.material_pool``) and its answers: the held-out
    decode's, or (other prompt sets) the target's answers decoded now (not part of the report), each as its
    conversation's next turn holds it (``buckets.heldout_material``: a harmony target's final channel)."""
    if cfg.prompt_set != "heldout" and pool:
        outs = _decode(llm, pool, cfg)
        outputs = {**outputs, **{p["sample_id"]: list(r.outputs[0].token_ids) for p, r in zip(pool, outs)}}
    material = heldout_material(tok, pool, outputs, target=target, trust_remote_code=trust_remote_code)
    return build_bucket_prompts(tok, material, tuple(cfg.context_buckets), per_bucket=cfg.bucket_prompts,
                                max_positions=max_pos, max_tokens=cfg.bucket_max_tokens, seed=cfg.engine.seed,
                                chat_template_kwargs=cfg.chat_template_kwargs, kinds=tuple(cfg.bucket_material))


def _check_lossless(target: str, engine, groups, bucket_prompts, outputs: dict, cfg, *,
                    trust_remote_code: bool = False, far: dict | None = None) -> tuple[dict, dict]:
    """Decode without speculation; (lossless summary, {sample_id: probability of each output token}).
    With ``far``, the same engine also scores the bucket prompts with their far part removed
    (``evaluate.farctx``) into it."""
    llm = make_llm(target, engine, trust_remote_code=trust_remote_code, where="evaluate.engine")
    try:
        probing = far is not None and bool(bucket_prompts) and bool(cfg.far_context_keep_tokens)
        tok = load_tokenizer(target, trust_remote_code=trust_remote_code) if probing else None
        prompts = [p for ps in groups.values() for p in ps]
        outs = [r.outputs[0] for r in _decode(llm, prompts, cfg, logprobs=0)]
        answers: list[dict] = []
        unscored: dict[str, str] = {}  # answers with no room after their prompt: in the report, not the log alone
        for length, ps in bucket_prompts.items():
            prompts += ps
            outs += [r.outputs[0] for r in _decode(llm, ps, cfg, max_tokens=cfg.bucket_max_tokens, logprobs=0)]
            if probing and cfg.far_context_answers:  # now, while the engine's prefix cache holds these prompts
                rows = farctx.answer_probes({length: ps}, tok, keep_tokens=cfg.far_context_keep_tokens,
                                            bos_id=tok.bos_token_id, max_len=engine.max_model_len,
                                            unscored=unscored)
                farctx.score_answers(llm, rows)
                answers += rows
        base = [list(o.token_ids) for o in outs]
        probs = {p["sample_id"]: [math.exp(lp[t].logprob) for t, lp in zip(o.token_ids, o.logprobs or [])]
                 for p, o in zip(prompts, outs)}
        if probing:
            far.update(farctx.measure(llm, bucket_prompts, {p["sample_id"]: b for p, b in zip(prompts, base)}, probs,
                                      keep_tokens=cfg.far_context_keep_tokens,
                                      probe_tokens=cfg.far_context_probe_tokens, bos_id=tok.bos_token_id,
                                      answers=answers))
            for sid, why in unscored.items():
                far.setdefault(sid, {})["answer_unscored"] = why
    finally:
        close_llm(llm)
    diff = [p["sample_id"] for p, b in zip(prompts, base) if outputs[p["sample_id"]] != b]
    return ({"prompts": len(prompts), "identical": len(prompts) - len(diff), "differing_ids": diff[:20],
             "all_identical": not diff}, probs)
