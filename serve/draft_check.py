"""Load-check an exported draft in real vLLM: it loads, greedy output is unchanged, and AL.

    python -m eaglenest.serve.draft_check TARGET_DIR DRAFT_DIR --prompts-from STORE_URI

Runs the target alone, then with the EAGLE-3 draft, on the same token-id prompts (the tokenizer is
not needed: ``skip_tokenizer_init``), compares greedy token ids and reads acceptance length
AL = 1 + accepted / drafts from ``llm.get_metrics()``. The engines are built as every stage builds
them (``eaglenest.engine.make_llm``: the checkpoint's dtype, in this process on CPU) and closed
before the next starts. This is a smoke check for the train/serve boundary; the evaluate stage owns
the real lossless and AL measurements.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

from eaglenest.engine import EngineConfig, close_llm, draft_num_speculative_tokens, make_llm, speculative_config
from eaglenest.engine_errors import one_line
from eaglenest.errors import ConfigError, EaglenestError, StoreError
from eaglenest.featurestore.table import store
from eaglenest.serve.draft_files import check_draft_dir, local_target_config
from eaglenest.specdecode import read_counters
from eaglenest.target import max_positions, read_config

#: Draft tokens a round for a draft whose config.json records none (an export made before the key).
DEFAULT_NUM_SPEC = 3


def _engine(target: str, *, draft: str | None, num_spec: int, mem: float, max_len: int,
            trust_remote_code: bool = False, dtype: str = "auto"):
    """An in-process engine on ``target`` (with ``draft``); vLLM's own start-up failure (a RuntimeError, a
    pydantic ValidationError, ...: a traceback) is one line naming what it started."""
    extra = {"speculative_config": speculative_config(draft, num_spec)} if draft else {}
    try:
        return make_llm(target, EngineConfig(max_model_len=max_len, memory_fraction=mem, dtype=dtype),
                        trust_remote_code=trust_remote_code, key="target", disable_log_stats=False,
                        skip_tokenizer_init=True, **extra)
    except ENGINE_FAILURES as exc:
        what = f"{target} with the draft {draft}" if draft else f"{target} alone"
        raise EaglenestError(f"vLLM could not start an engine on {what}: {one_line(exc)[:300]}") from None


#: How vLLM's engine start fails (its own refusals, pydantic's ValidationError: a ValueError; a failed
#: engine core: a RuntimeError); eaglenest's refusals are EaglenestErrors, none of these.
ENGINE_FAILURES = (RuntimeError, ValueError, AssertionError, NotImplementedError, KeyError, TypeError)


def _run(target: str, prompts: list[list[int]], max_tokens: int, **kw) -> tuple[list[list[int]], dict]:
    """Greedy token ids for ``prompts`` and the engine's spec-decode metrics; the engine is closed."""
    llm = _engine(target, **kw)
    try:
        return _generate(llm, prompts, max_tokens), spec_metrics(llm)
    finally:
        close_llm(llm)
        del llm
        gc.collect()


def _generate(llm, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def spec_metrics(llm) -> dict[str, float]:
    """Drafts, draft tokens and accepted tokens summed over every engine's series (labelled by engine;
    ``eaglenest.specdecode``, the reader ``evaluate`` uses), and the AL they give: 1 + accepted / drafts
    (1.0 when nothing was drafted)."""
    c = read_counters(llm)
    return {"spec_decode_num_drafts": float(c.drafts), "spec_decode_num_draft_tokens": float(c.draft_tokens),
            "spec_decode_num_accepted_tokens": float(c.accepted), "acceptance_length": c.acceptance_length or 1.0}


def check(target: str, draft: str, prompts: list[list[int]], *, max_tokens: int = 64, num_spec: int = 3,
          mem: float = 0.15, max_len: int = 2048, trust_remote_code: bool = False) -> dict:
    kw = dict(num_spec=num_spec, mem=mem, max_len=engine_len(target, prompts, max_tokens, max_len),
              trust_remote_code=trust_remote_code)
    base, _ = _run(target, prompts, max_tokens, draft=None, **kw)
    spec, metrics = _run(target, prompts, max_tokens, draft=draft, **kw)
    same = sum(a == b for a, b in zip(base, spec))
    return {"prompts": len(prompts), "identical_outputs": same, "lossless": same == len(prompts), **metrics}


def fitted_max_len(target: str, max_len: int) -> int:
    """``max_len``, lowered to a local target's positions (``target.max_positions``): this command has no
    setting for it, so a target of fewer than its default positions could not be checked at all."""
    found = max_positions(read_config(target)) if (Path(target) / "config.json").is_file() else None
    return min(max_len, found[0]) if found else max_len


def engine_len(target: str, prompts: list[list[int]], max_tokens: int, max_len: int) -> int:
    """The engines' ``max_model_len``: ``max_len``, raised to fit the longest prompt and its ``max_tokens``
    (greedy with ``ignore_eos``: every output is that long), within a local target's positions
    (:func:`fitted_max_len`). A prompt that cannot fit is refused (ConfigError) before an engine starts:
    vLLM refuses it only in ``generate``, after the target alone was loaded (a long-context store's rows)."""
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i]), default=None)
    need = len(prompts[longest]) + max_tokens if longest is not None else 0
    fitted = fitted_max_len(target, max(max_len, need))
    if need > fitted:
        raise ConfigError(f"--prompts-from: prompt {longest} has {len(prompts[longest])} tokens, no room for "
                          f"--max-tokens {max_tokens} within the target's {fitted} positions: lower --max-tokens")
    return fitted


def prompts_from_store(uri: str, *, n: int, split: str = "heldout") -> list[list[int]]:
    """Prompt parts (tokens before the first loss token) of ``n`` rows of the features table."""
    rows = store.read(uri, store.FEATURES, columns=["input_ids", "loss_mask", "split"]).to_pylist()
    rows = [r for r in rows if r["split"] == split] or rows
    out = []
    for r in rows[:n]:
        first = r["loss_mask"].index(1) if 1 in r["loss_mask"] else len(r["input_ids"])
        out.append(r["input_ids"][:max(first, 1)])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("target")
    p.add_argument("draft")
    p.add_argument("--prompts-from", required=True, help="features store URI")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--num-spec", type=int, default=None,
                   help="draft tokens a round (default: the K the draft's config.json records, as serve up)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="run the target's own Python code (as run.trust_remote_code)")
    a = p.parse_args(argv)
    try:
        for flag, value in (("--num-prompts", a.num_prompts), ("--max-tokens", a.max_tokens),
                            ("--num-spec", a.num_spec)):
            if value is not None and value < 1:  # no prompt checked would read as lossless
                raise ConfigError(f"{flag}: at least 1, got {value}")
        check_draft_dir(a.draft, local_target_config(a.target))  # before two engines start
        # A P-EAGLE or DFlash draft trained for fewer than 3 tokens a round is checked at its own K.
        num_spec = a.num_spec or draft_num_speculative_tokens(a.draft, DEFAULT_NUM_SPEC)
        prompts = prompts_from_store(a.prompts_from, n=a.num_prompts)
        if not prompts:
            raise StoreError(f"--prompts-from: {a.prompts_from} has no features rows to check the draft with")
        result = check(a.target, a.draft, prompts, max_tokens=a.max_tokens, num_spec=num_spec,
                       trust_remote_code=a.trust_remote_code)
    except EaglenestError as exc:
        print(f"draft_check: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2))
    return 0 if result["lossless"] else 1


if __name__ == "__main__":
    sys.exit(main())
