"""On-policy regeneration: the target answers the pool's prompts through its exact chat template.

Chat prompts are rendered by vLLM with the target's own template; raw prompts are sent as plain
documents. Requests stream through the backend (``submit`` / ``poll``), raw and chat mixed, with a
bounded number in flight, so the engine stays full across shard boundaries. Both keep vLLM's own
prompt and response token ids, so the feature store later captures exactly the tokens the target
produced (no re-tokenisation drift).

Multi-turn conversations are answered turn by turn, in order: turn ``t`` of a conversation is queued
as soon as turn ``t - 1`` is answered, its history holding the target's *own* earlier answers (as its
template takes them back: a harmony-format answer, gpt-oss's, as its ``final`` channel). The
stored row is the whole conversation in ``messages_json``; its token ids are those of the last turn
(prompt = the full rendered history, response = the last answer), so the loss covers the final
assistant turn while earlier on-policy answers are context. A request that fails (after the
backend's retries) drops its whole conversation from this run and is reported per prompt. A chat
answer cut off by ``max_tokens`` inside an open think block (``reasoning.ThinkCheck``) drops its
conversation too, as a :class:`Dropped` reason rather than a failure: it is counted per domain and
not retried (the same generation settings would cut it off again).
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Iterable, Iterator

from eaglenest.ingest.backends import Failure
from eaglenest.ingest.manifest import Generation
from eaglenest.ingest.pool import PoolEntry, raw_text

log = logging.getLogger(__name__)


class Dropped(str):
    """A reason a conversation was left out on purpose (not a failure): counted, not retried."""


THINKING_TRUNCATED = Dropped("thinking truncated: max_tokens reached inside an open think block")


def gen_params_id(gen: Generation, chat_template: str | dict, chat_template_kwargs: dict | None = None) -> str:
    """Identity of how responses were produced (sampling + template + the recipe's
    ``ingest.chat_template_kwargs``), stored with every row. ``chat_template``: the tokenizer's, a
    mapping for a target with named templates (a list in tokenizer_config.json: default, tool_use)."""
    text = chat_template if isinstance(chat_template, str) else json.dumps(chat_template, sort_keys=True)
    spec = {"temperature": gen.temperature, "max_tokens": gen.max_tokens, "seed": gen.seed,
            "chat_template_sha256": hashlib.sha256(text.encode()).hexdigest()}
    if gen.reasoning != "default":  # keeps ids of existing runs unchanged
        spec["reasoning"] = gen.reasoning
    if chat_template_kwargs:  # likewise: only present when set
        spec["chat_template_kwargs"] = chat_template_kwargs
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:16]


def stream(backend, entries: Iterable[PoolEntry], gen: Generation, gen_id: str, *, think=None
           ) -> Iterator[tuple[PoolEntry, dict | None, str | None]]:
    """``(entry, row, None)`` or ``(entry, None, error)`` for each entry, as its conversation finishes.
    ``error`` is a :class:`Dropped` for a chat answer ``think`` (a ``reasoning.ThinkCheck``) finds
    cut off inside its think block, at any turn.

    Keeps up to the backend's ``max_in_flight`` requests queued in it, raw and
    chat mixed, drawing new entries as others finish: the engine is never drained between batches.
    A multi-turn conversation's next turn is queued as soon as its previous answer is back.
    """
    window = max(1, getattr(backend, "max_in_flight", 64))
    todo = iter(entries)
    live: dict[str, tuple[PoolEntry, list[dict], int]] = {}  # sample_id -> (entry, messages, turn)
    exhausted = False
    try:
        while True:
            while not exhausted and len(live) < window:
                e = next(todo, None)
                if e is None:
                    exhausted = True
                elif e.mode == "raw":
                    text = raw_text(e)
                    live[e.sample_id] = (e, [{"role": "document", "content": text}], 0)
                    backend.submit(e.sample_id, "raw", text, gen)
                else:
                    live[e.sample_id] = (e, e.messages(), 0)
                    backend.submit(e.sample_id, "chat", live[e.sample_id][1], gen)
            if not live:
                return
            for sid, c in backend.poll():
                e, messages, turn = live.pop(sid)
                if isinstance(c, Failure):
                    yield e, None, (c.error if e.mode == "raw" else f"turn {turn}: {c.error}")
                    continue
                if think is not None and e.mode == "chat" and think.truncated(c.prompt_ids, c.response_ids,
                                                                              c.finish_reason):
                    yield e, None, THINKING_TRUNCATED
                    continue
                history = messages + [{"role": "assistant", "content": c.text}]
                if e.mode == "chat" and turn < len(e.later_turns):  # the target's own answer, then the next turn
                    said = think.history_text(c.response_ids, c.text) if think is not None else c.text
                    history[-1]["content"] = said  # as the template takes it back (gpt-oss: the final channel)
                    live[sid] = (e, history + [{"role": "user", "content": e.later_turns[turn]}], turn + 1)
                    backend.submit(sid, "chat", live[sid][1], gen)
                else:
                    yield e, row(e, messages=history, prompt_ids=c.prompt_ids, response_ids=c.response_ids,
                                 finish_reason=c.finish_reason, gen_id=gen_id), None
    finally:
        if live and hasattr(backend, "cancel"):  # stopped early (error, consumer gone): drop the rest
            backend.cancel()


def regenerate(backend, entries: list[PoolEntry], gen: Generation, gen_id: str, *, think=None,
               dropped: list | None = None) -> tuple[list[dict], list[dict]]:
    """``(rows, failures)``: rows for the prompts table in entry order, and ``{sample_id, error}``.
    Conversations dropped on purpose go to ``dropped`` (``{sample_id, domain, reason}``), if given."""
    done: dict[str, dict] = {}
    failures = []
    for e, r, err in stream(backend, entries, gen, gen_id, think=think):
        if isinstance(err, Dropped):
            if dropped is not None:
                dropped.append({"sample_id": e.sample_id, "domain": e.domain, "reason": str(err)})
        elif r is None:
            failures.append({"sample_id": e.sample_id, "error": err})
        else:
            done[e.sample_id] = r
    return [done[e.sample_id] for e in entries if e.sample_id in done], failures


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
