"""Loss spans of the earlier assistant turns of a multi-turn conversation.

A regenerated multi-turn conversation is stored as the prompt (everything up to the last user turn,
the target's earlier answers included) plus the last answer. Every assistant turn is the target's own
on-policy output, so every one is trained on, not only the last. Their token spans inside the prompt
come from the chat template itself: the tokens of ``messages[:i]`` with the generation prompt open
the i-th (assistant) turn, those of ``messages[:i + 1]`` close it; the span ends after its last
end-of-turn token (template formatting after it, such as a newline, is not the model's output).

Pure functions of (tokenizer, messages, prompt ids): no I/O.
"""

from __future__ import annotations

import jinja2


def _ids(tokenizer, messages: list[dict], *, open_turn: bool, kwargs: dict) -> list[int]:
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=open_turn, tokenize=True, **kwargs)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def assistant_spans(tokenizer, messages: list[dict], prompt_ids: list[int],
                    chat_template_kwargs: dict | None = None, *, end_ids=()) -> list[tuple[int, int]] | None:
    """``[(start, end), ...]`` token spans of the assistant turns before the last message, or None
    when the template, rendered with ``chat_template_kwargs`` (those ingest rendered the prompt
    with, e.g. a reasoning mode), does not reproduce ``prompt_ids`` as a prefix or refuses the
    conversation (a role it does not take: a template changed since ingest); the caller then trains
    on the last answer only. End-of-turn tokens: the tokenizer's eos, ``<|end|>`` and ``end_ids``
    (the ids generation stops at: generation_config.json's ``eos_token_id``, e.g. Gemma's
    ``<end_of_turn>`` beside its ``<eos>``)."""
    kw = dict(chat_template_kwargs or {})
    if sum(m.get("role") == "assistant" for m in messages) < 2:
        return []
    eos = {t for t in (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|end|>"), *end_ids)
           if isinstance(t, int)}
    spans = []
    for i, m in enumerate(messages[:-1]):
        if m.get("role") != "assistant":
            continue
        try:
            start = _ids(tokenizer, messages[:i], open_turn=True, kwargs=kw)
            end = _ids(tokenizer, messages[:i + 1], open_turn=False, kwargs=kw)
        except (jinja2.TemplateError, ValueError):  # a template (changed since ingest?) that refuses the
            return None  # conversation; transformers' ValueError: an assistant turn first opens after no message
        if end[:len(start)] != start or prompt_ids[:len(end)] != end or len(end) <= len(start):
            return None
        stop = len(end)
        while stop > len(start) + 1 and end[stop - 1] not in eos:
            stop -= 1
        spans.append((len(start), stop if end[stop - 1] in eos else len(end)))
    return spans


def loss_mask(num_prompt: int, num_response: int, spans: list[tuple[int, int]]) -> list[int]:
    """1 on the response and on every span inside the prompt, 0 elsewhere."""
    mask = [0] * num_prompt + [1] * num_response
    for a, b in spans:
        mask[a:b] = [1] * (b - a)
    return mask
