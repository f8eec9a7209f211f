"""Long-context material whose answer depends on content far back, generated here (no downloads).

Three kinds (``evaluate.bucket_material``; their units and questions are ``eaglenest.material``'s),
each a chat prompt of an exact token length for the target's tokenizer, with the reference answer
and the token span of its evidence:

- ``records``: a registry of records (id, name, city, code); the question asks for one field of
  one record placed near the start of the registry.
- ``code``: a Python module of small helper functions; the question describes one helper defined
  near the start by its docstring and asks for a call to it, so the answer must reuse its name.
- ``recall``: a long multi-turn chat whose first turn states a fact and whose last question asks
  for it back. The turns between are held-out chats with the target's own answers when there are
  any (``buckets`` passes them), else generated ones (also where a held-out turn does not fit the prompt's
  length: the plan checked the buckets with generated turns, before the answers were decoded).

(``chat``, the fourth kind, is ``buckets``' held-out chats concatenated: no long-range dependence.)

Everything is drawn from one ``random.Random`` seeded by (seed, kind), so a seed and a tokenizer
give the same ids on every machine. The key a question asks about (a record id, a docstring, the
first turn's fact) occurs in the evidence and in the question only.

Trade-off, exact length: filler units (records, functions, turns) are added while they fit; the
few tokens still missing are the tail of one more filler unit, spliced in as token ids at the start
of the filler (so the registry or module starts mid-unit, like a sliding window, and the evidence
and question stay whole). Spliced ids need not be the tokenizer's own split of that text, as in
``buckets``' cut histories. Locating text needs a fast tokenizer (offset mapping).
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import logging
import random

from eaglenest.errors import ConfigError
from eaglenest.material import KINDS, SPECS, evidence_at, unit_text

__all__ = ["KINDS", "LongPrompt", "generate"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LongPrompt:
    """One prompt: token ids of an exact length, the reference answer, and where its evidence is."""

    kind: str
    prompt_token_ids: list[int]
    answer: str
    #: Token span [start, end) of the evidence the answer needs.
    evidence: tuple[int, int]
    #: Passes over the held-out material the filler took (0 when none was used).
    material_passes: int = 0
    #: The part of ``answer`` only the evidence supplies (the record's value, the helper's name,
    #: the stated fact): the tokens ``farctx`` scores with the far part kept and removed.
    answer_value: str = ""

    @property
    def evidence_distance_tokens(self) -> int:
        """Tokens between the end of the evidence and the end of the prompt (where the answer starts)."""
        return len(self.prompt_token_ids) - self.evidence[1]


def rendered(tok, messages: list[dict], chat_template_kwargs: dict | None) -> tuple[str, bool]:
    """``(text, add_special_tokens)`` of a prompt as vLLM decodes it: the target's chat template with the
    generation prompt (which writes its own special tokens), or, for a base model without a template, the
    messages' contents as one plain document, a blank line between them (a single turn: ingest's raw
    prompt), to which the tokenizer adds its special tokens (BOS) as ``LLM.generate`` does."""
    if not getattr(tok, "chat_template", None):
        return "\n\n".join(m["content"] for m in messages) + "\n", True
    return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                   **(chat_template_kwargs or {})), False


class _Encoded:
    """A rendered prompt (:func:`rendered`): its text, token ids and each token's character offsets."""

    def __init__(self, tok, messages: list[dict], chat_template_kwargs: dict | None) -> None:
        self.text, special = rendered(tok, messages, chat_template_kwargs)
        enc = tok(self.text, add_special_tokens=special, return_offsets_mapping=True, verbose=False)
        self.ids = list(enc["input_ids"])
        # Running max: some tokenizers give special tokens (0, 0) offsets; bisect needs sorted ends.
        self._ends = list(itertools.accumulate((e for _, e in enc["offset_mapping"]), max))

    def token_at(self, char: int) -> int:
        """Index of the token holding character ``char`` (the first token ending after it)."""
        return bisect.bisect_right(self._ends, char)

    def span(self, needle: str, start: int = 0) -> tuple[int, int]:
        """Token span of the first occurrence of ``needle`` at or after character ``start``."""
        at = self.text.find(needle, start)
        if at < 0:
            raise ConfigError("evaluate.bucket_material: the target's chat template changes the material's "
                              f"text ({needle[:40]!r} not found in the rendered prompt)")
        return self.token_at(at), self.token_at(at + len(needle) - 1) + 1


def generate(kind: str, tok, length: int, *, seed: int, material=(),
             chat_template_kwargs: dict | None = None) -> LongPrompt:
    """A ``kind`` prompt of exactly ``length`` tokens for ``tok`` (a fast tokenizer).

    ``material``: (prompt messages, answer text) pairs of held-out chats, the ``recall`` filler.
    """
    if kind not in SPECS:
        raise ConfigError(f"evaluate.bucket_material: unknown kind {kind!r} (known: {', '.join(KINDS)}, chat)")
    if not getattr(tok, "is_fast", False):
        raise ConfigError("evaluate.bucket_material: generated kinds need a fast tokenizer (offsets); "
                          "use evaluate.bucket_material=[chat]")
    rng = random.Random(f"longctx:{kind}:{seed}")
    spec = SPECS[kind](rng, material)
    base = len(_Encoded(tok, spec.messages([], 0), chat_template_kwargs).ids)
    per_unit = _unit_overhead(tok, spec, chat_template_kwargs, base)
    units, total = [], base
    while total < length:
        units.append(spec.filler())
        total += len(tok(unit_text(units[-1]), add_special_tokens=False, verbose=False)["input_ids"]) + per_unit
    # Evidence near the start of the filler: 3-12% of the way in (recall: the first turn, always).
    at = evidence_at(rng, spec, len(units))
    enc = _Encoded(tok, spec.messages(units, at), chat_template_kwargs)
    while len(enc.ids) > length and len(units) > max(at, 1):
        units.pop()
        enc = _Encoded(tok, spec.messages(units, at), chat_template_kwargs)
    if (len(enc.ids) > length or len(units) < max(at, 1)) and getattr(spec, "material", None):
        # A held-out turn longer than the room left (a short bucket, long answers): generated turns, as
        # ``buckets.check_generated`` checked this prompt with before the engine started (same question).
        log.warning("evaluate.context_buckets: %d tokens leave no room for a held-out turn in a %s prompt (seed %d): "
                    "generated turns instead", length, kind, seed)
        return generate(kind, tok, length, seed=seed, chat_template_kwargs=chat_template_kwargs)
    if len(enc.ids) > length or len(units) < max(at, 1):
        # The prompt with the filler the evidence needs beside it (one unit before it, or after it for recall):
        # its length, not the question's and evidence's alone, is what the bucket must reach.
        least = len(enc.ids) if len(units) >= max(at, 1) else \
            len(_Encoded(tok, spec.messages([spec.filler()], 0 if spec.pad_after_evidence else 1),
                         chat_template_kwargs).ids)
        raise ConfigError(f"evaluate.context_buckets: {length} tokens is too short for evaluate.bucket_material "
                          f"kind {kind!r}: its prompt needs at least {least} tokens (its question and evidence "
                          f"alone take {base})")
    ev = enc.span(spec.evidence)
    after = enc.text.find(spec.evidence) + len(spec.evidence)  # where the evidence's text ends
    if kind == "recall":  # the assistant's acknowledgement repeats the fact: evidence too
        ev = (ev[0], enc.span(spec.turn[1], after)[1])
        after = enc.text.find(spec.turn[1], after) + len(spec.turn[1])
    # The splice point: where the first filler unit's text begins, found by its first line with text, after the
    # evidence and its acknowledgement (recall) or anywhere (the units before the evidence). A blank first line
    # (a held-out turn starting with a newline) was found at once, and one the acknowledgement holds inside it:
    # both inside the first turn.
    anchor = next((line.strip() for unit in units for line in unit_text(unit).split("\n") if line.strip()),
                  spec.question)
    cut = enc.span(anchor, after if spec.pad_after_evidence else enc.text.find(anchor))[0]
    need = length - len(enc.ids)
    pad: list[int] = []
    while len(pad) < need:  # the tail of further filler units
        unit = spec.filler()
        text = unit_text(unit) + ("\n" if kind == "recall" else "")
        pad = list(tok(text, add_special_tokens=False, verbose=False)["input_ids"]) + pad
    pad = pad[len(pad) - need:] if need else []
    ids = enc.ids[:cut] + pad + enc.ids[cut:]
    if cut <= ev[0]:
        ev = (ev[0] + need, ev[1] + need)
    assert len(ids) == length, (len(ids), length)
    return LongPrompt(kind=kind, prompt_token_ids=ids, answer=spec.answer, evidence=ev,
                      material_passes=getattr(spec, "passes", 0), answer_value=spec.value)


def _unit_overhead(tok, spec, chat_template_kwargs, base: int) -> int:
    """Template tokens one filler unit adds beyond its own text: a chat turn's role markers for
    ``recall``; none for the units of one message (records, functions)."""
    if not spec.pad_after_evidence:
        return 0
    probe = ("Hello there.", "Hello.")
    with_unit = len(_Encoded(tok, spec.messages([probe], 0), chat_template_kwargs).ids)
    return max(0, with_unit - base - len(tok(unit_text(probe), add_special_tokens=False)["input_ids"]))
