"""Composition rules: long multi-turn conversations built from a domain's prompts.

A domain with ``compose: {rule: long_chat, target_tokens: [...]}`` does not send its rows as they
are: :func:`compose` turns them into conversations of about each target length. The first user
turn states a fact ("please remember: my locker code is 4821") before its prompt; the turns between
are the domain's prompts; the last turn asks for the fact back. Every assistant turn is left empty
here: ingest regenerates them on-policy, turn by turn (``regen.py``), so the stored row is the
target's own long conversation, and its last answer depends on the first turn, thousands of tokens
back (real far dependence, not unrelated chats glued together).

Length is budgeted before any answer exists: each turn counts its prompt's tokens, a template
overhead and ``answer_tokens`` for the answer to come (default: ``generation.max_tokens``, an
upper bound), and turns are added while the budget stays within the target. So a stored
conversation holds at most about its target (the last answer may run to ``max_tokens``), and less
when the target's answers are shorter than budgeted: lower ``answer_tokens`` towards the target's
mean answer length to land closer.

The ``documents`` rule takes no rows: it generates long single-turn prompts, a registry of
records or a module of helper functions (``eaglenest.material``, the kinds the evaluation's context
buckets are made of) with a closing question about a record or helper near the start, each filled
to about its target length (the question's answer budgeted as above). Seeds are named after the
domain, length and index, never the evaluation's, so no training document is an evaluation prompt;
the target answers on-policy at ingest like any prompt.

Pure: an Arrow record batch of the domain's rows in, one of conversations out. The turn order of a
conversation is a seeded shuffle of the rows in content-hash order, so neither file order nor a
random state changes what is composed; conversations of one domain may share prompts (each draws
its own order), so the number of conversations does not depend on the number of rows.
"""

from __future__ import annotations

import random
from typing import Callable

from eaglenest.errors import ManifestError
from eaglenest.material import DOCUMENT_KINDS, document
from eaglenest.text import content_key, conversation_key, is_blank, normalise

#: Template tokens one user turn plus its answer add beyond their text (role markers, end marks);
#: an estimate, checked on the tiny target's template (8 there).
TURN_OVERHEAD_TOKENS = 8

_THINGS = (("my locker code", lambda r: str(r.randint(1000, 9999))),
           ("my room number", lambda r: str(r.randint(100, 999))),
           ("the name of my cat", lambda r: r.choice(("Miso", "Pepper", "Biscuit", "Luna", "Tofu", "Waffles"))),
           ("the city I was born in", lambda r: r.choice(("Paris", "Lagos", "Osaka", "Lima", "Oslo", "Quito"))),
           ("my train number", lambda r: f"{r.choice('ABCDEFGH')}{r.randint(10, 99)}"))

COLUMNS = ("prompt", "system", "later_turns", "source")
#: The ``source`` of a long_chat conversation is ``compose:long_chat:<length>``; its first user turn is
#: the fact preamble, a blank line, then a prompt.
LONG_CHAT = "compose:long_chat"


def schema():
    """The Arrow schema of :func:`compose`'s input and output batches (the pool's row fields)."""
    import pyarrow as pa

    return pa.schema([("prompt", pa.string()), ("system", pa.string()), ("later_turns", pa.list_(pa.string())),
                      ("source", pa.string())])


def fact(rng: random.Random) -> tuple[str, str, str]:
    """``(first-turn preamble, last question, expected answer)`` for one conversation."""
    thing, draw = rng.choice(_THINGS)
    value = draw(rng)
    return (f"Please remember this for later: {thing} is {value}.",
            f"At the very start of this chat I told you {thing}. What is it? Answer in one sentence.",
            f"{thing[0].upper()}{thing[1:]} is {value}.")


def compose(batch, *, domain: str, rule: str, target_tokens: list[int], per_length: int,
            answer_tokens: int, count_tokens: Callable[[str], int], seed: int = 0,
            kinds: list[str] | None = None):
    """The conversations of ``domain`` (a ``pyarrow.RecordBatch`` with :data:`COLUMNS`), as a batch
    of the same columns: ``per_length`` conversations per entry of ``target_tokens`` (``documents``:
    per kind and length, ``batch`` unused).

    Raises :class:`ManifestError` naming ``domains.<domain>.compose...`` when the rows are empty
    or a target length cannot hold the fact, one prompt and the question."""
    import pyarrow as pa

    where = f"domains.{domain}.compose"
    if rule == "documents":
        return _documents(domain=domain, kinds=list(kinds or DOCUMENT_KINDS), target_tokens=target_tokens,
                          per_length=per_length, answer_tokens=answer_tokens, count_tokens=count_tokens, seed=seed)
    if rule != "long_chat":
        raise ManifestError(f"{where}.rule: {rule!r} is not a composition rule (known: long_chat, documents)")
    units = _units(batch.to_pylist())
    if not units:
        raise ManifestError(f"{where}: domain {domain!r} has no prompts to compose conversations from")
    cost = [sum(count_tokens(t) + TURN_OVERHEAD_TOKENS + answer_tokens for t in turns) for turns, _ in units]
    out = {c: [] for c in COLUMNS}
    for length in target_tokens:
        for index in range(per_length):
            rng = random.Random(f"compose:{rule}:{domain}:{length}:{index}:{seed}")
            preamble, question, _ = fact(rng)
            order = list(range(len(units)))
            rng.shuffle(order)
            system = units[order[0]][1]
            # the preamble rides on turn 1's text; the question is a turn of its own, with its answer
            used = (count_tokens(system) + count_tokens(preamble) + count_tokens(question)
                    + TURN_OVERHEAD_TOKENS + answer_tokens)
            turns: list[str] = []
            while any(used + c <= length for c in cost):  # each pass adds a prompt: it ends
                for k in order:  # rows repeat, in a new order, in a chat longer than all of them
                    if used + cost[k] <= length:
                        used += cost[k]
                        turns += units[k][0]
                rng.shuffle(order)
            if not turns:
                raise ManifestError(f"{where}.target_tokens: {length} tokens cannot hold the fact, one prompt "
                                    f"and the question with answers of {answer_tokens} tokens; raise it (or "
                                    "lower compose.answer_tokens)")
            out["prompt"].append(f"{preamble}\n\n{turns[0]}")
            out["later_turns"].append([*turns[1:], question])
            out["system"].append(system)
            out["source"].append(f"compose:{rule}:{length}")
    return pa.RecordBatch.from_pydict(out, schema=schema())


def prompts_of(source: str, turns: list[str]) -> list[str]:
    """The user ``turns`` of a pool entry from ``source``, and for a ``long_chat`` conversation the prompt
    its first turn holds after the fact preamble as well: the contamination check compares each with the
    evaluation and held-out prompts (the whole first turn never equals one)."""
    if source.startswith(f"{LONG_CHAT}:") and turns and "\n\n" in turns[0]:
        return [*turns, turns[0].split("\n\n", 1)[1]]
    return turns


def _units(rows: list[dict]) -> list[tuple[list[str], str]]:
    """``(user turns, system prompt)`` of each row, in content-hash order (not file order). Rows with
    a blank turn are left out: the pool drops a conversation holding one as empty, whole."""
    units = [([r["prompt"], *(r.get("later_turns") or [])], r.get("system") or "") for r in rows]
    units = [u for u in units if not any(is_blank(normalise(t)) for t in u[0])]
    # scheme 1's key, as ever: another order would compose other conversations, stored again under new ids
    return sorted(units, key=lambda u: conversation_key(u[1], u[0], scheme=1))


def _documents(*, domain: str, kinds: list[str], target_tokens: list[int], per_length: int, answer_tokens: int,
               count_tokens: Callable[[str], int], seed: int):
    """The ``documents`` rule: ``per_length`` documents of each kind per target length, one user
    turn each, its text within the length less the answer's budget and a turn's overhead."""
    import pyarrow as pa

    out = {c: [] for c in COLUMNS}
    for length in target_tokens:
        for index in range(per_length):
            for kind in kinds:
                try:
                    text = document(kind, seed=f"{domain}:{length}:{index}:{seed}",
                                    tokens=length - answer_tokens - TURN_OVERHEAD_TOKENS, count_tokens=count_tokens)
                except ValueError as exc:
                    raise ManifestError(f"domains.{domain}.compose.target_tokens: {length}: {exc}; raise it "
                                        "(or lower compose.answer_tokens)") from None
                out["prompt"].append(text)
                out["system"].append("")
                out["later_turns"].append([])
                out["source"].append(f"compose:documents:{kind}:{length}")
    return pa.RecordBatch.from_pydict(out, schema=schema())


def rows_batch(rows: list[dict]):
    """Loaded source rows (``pool.load_source``'s dicts) as the record batch :func:`compose` reads."""
    import pyarrow as pa

    return pa.RecordBatch.from_pydict(
        {"prompt": [r["prompt"] for r in rows], "system": [r.get("system") or "" for r in rows],
         "later_turns": [list(r.get("later_turns") or []) for r in rows],
         "source": [r.get("source", "") for r in rows]}, schema=schema())


def apply(manifest, loaded: dict[str, list[dict]], *, count_tokens: Callable[[str], int] | None,
          held_out: set[str] = frozenset()) -> dict[str, list[dict]]:
    """``loaded`` (rows per domain) with every composed domain's rows replaced by its conversations.
    Rows with a user turn whose ``content_key`` is in ``held_out`` (prompts another domain keeps
    for evaluation, and those of the evaluation sets) are left out, so no held-out or evaluation prompt is
    trained on inside a long chat."""
    out = dict(loaded)
    for name, d in manifest.domains.items():
        c = d.compose
        if c is None:
            continue
        if count_tokens is None:
            raise ManifestError(f"domains.{name}.compose: needs the target's tokenizer (run.target)")
        rows = [r for r in loaded.get(name, [])
                if not any(content_key(t) in held_out for t in [r["prompt"], *(r.get("later_turns") or [])])]
        batch = compose(rows_batch(rows), domain=name, rule=c.rule, target_tokens=c.target_tokens,
                        per_length=c.per_length, answer_tokens=c.answer_tokens or manifest.generation.max_tokens,
                        count_tokens=count_tokens, seed=manifest.generation.seed, kinds=c.kinds)
        out[name] = batch.to_pylist()
    return out


def longest_tokens(manifest) -> int:
    """The longest conversation any composed domain asks for, its last answer included (0: none)."""
    return max((max(d.compose.target_tokens) + manifest.generation.max_tokens
                for d in manifest.domains.values() if d.compose is not None and d.compose.target_tokens), default=0)
