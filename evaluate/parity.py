"""Train/serve parity: the draft tokens vLLM proposes from the exported draft, round by round,
against the trainer's own proposer replaying the same rounds from the train checkpoint.

Served side: one vLLM engine (target + exported draft, greedy) decodes the prompts with
:class:`eaglenest.evaluate.proposals.ProposalRecorder` in its worker, which keeps every call of the
drafter's ``propose``: per request, the k draft tokens of each round, in order. Trained side: the
offline estimator's proposer (:func:`eaglenest.evaluate.offline.propose`: EAGLE-3's chain,
P-EAGLE's parallel slots, DFlash's block, each as its family's training code computes it) with the
train checkpoint and the Hugging Face target's features, over the same contexts. Greedy decoding is
lossless, so the context of round r is the prompt plus vLLM's output up to what the earlier rounds
accepted: round 0 follows the first token, and a round whose proposals match the next a output
tokens moves the context on by a + 1. No context depends on the trained side, so one skewed round
does not shift the others.

What it catches: anything that makes the served draft compute differently from the trained one
(weights, the aux-layer order or offset, a norm flag, the attention mask, the mask token); the
report names the first request, round and position where the two part. The trade-off: fp near-ties
can flip an argmax between kernels, so the check passes at a threshold (``evaluate.parity_min_identical``,
the weakest position's share of identical proposals) rather than on exact identity; with fp32 target
and draft the tiny targets' drafts are identical everywhere (tests/evaluate/test_parity.py).
"""

from __future__ import annotations

import logging
from pathlib import Path

from eaglenest.engine import close_llm, draft_family, make_llm, speculative_config
from eaglenest.errors import ConfigError
from eaglenest.evaluate.offline import features, load_draft, load_target, propose
from eaglenest.paths import read_json_object
from eaglenest.train import dflash

log = logging.getLogger(__name__)

#: The worker extension vLLM imports in its worker process (a qualified name: nothing is pickled).
RECORDER = "eaglenest.evaluate.proposals.ProposalRecorder"


def served_proposals(*, target: str, draft: str, prompts: list[list[int]], k: int, max_tokens: int,
                     engine, trust_remote_code: bool = False) -> tuple[list[list[int]], list[list[list[int]]]]:
    """vLLM's greedy outputs and, per prompt, the draft tokens of each round (k ids a round)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = make_llm(target, engine, trust_remote_code=trust_remote_code, where="evaluate.engine",
                   speculative_config=speculative_config(draft, k), worker_extension_cls=RECORDER)
    try:
        llm.collective_rpc("start_recording_proposals")
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, detokenize=False)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
        calls = llm.collective_rpc("recorded_proposals")[0]
    finally:
        close_llm(llm)
    # vLLM's internal request id is the caller's plus "-<8 hex>" (v1/engine/input_processor.py).
    index = {o.request_id: i for i, o in enumerate(outs)}
    rounds: list[list[list[int]]] = [[] for _ in prompts]
    for req_ids, rows in calls:
        for rid, row in zip(req_ids, rows):
            i = index.get(rid, index.get(rid.rsplit("-", 1)[0]))
            if i is not None:
                rounds[i].append([int(t) for t in row])
    return [list(o.outputs[0].token_ids) for o in outs], rounds


def replay(target_model, draft, prompt: list[int], output: list[int], served: list[list[int]],
           k: int) -> list[dict]:
    """The trained proposer over vLLM's rounds of one request: per round, its context length (tokens
    verified), the served and the trained proposals. Rounds after the output ends are dropped (vLLM
    may draft once more for a request that has just finished)."""
    import torch

    full = list(prompt) + list(output)
    with torch.inference_mode():
        feats = features(target_model, draft, full)
        done, out = 1, []  # output tokens verified before the round: the prefill's first one
        for row in served:
            n = len(prompt) + done
            if done >= len(output) or len(row) != k:
                break
            trained = propose(draft, full[:n], feats[: n - 1], k)
            out.append({"context_tokens": n, "served": row, "trained": [int(t) for t in trained]})
            a = 0
            while a < k and done + a < len(output) and row[a] == output[done + a]:
                a += 1
            done += a + 1
    return out


def summarise(rounds: dict[str, list[dict]], k: int, min_identical: float) -> dict:
    """Counts per position, the weakest position's share of identical proposals, the first parting."""
    flat = [(rid, r, row) for rid, rows in rounds.items() for r, row in enumerate(rows)]
    same = [sum(row["served"][j] == row["trained"][j] for _, _, row in flat) for j in range(k)]
    n = len(flat)
    by_pos = [s / n if n else None for s in same]
    first = None
    for rid, r, row in flat:
        j = next((j for j in range(k) if row["served"][j] != row["trained"][j]), None)
        if j is not None:
            first = {"request": rid, "round": r, "position": j + 1, "context_tokens": row["context_tokens"],
                     "trained_token": row["trained"][j], "served_token": row["served"][j],
                     "trained": row["trained"], "served": row["served"]}
            break
    weakest = min(by_pos) if n else None
    return {"rounds": n, "requests": len(rounds), "identical_by_position": by_pos,
            "identical_rounds": sum(row["served"] == row["trained"] for _, _, row in flat) / n if n else None,
            "min_identical": weakest, "threshold": min_identical,
            "passed": bool(n) and weakest >= min_identical, "first_difference": first}


def parity_check(*, target: str | Path, draft: str | Path, checkpoint: str | Path, prompts: dict[str, list[int]],
                 k: int, max_tokens: int, engine, min_identical: float, trust_remote_code: bool = False,
                 num_threads: int = 1, checkpoint_key: str = "--checkpoint") -> dict:
    """Serve ``draft`` on ``prompts`` ({request name: token ids}), replay its rounds with the train
    ``checkpoint``; the report (:func:`summarise` plus what was compared and every round). Errors about
    the checkpoint name ``checkpoint_key``."""
    import torch

    if not prompts:
        raise ConfigError("evaluate.parity_prompts: no prompts to decode (the prompt set is empty)")
    dmodel = load_draft(checkpoint, target, key=checkpoint_key)  # a damaged one refused before the target loads
    _check_family(dmodel, draft, checkpoint, checkpoint_key)
    model, _tok, _stops = load_target(target, trust_remote_code=trust_remote_code)
    dmodel = dmodel.to(next(model.parameters()).dtype)
    names = list(prompts)
    outputs, served = served_proposals(target=str(target), draft=str(draft), prompts=[prompts[n] for n in names],
                                       k=k, max_tokens=max_tokens, engine=engine,
                                       trust_remote_code=trust_remote_code)
    threads = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        rounds = {name: replay(model, dmodel, prompts[name], out, rows, k)
                  for name, out, rows in zip(names, outputs, served)}
    finally:
        torch.set_num_threads(threads)
    report = summarise(rounds, k, min_identical)
    log.info("parity: %d rounds, identical by position %s", report["rounds"], report["identical_by_position"])
    return {"target": str(target), "served_draft": str(draft), "trained_checkpoint": str(checkpoint),
            "num_speculative_tokens": k, "max_tokens": max_tokens, **report,
            "per_request": {name: rows for name, rows in rounds.items()}}


def _check_family(model, draft: str | Path, checkpoint: str | Path, key: str) -> None:
    """Refuse, before an engine starts, a train checkpoint of another family than the served export:
    its proposals would part everywhere, for no fault of the export."""
    trained = ("dflash" if dflash.is_dflash(model.config)
               else "peagle" if getattr(model.config, "parallel_drafting", False) else "eagle3")
    served = draft_family(read_json_object(Path(draft) / "config.json", error=ConfigError,
                                           then="export the draft again (`serve export`)"))
    if trained != served:
        raise ConfigError(f"{key}: {checkpoint} is a {trained} draft, the served draft {draft} a {served} one: "
                          "name the train checkpoint it was exported from")


def failure_line(report: dict) -> str:
    """One line saying that (and where) the served draft departs from the trained one."""
    if not report["rounds"]:
        return "no draft rounds were compared (vLLM proposed nothing: check the prompts and max_tokens)"
    f = report["first_difference"]
    where = (f"; first at request {f['request']} round {f['round']} position {f['position']} "
             f"({f['context_tokens']} tokens of context): trained token {f['trained_token']}, served token "
             f"{f['served_token']}") if f else ""
    by_pos = ", ".join(f"{x:.3f}" for x in report["identical_by_position"])
    return (f"the served draft {report['served_draft']} departs from the trained checkpoint "
            f"{report['trained_checkpoint']}: proposals identical by position {by_pos} over {report['rounds']} "
            f"rounds, below evaluate.parity_min_identical={report['threshold']}{where}")


__all__ = ["RECORDER", "failure_line", "parity_check", "replay", "served_proposals", "summarise"]
