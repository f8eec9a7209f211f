"""Loss spans of the earlier assistant turns of a multi-turn conversation.

A regenerated multi-turn conversation is stored as the prompt (everything up to the last user turn,
the target's earlier answers included) plus the last answer. Every assistant turn is the target's own
on-policy output, so every one is trained on, not only the last. Their token spans inside the prompt
come from the chat template itself: the tokens of ``messages[:i]`` with the generation prompt open
the i-th (assistant) turn, those of ``messages[:i + 1]`` close it; the span ends after its last
end-of-turn token (template formatting after it, such as a newline, is not the model's output).
Some templates render the last assistant turn otherwise than an earlier one (gpt-oss's harmony format:
its analysis and ``<|return|>`` instead of the final channel and ``<|end|>``; Qwen3: its think block), so
``messages[:i + 1]`` is no prefix of the prompt: then the turn is read from the whole conversation as
rendered (checked equal to the prompt), and ends after its last end-of-turn token before the next
message's text (where two renderings part whose next message differs only in a letter appended to it).

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
    spans, whole = [], None
    for i, m in enumerate(messages[:-1]):
        if m.get("role") != "assistant":
            continue
        try:
            start = _ids(tokenizer, messages[:i], open_turn=True, kwargs=kw)
            end = _ids(tokenizer, messages[:i + 1], open_turn=False, kwargs=kw)
            if prompt_ids[:len(end)] != end and whole is None:  # the turn rendered as the last one differs
                whole = _ids(tokenizer, messages[:-1], open_turn=True, kwargs=kw)
        except (jinja2.TemplateError, ValueError):  # a template (changed since ingest?) that refuses the
            return None  # conversation; transformers' ValueError: an assistant turn first opens after no message
        if end[:len(start)] != start or prompt_ids[:len(start)] != start or len(end) <= len(start):
            return None
        if prompt_ids[:len(end)] == end:
            stop = len(end)
            while stop > len(start) + 1 and end[stop - 1] not in eos:
                stop -= 1
            spans.append((len(start), stop if end[stop - 1] in eos else len(end)))
            continue
        if whole != list(prompt_ids):  # the prompt is not this conversation: no span can be trusted
            return None
        stop = _last_end_before_next(tokenizer, messages, i, prompt_ids, kw, len(start), eos)
        if stop is None:
            return None
        spans.append((len(start), stop))
    return spans


def _last_end_before_next(tokenizer, messages, i, prompt_ids, kw, begin, eos) -> int | None:
    """End (exclusive) of the i-th (assistant) turn in ``prompt_ids``, the whole conversation as rendered: after
    its last end-of-turn token before the text of message ``i + 1``, found where the renderings of
    ``messages[:i + 2]`` with that message as it is and with a letter appended to it part. None where that
    message has no text to append to (content parts, a tool call) or the template refuses it."""
    nxt = messages[i + 1]
    if not isinstance(nxt.get("content"), str):
        return None
    try:
        same = _ids(tokenizer, messages[:i + 2], open_turn=False, kwargs=kw)
        other = _ids(tokenizer, [*messages[:i + 1], {**nxt, "content": nxt["content"] + " x"}], open_turn=False,
                     kwargs=kw)
    except (jinja2.TemplateError, ValueError):
        return None
    parted = next((k for k, (a, b) in enumerate(zip(same, other)) if a != b), min(len(same), len(other)))
    if same[:parted] != list(prompt_ids[:parted]):
        return None
    return next((k + 1 for k in range(parted - 1, begin - 1, -1) if prompt_ids[k] in eos), None)


def loss_mask(num_prompt: int, num_response: int, spans: list[tuple[int, int]]) -> list[int]:
    """1 on the response and on every span inside the prompt, 0 elsewhere."""
    mask = [0] * num_prompt + [1] * num_response
    for a, b in spans:
        mask[a:b] = [1] * (b - a)
    return mask
