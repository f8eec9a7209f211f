"""Generated long material whose answer depends on content far back: the units and questions.

Three kinds, each built from one ``random.Random`` (the caller seeds it):

- ``records``: a registry of records (id, name, city, code); the question asks for one field of
  one record placed near the start of the registry.
- ``code``: a Python module of small helper functions; the question describes one helper defined
  near the start by its docstring and asks for a call to it, so the answer must reuse its name.
- ``recall``: a long multi-turn chat whose first turn states a fact and whose last question asks
  for it back; the turns between are the given chats (prompt messages, answer), else small talk.

A kind is a class: its ``evidence``, ``question``, ``answer`` and ``value`` (the part of the answer
only the evidence supplies), ``filler()`` (one more unit: a record, a function, a turn) and
``messages(units, at)`` (the chat, the evidence among the units at ``at``). Two users:
``evaluate.longctx`` makes bucket prompts of an exact token length from them; ``ingest``'s
``documents`` composition rule (:func:`document`) makes training prompts of about a length, from
seeds the evaluation never uses. Pure: no tokenizer, no I/O.
"""

from __future__ import annotations

import random
from typing import Callable

#: Every kind; :data:`DOCUMENT_KINDS` are the ones that are one user message (a document, a question).
KINDS = ("records", "code", "recall")
DOCUMENT_KINDS = ("records", "code")

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


SPECS = {"records": _Records, "code": _Code, "recall": _Recall}


def _unit_text(unit) -> str:
    return unit if isinstance(unit, str) else "\n".join(unit)


def unit_text(unit) -> str:
    """A filler unit's text (a recall turn is its question and answer)."""
    return unit if isinstance(unit, str) else "\n".join(unit)


def evidence_at(rng: random.Random, spec, units: int) -> int:
    """Where the evidence goes among ``units`` filler units: 3-12% of the way in (recall: the first
    turn, always)."""
    return 0 if spec.pad_after_evidence else max(1, round(rng.uniform(0.03, 0.12) * units))


def document(kind: str, *, seed: str, tokens: int, count_tokens: Callable[[str], int]) -> str:
    """The user message of a ``kind`` document (one of :data:`DOCUMENT_KINDS`):
    filler units while the message stays within ``tokens`` by ``count_tokens`` (text only, no chat
    template), the evidence 3-12% of the way in, the question last. Drawn from
    ``random.Random(f"document:{kind}:{seed}")``: the evaluation draws from ``longctx:...`` seeds,
    so no document is one of its prompts. Raises ``ValueError`` for a kind that is not a document or
    a length that cannot hold the question and the evidence."""
    if kind not in DOCUMENT_KINDS:
        raise ValueError(f"{kind!r} is not a document kind (known: {', '.join(DOCUMENT_KINDS)})")
    rng = random.Random(f"document:{kind}:{seed}")
    spec = SPECS[kind](rng, ())
    total = count_tokens(spec.messages([], 0)[0]["content"])
    if total > tokens:
        raise ValueError(f"{tokens} tokens cannot hold a {kind} document's question and evidence ({total})")
    units: list[str] = []
    while True:
        unit = spec.filler()
        cost = count_tokens(unit_text(unit))
        if total + cost > tokens:
            break
        units.append(unit)
        total += cost
    return spec.messages(units, evidence_at(rng, spec, len(units)))[0]["content"]
