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

from eaglenest.cli import Command
from eaglenest.engine import EngineConfig, close_llm, make_llm
from eaglenest.errors import ConfigError
from eaglenest.launch import execute
from eaglenest.paths import ensure_writable
from eaglenest.provenance import write_text_atomic

log = logging.getLogger(__name__)


def run_check(model: str, prompts_dir: Path, *, num_per_domain: int, max_model_len: int,
              gpu_memory_utilization: float) -> dict:
    check_engine_sizes(max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization)
    prompts = read_prompts(prompts_dir, num_per_domain=num_per_domain)  # before the engine's start
    llm = make_llm(model, EngineConfig(max_model_len=max_model_len, memory_fraction=gpu_memory_utilization),
                   key="--model")
    try:
        return _answers(llm, prompts, max_model_len=max_model_len)
    finally:
        close_llm(llm)


def check_engine_sizes(*, max_model_len: int, gpu_memory_utilization: float) -> None:
    """What the engine would refuse only after its start (a traceback from vLLM), refused before it."""
    if max_model_len < 1:
        raise ConfigError(f"--max-model-len: must be >= 1, got {max_model_len}")
    if not 0 < gpu_memory_utilization <= 1:  # nan included
        raise ConfigError(f"--gpu-memory-utilization: must be in (0, 1], got {gpu_memory_utilization}")


def read_prompts(prompts_dir: Path, *, num_per_domain: int) -> dict[str, list[dict]]:
    """The first ``num_per_domain`` single-turn prompts of each ``*.jsonl`` in ``prompts_dir`` (dialogue
    files hold ``messages``: skipped). None at all is an error: a check of no answers passes vacuously."""
    if num_per_domain < 1:
        raise ConfigError(f"--num-per-domain: must be >= 1, got {num_per_domain}")
    out = {}
    for path in sorted(prompts_dir.glob("*.jsonl")):
        try:
            lines = path.read_text(encoding="utf-8").splitlines()[:num_per_domain]
        except (OSError, ValueError) as exc:  # unreadable, or not UTF-8
            raise ConfigError(f"--prompts: {path}: cannot read ({exc})") from None
        recs = []
        for i, line in enumerate(lines, 1):
            try:
                rec = json.loads(line)
            except ValueError:
                rec = None
            if not isinstance(rec, dict):
                raise ConfigError(f"--prompts: {path}: line {i} is not a JSON object")
            if "prompt" in rec:
                _check_texts(rec, f"--prompts: {path}: line {i}")
                recs.append(rec)
        if recs:
            out[path.stem] = recs
    if not out:
        raise ConfigError(f"--prompts: no prompt files in {prompts_dir} (<domain>.jsonl with \"prompt\" lines)")
    return out


def _check_texts(rec: dict, where: str) -> None:
    """A prompt line's ``prompt`` (and ``system``, where given and not null) are text: anything else went to
    vLLM's chat template, after the engine's start, instead of one line naming the file and line."""
    for key in ("prompt", "system"):
        value = rec.get(key)
        if not isinstance(value, str) and (key == "prompt" or value is not None):
            raise ConfigError(f"{where}: {key!r} must be text, got {type(value).__name__} {value!r:.40}")


def _answers(llm, prompts: dict[str, list[dict]], *, max_model_len: int) -> dict:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=200)
    report: dict = {"max_model_len": max_model_len, "chat": {}}
    for stem, recs in prompts.items():
        convs = [([{"role": "system", "content": r["system"]}] if r.get("system") else [])
                 + [{"role": "user", "content": r["prompt"]}] for r in recs]
        outs = llm.chat(convs, params, use_tqdm=False)
        report["chat"][stem] = [
            {"prompt": r["prompt"], "text": o.outputs[0].text,
             "finish_reason": o.outputs[0].finish_reason, "num_tokens": len(o.outputs[0].token_ids)}
            for r, o in zip(recs, outs)]
    raw = llm.generate(["What is 47 + 38?\n\n"], params, use_tqdm=False)[0].outputs[0]
    report["raw"] = {"prompt": "What is 47 + 38?\\n\\n", "text": raw.text,
                     "finish_reason": raw.finish_reason}
    return report


PROG = "python -m eaglenest.tinytarget.engine_check"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--model", default="assets/tiny-target")
    p.add_argument("--prompts", type=Path, default=Path("recipes/data"))
    p.add_argument("--num-per-domain", type=int, default=3)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.1)
    p.add_argument("--json-out", type=Path, default=None)
    p.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv: debug)")
    args = p.parse_args(argv)
    # The shared CLI layer: logging, the process guard (the engine ends with this process), one-line
    # errors (exit 2), Ctrl-C and SIGTERM unwinding through the engine's close, as every stage command does.
    return execute(PROG, Command(fn=run, help=p.description, needs_recipe=False), args)


def run(recipe: None, args: argparse.Namespace) -> int:
    """The command's body: the check, its report printed (and written to --json-out); 1 if an answer ran on."""
    if args.json_out:  # before the engine's start, not after a minute of it
        ensure_writable(args.json_out.parent, "--json-out", error=ConfigError)
    report = run_check(args.model, args.prompts, num_per_domain=args.num_per_domain,
                       max_model_len=args.max_model_len, gpu_memory_utilization=args.gpu_memory_utilization)
    bad = [(d, o["prompt"]) for d, outs in report["chat"].items() for o in outs
           if o["finish_reason"] != "stop"]
    text = json.dumps(report, indent=2)
    if args.json_out:
        write_text_atomic(args.json_out, text + "\n")
    print(text)
    if bad:
        log.error("%d chat answers did not stop at <|end|>: %s", len(bad), bad)
        return 1
    return 0

if __name__ == "__main__":
    sys.exit(main())
