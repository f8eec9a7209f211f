"""Prompt source files for the demo manifest: ``recipes/data/<domain>.jsonl``.

Drawn from the corpus generators with a seed different from the training seed, so most prompts are
fresh to the model (the prompt space is small, so a few can coincide with training prompts by
chance; the answers are never shipped). Lines are ``{"id", "prompt", "system"?}``, written in a
fixed order with sorted keys, so the files are byte-identical on every rebuild.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

from eaglenest.provenance import write_text_atomic
from eaglenest.tinytarget import corpus

log = logging.getLogger(__name__)

PROMPT_SEED = 20251129
NUM_PROMPTS_PER_DOMAIN = 150
#: Multi-turn conversations (``dialogue.jsonl``): user turns drawn from all four domains, so the
#: draft trains on the long multi-turn chats that context buckets and real traffic look like.
DIALOGUE_SEED = 20261129
NUM_DIALOGUES = 40
DIALOGUE_TURNS = (6, 12)


def prompt_records(domain: corpus.Domain, *, seed: int = PROMPT_SEED,
                   num_prompts: int = NUM_PROMPTS_PER_DOMAIN) -> list[dict]:
    """``num_prompts`` distinct prompts of ``domain`` (duplicates of an earlier prompt are skipped)."""
    out, seen = [], set()
    stream = corpus.iter_domain(domain, seed=seed)
    for _ in range(num_prompts * 50):
        sample = next(stream)
        key = (sample["prompt"], sample.get("system"))
        if key in seen:
            continue
        seen.add(key)
        rec = {"id": f"{domain}-{len(out):04d}", "prompt": sample["prompt"]}
        if sample.get("system"):
            rec["system"] = sample["system"]
        out.append(rec)
        if len(out) == num_prompts:
            return out
    raise RuntimeError(f"{domain}: could not draw {num_prompts} distinct prompts")


def dialogue_records(*, seed: int = DIALOGUE_SEED, num_dialogues: int = NUM_DIALOGUES,
                     turns: tuple[int, int] = DIALOGUE_TURNS) -> list[dict]:
    """``num_dialogues`` conversations of ``turns[0]..turns[1]`` user turns from mixed domains."""
    rng = random.Random(seed)
    streams = {d: corpus.iter_domain(d, seed=seed) for d in corpus.DOMAINS}
    out = []
    for i in range(num_dialogues):
        msgs = [{"role": "user", "content": next(streams[rng.choice(corpus.DOMAINS)])["prompt"]}
                for _ in range(rng.randint(*turns))]
        out.append({"id": f"dialogue-{i:04d}", "messages": msgs})
    return out


def write_prompt_files(outdir: str | Path, *, seed: int = PROMPT_SEED,
                       num_prompts: int = NUM_PROMPTS_PER_DOMAIN) -> list[Path]:
    """Write one JSONL per domain into ``outdir`` and return the paths."""
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    paths = []
    for domain in corpus.DOMAINS:
        path = outdir / f"{domain}.jsonl"
        lines = [json.dumps(r, sort_keys=True, ensure_ascii=False)
                 for r in prompt_records(domain, seed=seed, num_prompts=num_prompts)]
        write_text_atomic(path, "\n".join(lines) + "\n")
        paths.append(path)
        log.info("wrote %d prompts to %s", len(lines), path)
    path = outdir / "dialogue.jsonl"
    # drawn from the prompt seed too (the default one gives DIALOGUE_SEED): another seed, other dialogues
    lines = [json.dumps(r, sort_keys=True, ensure_ascii=False)
             for r in dialogue_records(seed=seed + DIALOGUE_SEED - PROMPT_SEED)]
    write_text_atomic(path, "\n".join(lines) + "\n")
    paths.append(path)
    log.info("wrote %d dialogues to %s", len(lines), path)
    return paths
