"""Smoke-check the tiny target under real vLLM: chat per domain, raw completion, 32k context.

``python -m eaglenest.tinytarget.engine_check [--model assets/tiny-target]`` starts one engine as the
stages do (``eaglenest.engine.make_llm``: the checkpoint's dtype, in this process on CPU), answers a
few prompts per domain from ``recipes/data`` with greedy ``LLM.chat``, completes a raw-text prompt with ``LLM.generate``, and checks every chat answer stopped at
``<|end|>``. ``--max-model-len 32768`` checks that vLLM accepts the full advertised context.
Not part of the fast test suite: it needs the ``cpu`` (or ``cuda``) extra and starts an engine.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from eaglenest.engine import EngineConfig, close_llm, make_llm

log = logging.getLogger(__name__)


def run_check(model: str, prompts_dir: Path, *, num_per_domain: int, max_model_len: int,
              gpu_memory_utilization: float) -> dict:
    llm = make_llm(model, EngineConfig(max_model_len=max_model_len, memory_fraction=gpu_memory_utilization))
    try:
        return _answers(llm, prompts_dir, num_per_domain=num_per_domain, max_model_len=max_model_len)
    finally:
        close_llm(llm)


def _answers(llm, prompts_dir: Path, *, num_per_domain: int, max_model_len: int) -> dict:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=200)
    report: dict = {"max_model_len": max_model_len, "chat": {}}
    for path in sorted(prompts_dir.glob("*.jsonl")):
        recs = [json.loads(line) for line in path.read_text().splitlines()[:num_per_domain]]
        recs = [r for r in recs if "prompt" in r]  # single-turn prompts; dialogue files hold `messages`
        if not recs:
            continue
        convs = [([{"role": "system", "content": r["system"]}] if r.get("system") else [])
                 + [{"role": "user", "content": r["prompt"]}] for r in recs]
        outs = llm.chat(convs, params, use_tqdm=False)
        report["chat"][path.stem] = [
            {"prompt": r["prompt"], "text": o.outputs[0].text,
             "finish_reason": o.outputs[0].finish_reason, "num_tokens": len(o.outputs[0].token_ids)}
            for r, o in zip(recs, outs)]
    raw = llm.generate(["What is 47 + 38?\n\n"], params, use_tqdm=False)[0].outputs[0]
    report["raw"] = {"prompt": "What is 47 + 38?\\n\\n", "text": raw.text,
                     "finish_reason": raw.finish_reason}
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eaglenest.tinytarget.engine_check")
    p.add_argument("--model", default="assets/tiny-target")
    p.add_argument("--prompts", type=Path, default=Path("recipes/data"))
    p.add_argument("--num-per-domain", type=int, default=3)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.1)
    p.add_argument("--json-out", type=Path, default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    report = run_check(args.model, args.prompts, num_per_domain=args.num_per_domain,
                       max_model_len=args.max_model_len,
                       gpu_memory_utilization=args.gpu_memory_utilization)
    bad = [(d, o["prompt"]) for d, outs in report["chat"].items() for o in outs
           if o["finish_reason"] != "stop"]
    text = json.dumps(report, indent=2)
    if args.json_out:
        args.json_out.write_text(text + "\n")
    print(text)
    if bad:
        log.error("%d chat answers did not stop at <|end|>: %s", len(bad), bad)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
