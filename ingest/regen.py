"""On-policy regeneration: the target answers the pool's prompts through its exact chat template.

Chat prompts go through ``LLM.chat`` (vLLM renders the target's own template); raw prompts through
``LLM.generate`` as plain documents. Both keep vLLM's own prompt and response token ids, so the
feature store later captures exactly the tokens the target produced (no re-tokenisation drift).
"""

from __future__ import annotations

import hashlib
import json
import logging

from eaglenest.ingest.manifest import Generation
from eaglenest.ingest.pool import PoolEntry, raw_text

log = logging.getLogger(__name__)


def gen_params_id(gen: Generation, chat_template: str) -> str:
    """Identity of how responses were produced (sampling + template), stored with every row."""
    blob = json.dumps({"temperature": gen.temperature, "max_tokens": gen.max_tokens, "seed": gen.seed,
                       "chat_template_sha256": hashlib.sha256(chat_template.encode()).hexdigest()},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def sampling_params(gen: Generation):
    from vllm import SamplingParams

    return SamplingParams(temperature=gen.temperature, max_tokens=gen.max_tokens, seed=gen.seed)


def regenerate(llm, entries: list[PoolEntry], gen: Generation, gen_id: str) -> list[dict]:
    """Rows for the prompts table, one per entry, in order."""
    params = sampling_params(gen)
    chat = [e for e in entries if e.mode == "chat"]
    raw = [e for e in entries if e.mode == "raw"]
    results: dict[str, tuple] = {}
    if chat:
        outs = llm.chat([e.messages() for e in chat], params, use_tqdm=False)
        results.update({e.sample_id: (e.messages(), o) for e, o in zip(chat, outs)})
    if raw:
        outs = llm.generate([raw_text(e) for e in raw], params, use_tqdm=False)
        results.update({e.sample_id: ([{"role": "document", "content": raw_text(e)}], o)
                        for e, o in zip(raw, outs)})
    rows = []
    for e in entries:
        messages, out = results[e.sample_id]
        completion = out.outputs[0]
        messages = messages + [{"role": "assistant", "content": completion.text}]
        rows.append(row(e, messages=messages, prompt_ids=list(out.prompt_token_ids),
                        response_ids=list(completion.token_ids),
                        finish_reason=str(completion.finish_reason or ""), gen_id=gen_id))
    return rows


def row(e: PoolEntry, *, messages: list[dict], prompt_ids: list[int], response_ids: list[int],
        finish_reason: str, gen_id: str) -> dict:
    return {"sample_id": e.sample_id, "domain": e.domain, "source": e.source, "split": e.split,
            "mode": e.mode, "messages_json": json.dumps(messages, ensure_ascii=False),
            "prompt_token_ids": prompt_ids, "response_token_ids": response_ids,
            "finish_reason": finish_reason, "gen_params_id": gen_id}


def heldout_row(e: PoolEntry, gen_id: str) -> dict:
    """Held-out prompts are stored unanswered: evaluation generates their answers itself."""
    return row(e, messages=e.messages(), prompt_ids=[], response_ids=[], finish_reason="", gen_id=gen_id)
