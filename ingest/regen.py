"""On-policy regeneration: the target answers the pool's prompts through its exact chat template.

Chat prompts go through the backend's ``chat`` (vLLM renders the target's own template); raw prompts
through ``complete`` as plain documents. Both keep vLLM's own prompt and response token ids, so the
feature store later captures exactly the tokens the target produced (no re-tokenisation drift).

Multi-turn conversations are answered turn by turn, in order: turn ``t`` of every conversation in a
batch is one batched request whose history holds the target's *own* answers to turns ``< t``. The
stored row is the whole conversation in ``messages_json``; its token ids are those of the last turn
(prompt = the full rendered history, response = the last answer), so the loss covers the final
assistant turn while earlier on-policy answers are context. A request that fails (after the
backend's retries) drops its whole conversation from this run and is reported per prompt.
"""

from __future__ import annotations

import hashlib
import json
import logging

from eaglenest.ingest.backends import Completion, Failure
from eaglenest.ingest.manifest import Generation
from eaglenest.ingest.pool import PoolEntry, raw_text

log = logging.getLogger(__name__)


def gen_params_id(gen: Generation, chat_template: str) -> str:
    """Identity of how responses were produced (sampling + template), stored with every row."""
    spec = {"temperature": gen.temperature, "max_tokens": gen.max_tokens, "seed": gen.seed,
            "chat_template_sha256": hashlib.sha256(chat_template.encode()).hexdigest()}
    if gen.reasoning != "default":  # keeps ids of existing runs unchanged
        spec["reasoning"] = gen.reasoning
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def regenerate(backend, entries: list[PoolEntry], gen: Generation, gen_id: str) -> tuple[list[dict], list[dict]]:
    """``(rows, failures)``: rows for the prompts table in entry order, and ``{sample_id, error}``."""
    done: dict[str, tuple[list[dict], Completion]] = {}
    failures: dict[str, str] = {}
    raw = [e for e in entries if e.mode == "raw"]
    if raw:
        for e, c in zip(raw, backend.complete([raw_text(e) for e in raw], gen)):
            if isinstance(c, Failure):
                failures[e.sample_id] = c.error
            else:
                done[e.sample_id] = ([{"role": "document", "content": raw_text(e)}], c)
    live = {e.sample_id: e.messages() for e in entries if e.mode == "chat"}
    entry = {e.sample_id: e for e in entries}
    turn = 0
    while live:
        ids = list(live)
        outs = backend.chat([live[i] for i in ids], gen)
        for sid, c in zip(ids, outs):
            if isinstance(c, Failure):
                failures[sid] = f"turn {turn}: {c.error}"
                del live[sid]
                continue
            history = live[sid] + [{"role": "assistant", "content": c.text}]
            later = entry[sid].later_turns
            if turn < len(later):  # feed the target's own answer back, then the next user turn
                live[sid] = history + [{"role": "user", "content": later[turn]}]
            else:
                done[sid] = (live.pop(sid), c)
        turn += 1
    rows = []
    for e in entries:
        if e.sample_id in done:
            messages, c = done[e.sample_id]
            rows.append(row(e, messages=messages + [{"role": "assistant", "content": c.text}],
                            prompt_ids=c.prompt_ids, response_ids=c.response_ids,
                            finish_reason=c.finish_reason, gen_id=gen_id))
    return rows, [{"sample_id": s, "error": err} for s, err in failures.items()]


def row(e: PoolEntry, *, messages: list[dict], prompt_ids: list[int], response_ids: list[int],
        finish_reason: str, gen_id: str) -> dict:
    return {"sample_id": e.sample_id, "domain": e.domain, "source": e.source, "split": e.split,
            "mode": e.mode, "messages_json": json.dumps(messages, ensure_ascii=False),
            "prompt_token_ids": prompt_ids, "response_token_ids": response_ids,
            "finish_reason": finish_reason, "gen_params_id": gen_id}


def heldout_row(e: PoolEntry, gen_id: str) -> dict:
    """Held-out prompts are stored unanswered: evaluation generates their answers itself."""
    msgs = e.messages() + [{"role": "user", "content": t} for t in e.later_turns]
    return row(e, messages=msgs, prompt_ids=[], response_ids=[], finish_reason="", gen_id=gen_id)
