"""Deterministic synthetic chat corpus for the tiny target LLM.

Four domains whose next-token predictability differs by construction, so that a draft model trained
on them shows clearly different acceptance per domain:

- ``arithmetic``: a worked sum, difference or product in one fixed format. Given the prompt, almost
  every response token is determined (most predictable).
- ``records``: a JSON record whose field values are all named in the prompt (copying plus a fixed
  structure).
- ``code``: a small Python function described in words, from templates with varied names and ops.
- ``prose``: a short story or description from a grammar with many free choices (least predictable).

Everything is drawn from one seeded :class:`random.Random`, so the same seed gives the same samples
on every machine. The trade-off: the language is small and artificial, which is what lets a ~2M
parameter model learn it in minutes on a CPU.
"""

from __future__ import annotations

import random
from typing import Callable, Iterator, Literal

Domain = Literal["arithmetic", "records", "code", "prose"]
DOMAINS: tuple[Domain, ...] = ("arithmetic", "records", "code", "prose")

# ---------------------------------------------------------------------------------------- arithmetic
_ARITH_SYSTEMS = ("You are a careful math tutor.", "Show your working.", "Answer step by step.")
_ARITH_ASKS = ("What is {a} {op} {b}?", "Compute {a} {op} {b}.", "Work out {a} {op} {b}.",
               "Calculate {a} {op} {b}, please.", "Can you solve {a} {op} {b}?")


def _add(rng: random.Random) -> tuple[int, str, int, str]:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    s1 = a % 10 + b % 10
    c1 = s1 // 10
    lines = [f"Add the ones: {a % 10} + {b % 10} = {s1}, write {s1 % 10} carry {c1}."]
    s2 = a // 10 + b // 10 + c1
    lines.append(f"Add the tens: {a // 10} + {b // 10} + {c1} = {s2}, write {s2}.")
    return a, "+", b, "\n".join(lines + [f"So {a} + {b} = {a + b}."])


def _sub(rng: random.Random) -> tuple[int, str, int, str]:
    a, b = sorted((rng.randint(10, 99), rng.randint(10, 99)), reverse=True)
    ao, bo = a % 10, b % 10
    borrow = int(ao < bo)
    if borrow:
        first = f"Subtract the ones: {ao} < {bo}, borrow 1: {ao + 10} - {bo} = {ao + 10 - bo}."
    else:
        first = f"Subtract the ones: {ao} - {bo} = {ao - bo}."
    tens = a // 10 - borrow - b // 10
    second = f"Subtract the tens: {a // 10} - {borrow} - {b // 10} = {tens}."
    return a, "-", b, "\n".join([first, second, f"So {a} - {b} = {a - b}."])


def _mul(rng: random.Random) -> tuple[int, str, int, str]:
    a, b = rng.randint(10, 99), rng.randint(2, 9)
    p1 = (a % 10) * b
    c1 = p1 // 10
    lines = [f"Multiply the ones: {a % 10} x {b} = {p1}, write {p1 % 10} carry {c1}."]
    p2 = (a // 10) * b + c1
    lines.append(f"Multiply the tens: {a // 10} x {b} + {c1} = {p2}, write {p2}.")
    return a, "x", b, "\n".join(lines + [f"So {a} x {b} = {a * b}."])


def arithmetic(rng: random.Random) -> dict:
    a, op, b, response = rng.choice((_add, _sub, _mul))(rng)
    prompt = rng.choice(_ARITH_ASKS).format(a=a, op=op, b=b)
    return _sample("arithmetic", rng, _ARITH_SYSTEMS, prompt, response)


# ------------------------------------------------------------------------------------------- records
_FIRST = ("Alice", "Bruno", "Chen", "Dana", "Emil", "Farah", "Goran", "Hana", "Ivan", "Julia", "Kofi",
          "Lena", "Marco", "Nadia", "Omar", "Priya", "Rosa", "Sven", "Tara", "Yuki")
_LAST = ("Smith", "Novak", "Garcia", "Okafor", "Larsen", "Tanaka", "Moreau", "Silva", "Kim", "Berg")
_CITIES = ("Paris", "Lagos", "Osaka", "Lima", "Oslo", "Cairo", "Quito", "Perth", "Riga", "Dakar")
_ITEMS = ("lamp", "kettle", "backpack", "chair", "notebook", "helmet", "blender", "tent", "mug")
_COLOURS = ("red", "blue", "green", "black", "white", "grey", "yellow")
_TITLES = ("The Quiet River", "Stone and Salt", "Paper Moons", "A Long Winter", "The Glass Road",
           "North of Noon", "Small Fires", "The Last Orchard")
_RECORD_SYSTEMS = ("Reply with JSON only.", "You output structured records.")


def _json(fields: list[tuple[str, object]]) -> str:
    body = ",\n".join(f'  "{k}": ' + (f'"{v}"' if isinstance(v, str) else str(v).lower()
                                       if isinstance(v, bool) else str(v)) for k, v in fields)
    return "{\n" + body + "\n}"


def records(rng: random.Random) -> dict:
    kind = rng.choice(("person", "product", "book"))
    if kind == "person":
        name = f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"
        fields = [("name", name), ("age", rng.randint(18, 90)), ("city", rng.choice(_CITIES)),
                  ("active", rng.random() < 0.5)]
        desc = (f"a person named {name}, age {fields[1][1]}, living in {fields[2][1]}, "
                f"active: {str(fields[3][1]).lower()}")
    elif kind == "product":
        item = rng.choice(_ITEMS)
        fields = [("item", item), ("colour", rng.choice(_COLOURS)), ("price", rng.randint(5, 500)),
                  ("stock", rng.randint(0, 99))]
        desc = f"a {fields[1][1]} {item} priced {fields[2][1]} with {fields[3][1]} in stock"
    else:
        title = rng.choice(_TITLES)
        author = f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"
        fields = [("title", title), ("author", author), ("year", rng.randint(1900, 2024)),
                  ("pages", rng.randint(80, 900))]
        desc = f'the book "{title}" by {author}, published {fields[2][1]}, {fields[3][1]} pages'
    ask = rng.choice(("Make a JSON record for {d}.", "Give me a structured record for {d}.",
                      "Write {d} as a JSON object."))
    return _sample("records", rng, _RECORD_SYSTEMS, ask.format(d=desc), _json(fields))


# ---------------------------------------------------------------------------------------------- code
_NOUNS = ("values", "items", "scores", "prices", "counts", "weights", "numbers", "sizes")
_OPS = (("multiplies each of the {noun} by {arg}", "*", "scale"),
        ("adds {arg} to each of the {noun}", "+", "shift"),
        ("subtracts {arg} from each of the {noun}", "-", "lower"))
_CODE_SYSTEMS = ("You write short Python functions.", "Answer with code only.")


def code(rng: random.Random) -> dict:
    noun, arg = rng.choice(_NOUNS), rng.choice(("factor", "amount", "k", "n"))
    item = rng.choice(("x", "v", "item", "value"))
    kind = rng.randrange(4)
    if kind == 0:
        verb, sym, stem = rng.choice(_OPS)
        name = f"{stem}_{noun}"
        ask = f"Write a Python function {name} that " + verb.format(noun=noun, arg=arg) + "."
        body = f"    return [{item} {sym} {arg} for {item} in {noun}]"
        sig = f"def {name}({noun}, {arg}):"
    elif kind == 1:
        name, limit = f"count_{noun}_above", rng.choice(("limit", "threshold", "cutoff"))
        ask = f"Write a Python function {name} that counts how many {noun} are above {limit}."
        sig = f"def {name}({noun}, {limit}):"
        body = (f"    total = 0\n    for {item} in {noun}:\n        if {item} > {limit}:\n"
                f"            total += 1\n    return total")
    elif kind == 2:
        name = f"{rng.choice(('sum', 'total'))}_{noun}"
        ask = f"Write a Python function {name} that returns the sum of the {noun}."
        sig = f"def {name}({noun}):"
        body = f"    total = 0\n    for {item} in {noun}:\n        total += {item}\n    return total"
    else:
        pick = rng.choice(("largest", "smallest"))
        name, cmp = f"{pick}_{noun[:-1]}", (">" if pick == "largest" else "<")
        ask = f"Write a Python function {name} that returns the {pick} of the {noun}."
        sig = f"def {name}({noun}):"
        body = (f"    best = {noun}[0]\n    for {item} in {noun}:\n        if {item} {cmp} best:\n"
                f"            best = {item}\n    return best")
    response = f"```python\n{sig}\n{body}\n```"
    return _sample("code", rng, _CODE_SYSTEMS, ask, response)


# --------------------------------------------------------------------------------------------- prose
_ANIMALS = ("fox", "heron", "bear", "otter", "owl", "wolf", "hare", "crow", "deer", "badger")
_PLACES = ("the forest", "the harbour", "the old mill", "the mountain pass", "the marsh",
           "the city park", "the desert", "the river bank", "the orchard", "the lighthouse")
_ADJ = ("quiet", "clever", "tired", "curious", "brave", "small", "restless", "gentle", "proud")
_TIMES = ("At dawn", "One evening", "Late at night", "In early spring", "After the storm",
          "On a cold morning", "At noon", "Before the rain")
_VERBS = ("wandered through", "watched", "listened to", "searched", "crossed", "circled",
          "remembered", "waited by")
_THINGS = ("the wind", "a lost key", "the falling leaves", "a distant bell", "an old song",
           "the first light", "a narrow path", "the silver water", "a broken fence")
_FEEL = ("felt calm", "grew hopeful", "was a little afraid", "laughed softly", "felt at home",
         "missed its friends", "forgot the cold", "understood at last")
_ENDS = ("and then it went home.", "and the day grew warm.", "and nobody saw it leave.",
         "and the world seemed new.", "and it slept until morning.", "and the sky cleared.")
_PROSE_SYSTEMS = ("You are a storyteller.", "Write vivid, short prose.")


def prose(rng: random.Random) -> dict:
    animal, place = rng.choice(_ANIMALS), rng.choice(_PLACES)
    ask = rng.choice(("Write a short story about {a} near {p}.", "Describe {a} at {p}.",
                      "Tell me a little tale about {a} by {p}."))
    adj = rng.choice(_ADJ)
    sents = [f"{rng.choice(_TIMES)}, {_a(adj)} {adj} {animal} {rng.choice(_VERBS)} {place}."]
    for _ in range(rng.randint(2, 4)):
        form = rng.randrange(3)
        if form == 0:
            sents.append(f"It {rng.choice(_VERBS)} {rng.choice(_THINGS)} and {rng.choice(_FEEL)}.")
        elif form == 1:
            sents.append(f"{rng.choice(_TIMES)}, the {animal} {rng.choice(_VERBS)} "
                         f"{rng.choice(_THINGS)}.")
        else:
            sents.append(f"The {rng.choice(_ADJ)} {animal} {rng.choice(_FEEL)}, "
                         f"{rng.choice(_ENDS)}")
    sents.append(f"In the end, the {animal} {rng.choice(_FEEL)} {rng.choice(_ENDS)}")
    return _sample("prose", rng, _PROSE_SYSTEMS, ask.format(a=f"{_a(animal)} {animal}", p=place),
                   " ".join(sents))


def _a(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


# ------------------------------------------------------------------------------------------- drivers
GENERATORS: dict[Domain, Callable[[random.Random], dict]] = {
    "arithmetic": arithmetic, "records": records, "code": code, "prose": prose}


def _sample(domain: Domain, rng: random.Random, systems: tuple[str, ...], prompt: str,
            response: str) -> dict:
    # A system prompt on about a third of samples, so the template's system role is exercised.
    sample = {"domain": domain, "prompt": prompt, "response": response}
    if rng.random() < 0.35:
        sample["system"] = rng.choice(systems)
    return sample


def generate(num_samples: int, *, seed: int, domains: tuple[Domain, ...] = DOMAINS) -> list[dict]:
    """``num_samples`` chat samples, domains in round-robin order; same seed, same list."""
    rng = random.Random(seed)
    return [GENERATORS[domains[i % len(domains)]](rng) for i in range(num_samples)]


def iter_domain(domain: Domain, *, seed: int) -> Iterator[dict]:
    """An endless deterministic stream of samples of one domain."""
    rng = random.Random(f"{domain}:{seed}")
    while True:
        yield GENERATORS[domain](rng)


def to_messages(sample: dict, *, with_response: bool = True) -> list[dict[str, str]]:
    """The sample as chat messages (system if present, user, and the assistant answer)."""
    msgs = [{"role": "system", "content": sample["system"]}] if sample.get("system") else []
    msgs.append({"role": "user", "content": sample["prompt"]})
    if with_response:
        msgs.append({"role": "assistant", "content": sample["response"]})
    return msgs


def to_raw_text(sample: dict) -> str:
    """The plain-document form: prompt, blank line, answer, no chat markup."""
    return f"{sample['prompt']}\n\n{sample['response']}"
