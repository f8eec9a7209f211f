"""Long-context material whose answer depends on content far back, generated here (no downloads).

Three kinds (``evaluate.bucket_material``), each a chat prompt of an exact token length for the
target's tokenizer, with the reference answer and the token span of its evidence:

- ``records``: a registry of records (id, name, city, code); the question asks for one field of
  one record placed near the start of the registry.
- ``code``: a Python module of small helper functions; the question describes one helper defined
  near the start by its docstring and asks for a call to it, so the answer must reuse its name.
- ``recall``: a long multi-turn chat whose first turn states a fact and whose last question asks
  for it back. The turns between are held-out chats with the target's own answers when there are
  any (``buckets`` passes them), else generated ones.

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
import random

from eaglenest.errors import ConfigError

#: Generated kinds; ``chat`` (held-out chats, ``buckets``) is the fourth material kind.
KINDS = ("records", "code", "recall")

_FIRST = ("Alice", "Bruno", "Chen", "Dana", "Emil", "Farah", "Goran", "Hana", "Ivan", "Julia", "Kofi",
          "Lena", "Marco", "Nadia", "Omar", "Priya", "Rosa", "Sven", "Tara", "Yuki", "Anton", "Beatriz")
_LAST = ("Smith", "Novak", "Garcia", "Okafor", "Larsen", "Tanaka", "Moreau", "Silva", "Kim", "Berg",
         "Haddad", "Ivanova", "Mensah", "Quist")
_CITIES = ("Paris", "Lagos", "Osaka", "Lima", "Oslo", "Cairo", "Quito", "Perth", "Riga", "Dakar", "Hanoi",
           "Tunis", "Porto", "Cusco")
_VERBS = ("scale", "shift", "blend", "fold", "trim", "mix", "warp", "pack", "tune", "spin", "clip", "grow")
_NOUNS = ("orchid", "lantern", "harbor", "pebble", "comet", "meadow", "anvil", "falcon", "cedar", "quartz",
          "ember", "glacier")
_FACTS = (("locker code", lambda r: str(r.randint(1000, 9999))),
          ("room number", lambda r: str(r.randint(100, 999))),
          ("favourite city", lambda r: r.choice(_CITIES)),
          ("cat's name", lambda r: r.choice(("Miso", "Pepper", "Biscuit", "Luna", "Tofu", "Waffles"))))
_SMALL_TALK = (("What is {a} + {b}?", "{a} + {b} = {s}."),
               ("Name a city near the sea.", "{c} is a city near the sea."),
               ("Give me a number between {a} and {b}.", "{m} is between {a} and {b}."))


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


class _Records:
    """A registry; the question asks for the name, city or code of one record near its start."""

    pad_after_evidence = False

    def __init__(self, rng: random.Random, material) -> None:
        self.rng, self.used = rng, set()
        rid, rec = self._record()
        field = rng.choice(("name", "city", "code"))
        self.evidence = rec
        self.question = f"\nIn the registry above, what is the {field} of record {rid}?"
        self.answer = f"The {field} of record {rid} is {self.values[field]}."
        self.value = self.values[field]

    def _record(self) -> tuple[int, str]:
        rng = self.rng
        rid = rng.randint(10000, 99999)
        while rid in self.used:
            rid = rng.randint(10000, 99999)
        self.used.add(rid)
        self.values = {"name": f"{rng.choice(_FIRST)} {rng.choice(_LAST)}", "city": rng.choice(_CITIES),
                       "code": str(rng.randint(1000, 9999))}
        v = self.values
        return rid, f"Record {rid}: name {v['name']}, city {v['city']}, code {v['code']}.\n"

    def filler(self) -> str:
        return self._record()[1]

    def messages(self, units: list[str], at: int) -> list[dict]:
        body = "".join(units[:at]) + self.evidence + "".join(units[at:])
        return [{"role": "user", "content": "Below is a registry of records. A question about one of them "
                                            "follows.\n\n" + body + self.question}]


class _Code:
    """A module of helpers; the question describes one near the start and asks for a call to it."""

    pad_after_evidence = False

    def __init__(self, rng: random.Random, material) -> None:
        self.rng, self.names = rng, set()
        name, self.doc, self.evidence = self._function()
        x = rng.randint(2, 99)
        self.question = (f"```\nUsing the module above, write one line of Python that prints the result of "
                         f"the helper documented as \"{self.doc}\" applied to {x}.")
        self.answer = f"print({name}({x}))"
        self.value = name

    def _function(self) -> tuple[str, str, str]:
        rng = self.rng
        name = f"{rng.choice(_VERBS)}_{rng.choice(_NOUNS)}_{rng.randint(10, 999)}"
        while name in self.names:
            name = f"{rng.choice(_VERBS)}_{rng.choice(_NOUNS)}_{rng.randint(10, 999)}"
        self.names.add(name)
        m, a = rng.randint(2, 29), rng.randint(1, 99)
        if rng.random() < 0.5:
            doc, expr = f"Return value times {m} plus {a}.", f"value * {m} + {a}"
        else:
            doc, expr = f"Return value minus {a}, times {m}.", f"(value - {a}) * {m}"
        return name, doc, f"def {name}(value):\n    \"\"\"{doc}\"\"\"\n    return {expr}\n\n"

    def filler(self) -> str:
        while True:  # no other helper may carry the evidence's docstring
            _, doc, text = self._function()
            if doc != self.doc:
                return text

    def messages(self, units: list[str], at: int) -> list[dict]:
        body = "".join(units[:at]) + self.evidence + "".join(units[at:])
        return [{"role": "user", "content": "Here is a Python module.\n\n```python\n" + body + self.question}]


class _Recall:
    """A long chat: the first turn states a fact, the last question asks for it back."""

    pad_after_evidence = True

    def __init__(self, rng: random.Random, material) -> None:
        self.rng, self.material, self.order, self.passes = rng, list(material), [], 0
        first, last = rng.choice(_FIRST), rng.choice(_LAST)
        thing, draw = rng.choice(_FACTS)
        value = draw(rng)
        self.turn = (f"Hello, my name is {first} {last}. Please remember this for later: my {thing} is {value}.",
                     f"Nice to meet you, {first}. I will remember that your {thing} is {value}.")
        self.evidence = self.turn[0]
        self.question = f"At the very start of this chat I told you my {thing}. What is my {thing}?"
        self.answer = f"Your {thing} is {value}."
        self.value = str(value)

    def filler(self) -> tuple[str, str]:
        if self.material:  # held-out chats in a new seeded order each pass
            if not self.order:
                self.order = list(range(len(self.material)))
                self.rng.shuffle(self.order)
                self.passes += 1
            msgs, answer = self.material[self.order.pop()]
            user = [m["content"] for m in msgs if m["role"] == "user"][-1]
            return user, answer
        q, a = self.rng.choice(_SMALL_TALK)
        x, y = sorted(self.rng.sample(range(10, 99), 2))
        kw = dict(a=x, b=y, s=x + y, c=self.rng.choice(_CITIES), m=self.rng.randint(x, y))
        return q.format(**kw), a.format(**kw)

    def messages(self, units: list[tuple[str, str]], at: int) -> list[dict]:
        turns = [self.turn, *units]
        msgs = [{"role": r, "content": c} for u, a in turns for r, c in (("user", u), ("assistant", a))]
        return msgs + [{"role": "user", "content": self.question}]


_SPECS = {"records": _Records, "code": _Code, "recall": _Recall}


def _unit_text(unit) -> str:
    return unit if isinstance(unit, str) else "\n".join(unit)


class _Encoded:
    """A rendered chat prompt: its text, token ids and each token's character offsets."""

    def __init__(self, tok, messages: list[dict], chat_template_kwargs: dict | None) -> None:
        self.text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                            **(chat_template_kwargs or {}))
        enc = tok(self.text, add_special_tokens=False, return_offsets_mapping=True)
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
    if kind not in _SPECS:
        raise ConfigError(f"evaluate.bucket_material: unknown kind {kind!r} (known: {', '.join(KINDS)}, chat)")
    if not getattr(tok, "is_fast", False):
        raise ConfigError("evaluate.bucket_material: generated kinds need a fast tokenizer (offsets); "
                          "use evaluate.bucket_material=[chat]")
    rng = random.Random(f"longctx:{kind}:{seed}")
    spec = _SPECS[kind](rng, material)
    base = len(_Encoded(tok, spec.messages([], 0), chat_template_kwargs).ids)
    per_unit = _unit_overhead(tok, spec, chat_template_kwargs, base)
    units, total = [], base
    while total < length:
        units.append(spec.filler())
        total += len(tok(_unit_text(units[-1]), add_special_tokens=False)["input_ids"]) + per_unit
    # Evidence near the start of the filler: 3-12% of the way in (recall: the first turn, always).
    at = 0 if spec.pad_after_evidence else max(1, round(rng.uniform(0.03, 0.12) * len(units)))
    enc = _Encoded(tok, spec.messages(units, at), chat_template_kwargs)
    while len(enc.ids) > length and len(units) > max(at, 1):
        units.pop()
        enc = _Encoded(tok, spec.messages(units, at), chat_template_kwargs)
    if len(enc.ids) > length or len(units) < max(at, 1):
        raise ConfigError(f"evaluate.context_buckets: {length} tokens is too short for "
                          f"evaluate.bucket_material kind {kind!r} (its question and evidence alone take {base})")
    ev = enc.span(spec.evidence)
    if kind == "recall":  # the assistant's acknowledgement repeats the fact: evidence too
        ev = (ev[0], enc.span(spec.turn[1], enc.text.find(spec.evidence))[1])
    anchor = _unit_text(units[0]).split("\n")[0]
    cut = enc.span(anchor, enc.text.find(spec.evidence) + len(spec.evidence) if spec.pad_after_evidence
                   else enc.text.find(anchor))[0]
    need = length - len(enc.ids)
    pad: list[int] = []
    while len(pad) < need:  # the tail of further filler units
        unit = spec.filler()
        pad = list(tok(_unit_text(unit) + ("\n" if kind == "recall" else ""), add_special_tokens=False)["input_ids"]) + pad
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
    return max(0, with_unit - base - len(tok(_unit_text(probe), add_special_tokens=False)["input_ids"]))
