"""The domain manifest: what prompts a run draws, from where, under which licence, how they are split.

Parsed with the YAML safe loader (no object construction) and validated into frozen dataclasses.
Validation collects *every* problem before reporting, each one line that starts with its dotted key
(``domains.code.sources[0].path: file not found``), so one ``ingest validate`` run shows all that a
manifest needs fixed: the structure goes through the recipes' own walker (``eaglenest.config.build``
with a ``problems`` list, which goes on past a bad key), then :func:`check` adds the semantic
problems. Validation happens before anything is written.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Literal

from eaglenest.config import build, load_yaml, short_text, to_dict
from eaglenest.engine import MAX_TEMPERATURE
from eaglenest.errors import ManifestError
from eaglenest.material import DOCUMENT_KINDS
from eaglenest.paths import shown_path, user_path
from eaglenest.text import DOMAIN_NAME

MANIFEST_VERSION = 1


class ManifestProblems(ManifestError):
    """Every problem of one manifest; ``str()`` is the first (after the manifest's file, when given: a
    command that reads a recipe too says which file holds the key), ``problems`` holds all of them."""

    def __init__(self, problems: list[str], *, path: str | Path | None = None):
        self.problems = list(problems)
        more = f" (and {len(problems) - 1} more: run `ingest validate`)" if len(problems) > 1 else ""
        where = f"{short_text(str(path), 200)}: " if path is not None else ""
        super().__init__(where + problems[0] + more)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Source:
    """One prompt source: a local JSONL/Parquet file (``path``) or a Hugging Face dataset (``hf_id``)."""

    path: str = ""
    hf_id: str = ""
    hf_config: str = ""
    hf_split: str = "train"
    #: Column holding the user prompt, and optionally a system prompt.
    field: str = "prompt"
    system_field: str = ""
    #: Column holding a whole conversation (list of {role, content}); replaces ``field`` when set.
    messages_field: str = ""
    licence: str = ""
    provenance: str = ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Generation:
    temperature: float = 0.0
    max_tokens: int = 160
    seed: int = 0
    #: Reasoning ("thinking") mode of chat templates that have one; "default" passes nothing.
    reasoning: Literal["default", "on", "off"] = "default"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Compose:
    """A composition rule: the domain's prompts become long conversations (``compose.py``)."""

    #: ``long_chat``: a multi-turn chat whose first turn states a fact and whose last asks it back.
    #: ``documents``: generated long documents (a registry of records, a module of helpers) whose
    #: closing question needs a record or helper near their start; the domain gives no sources.
    rule: Literal["long_chat", "documents"] = "long_chat"
    #: ``documents`` only: which kinds, each ``per_length`` times per length (null: records and code).
    kinds: list[str] | None = None
    #: Token lengths to compose conversations for (prompt turns + budgeted answers), e.g. [2048, 8192].
    target_tokens: list[int] = dataclasses.field(default_factory=list)
    #: Conversations composed per target length.
    per_length: int = 1
    #: Tokens budgeted for each answer while composing (null: generation.max_tokens, an upper bound).
    answer_tokens: int | None = None


#: Largest ``generation.seed``: vLLM seeds each request's generator with a signed 64-bit integer (a
#: larger one raised out of the engine's step, a traceback; its OpenAI server refuses it).
MAX_GENERATION_SEED = 2**63 - 1

#: Largest ``generation.max_tokens``: vLLM hands sampling parameters to its engine core as msgpack, whose
#: integers stop at 64 bits (a larger one failed every request, OverflowError, after the engine started); an
#: engine stops at its max_model_len anyway.
MAX_GENERATION_TOKENS = 2**63 - 1

#: Longest composed conversation accepted (tokens); an engine's positions are checked at build time.
MAX_COMPOSE_TOKENS = 1 << 20


@dataclasses.dataclass(frozen=True, kw_only=True)
class Domain:
    sources: list[Source]
    #: Most prompts kept from this domain (after deduplication), held-out ones included.
    cap_prompts: int | None = None
    #: Most prompt tokens (target tokenizer) kept from this domain; with ``cap_prompts`` both apply.
    cap_tokens: int | None = None
    #: Relative sampling weight of this domain in training mixtures (recorded; >= 0).
    weight: float = 1.0
    #: Overrides of the manifest-wide values for this domain (fraction or count, not both).
    held_out_fraction: float | None = None
    held_out_count: int | None = None
    raw_fraction: float | None = None
    #: Compose long conversations from this domain's prompts instead of sending them as they are.
    compose: Compose | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Contamination:
    """Evaluation sets whose prompts must not appear in the training split."""

    #: MT-Bench ``question.jsonl`` files (``turns`` lists) and SPEED-Bench style JSONL (``prompt``
    #: or ``turns``/``messages``); paths resolved like source paths.
    mt_bench: list[str] = dataclasses.field(default_factory=list)
    speed_bench: list[str] = dataclasses.field(default_factory=list)
    #: "drop" removes contaminated prompts from the pool; "error" refuses to build.
    action: Literal["drop", "error"] = "drop"
    #: Also flag near duplicates (word 5-gram Jaccard >= threshold) of eval prompts and within the pool.
    near_duplicate_threshold: float | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Dedup:
    """Near-duplicate removal inside the pool (exact duplicates are always removed)."""

    #: Drop a prompt whose word-shingle Jaccard similarity to an already kept prompt (in hash order,
    #: earlier domains first) is at least this; null: off. MinHash + LSH find candidates, exact
    #: Jaccard decides (eaglenest.ingest.neardup).
    near_duplicate_threshold: float | None = None
    #: Words per shingle.
    shingle_words: int = 5
    #: MinHash permutations (more: fewer missed pairs, slower signing).
    num_perm: int = 128


@dataclasses.dataclass(frozen=True, kw_only=True)
class Manifest:
    name: str
    domains: dict[str, Domain]
    version: int = MANIFEST_VERSION
    licence: str = ""
    #: Accept sources without licence/provenance fields (off: such a source is refused).
    allow_unlicensed: bool = False
    #: Share of each domain's prompts kept out of training for evaluation (by content hash).
    held_out_fraction: float = 0.2
    #: Exact number of held-out prompts per domain instead of a fraction (by content hash).
    held_out_count: int | None = None
    #: Share of training prompts regenerated as raw completions instead of through the chat template.
    raw_fraction: float = 0.2
    generation: Generation = Generation()
    contamination: Contamination = Contamination()
    dedup: Dedup = Dedup()

    def held_out(self, domain: str) -> tuple[str, float]:
        """("count", n) or ("fraction", f) for ``domain``; a domain override beats the manifest's."""
        d = self.domains[domain]
        if d.held_out_count is not None:
            return "count", d.held_out_count
        if d.held_out_fraction is not None:
            return "fraction", d.held_out_fraction
        if self.held_out_count is not None:
            return "count", self.held_out_count
        return "fraction", self.held_out_fraction

    def raw(self, domain: str) -> float:
        d = self.domains[domain].raw_fraction
        return self.raw_fraction if d is None else d

    def content_hash(self) -> str:
        d = to_dict(self)
        if self.dedup == Dedup():  # added after release: manifests without it keep their hash
            d.pop("dedup")
        for dom in d["domains"].values():  # likewise: domains without a composition rule keep theirs
            if dom.get("compose") is None:
                dom.pop("compose", None)
            elif dom["compose"].get("kinds") is None:  # and long_chat rules without kinds
                dom["compose"].pop("kinds", None)
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def load_manifest(path: str | Path, *, base_dir: str | Path | None = None) -> Manifest:
    """Load and fully validate a manifest; raise :class:`ManifestProblems` listing every problem."""
    manifest, problems = read_manifest(path, base_dir=base_dir)
    if problems:
        raise ManifestProblems(problems, path=path)
    return manifest


def read_manifest(path: str | Path, *, base_dir: str | Path | None = None) -> tuple[Manifest | None, list[str]]:
    """``(manifest, problems)``: every problem of the manifest at ``path``, and the manifest when its
    structure is sound (None otherwise), so ``ingest validate`` can read its sources beside semantic
    problems. A file that is no YAML mapping raises ManifestError."""
    if not str(path).strip():  # Path("") is ".": "is a directory" named neither the key nor the mistake
        raise ManifestError("ingest.manifest: no path given (it is empty); set it, or pass --manifest PATH")
    data = load_yaml(path, error=ManifestError)
    gen = data.get("generation")
    if isinstance(gen, dict) and isinstance(gen.get("reasoning"), bool):  # YAML 1.1 reads `off` as False
        gen["reasoning"] = "on" if gen["reasoning"] else "off"
    problems: list[str] = []
    if "held_out_fraction" in data and data["held_out_fraction"] is None and data.get("held_out_count") is not None:
        del data["held_out_fraction"]  # null beside a count: "not this one", as a domain's null is
    if data.get("held_out_fraction") is not None and data.get("held_out_count") is not None:  # as in a domain
        problems.append("held_out_count: give held_out_fraction or held_out_count, not both")
    manifest = build(Manifest, data, error=ManifestError, problems=problems)
    if manifest is not None:
        problems += check(manifest, base_dir=base_dir)
    return manifest, problems


def validate(m: Manifest, *, base_dir: str | Path | None = None) -> None:
    problems = check(m, base_dir=base_dir)
    if problems:
        raise ManifestProblems(problems)


def check(m: Manifest, *, base_dir: str | Path | None = None) -> list[str]:
    """Semantic checks of a structurally valid manifest: every problem, one line each, key first."""
    p: list[str] = []
    if not m.name.strip():
        p.append("name: required, and blank: give the manifest a name (it goes into every commit's lineage)")
    p += _blank_licence("licence", m.licence)
    if m.version != MANIFEST_VERSION:
        p.append(f"version: manifest version {m.version}, this eaglenest reads {MANIFEST_VERSION}")
    if not m.domains:
        p.append("domains: at least one domain is required")
    p += _fraction("held_out_fraction", m.held_out_fraction)
    p += _fraction("raw_fraction", m.raw_fraction, upto_one=True)
    if m.held_out_count is not None and m.held_out_count < 0:
        p.append(f"held_out_count: {m.held_out_count} is negative")
    g = m.generation
    if g.max_tokens < 1:
        p.append("generation.max_tokens: must be at least 1")
    elif g.max_tokens > MAX_GENERATION_TOKENS:
        p.append(f"generation.max_tokens: {g.max_tokens} is more than {MAX_GENERATION_TOKENS} (an engine stops at "
                 "its max_model_len anyway)")
    if not 0 <= g.seed <= MAX_GENERATION_SEED:  # -1 is vLLM's "no seed": responses would not repeat
        p.append(f"generation.seed: {g.seed} is not in [0, {MAX_GENERATION_SEED}]")
    if not 0.0 <= g.temperature <= MAX_TEMPERATURE:  # vLLM's SamplingParams bounds (NaN fails too)
        p.append(f"generation.temperature: {g.temperature} is not in [0, {MAX_TEMPERATURE:g}]")
    c = m.contamination
    if c.near_duplicate_threshold is not None and not 0.0 < c.near_duplicate_threshold <= 1.0:
        p.append(f"contamination.near_duplicate_threshold: {c.near_duplicate_threshold} is not in (0, 1]")
    dd = m.dedup
    if dd.near_duplicate_threshold is not None and not 0.0 < dd.near_duplicate_threshold <= 1.0:
        p.append(f"dedup.near_duplicate_threshold: {dd.near_duplicate_threshold} is not in (0, 1]")
    if dd.shingle_words < 1:
        p.append("dedup.shingle_words: must be at least 1")
    if not 8 <= dd.num_perm <= 1024:
        p.append(f"dedup.num_perm: {dd.num_perm} is not in [8, 1024]")
    for kind in ("mt_bench", "speed_bench"):
        for i, path in enumerate(getattr(c, kind)):
            try:
                input_file(path, base_dir, key=f"contamination.{kind}[{i}]")
            except ManifestError as exc:
                p.append(str(exc))
    first_of: dict[str, str] = {}  # lower-cased name -> the first domain so named
    for name, d in m.domains.items():
        where = f"domains.{short_text(name)}"  # a name with a newline stays one line
        twin = first_of.setdefault(name.lower(), name)
        if twin != name:  # one domain typed twice? two ids, caps and rows of stats that read as one
            p.append(f"{where}: the same name as domains.{short_text(twin)} but for letter case; give each domain "
                     "its own name (or merge their sources into one domain)")
        if not DOMAIN_NAME.fullmatch(name):  # ASCII: names go into sample ids and file names
            p.append(f"{where}: domain names use ASCII letters, digits, '-' and '_'")
        if d.cap_prompts is None and d.cap_tokens is None:
            p.append(f"{where}.cap_prompts: required key is missing (give cap_prompts and/or cap_tokens)")
        for key in ("cap_prompts", "cap_tokens"):
            v = getattr(d, key)
            if v is not None and v < 1:
                p.append(f"{where}.{key}: must be at least 1")
        if d.weight < 0:
            p.append(f"{where}.weight: {d.weight} is negative")
        if d.held_out_fraction is not None:
            p += _fraction(f"{where}.held_out_fraction", d.held_out_fraction)
            if d.held_out_count is not None:
                p.append(f"{where}.held_out_count: give held_out_fraction or held_out_count, not both")
        if d.held_out_count is not None and d.held_out_count < 0:
            p.append(f"{where}.held_out_count: {d.held_out_count} is negative")
        if d.raw_fraction is not None:
            p += _fraction(f"{where}.raw_fraction", d.raw_fraction, upto_one=True)
        generated = d.compose is not None and d.compose.rule == "documents"
        if not d.sources and not generated:
            p.append(f"{where}.sources: at least one source is required")
        if d.sources and generated:
            p.append(f"{where}.sources: compose.rule documents generates its prompts; give no sources "
                     "(sources: [])")
        if d.compose is not None:
            p += _check_compose(f"{where}.compose", d.compose)
            p += _check_composed_heldout(where, d, m.held_out(name))
        for i, s in enumerate(d.sources):
            p += _check_source(f"{where}.sources[{i}]", s, m, base_dir)
    return p


def _check_compose(where: str, c: Compose) -> list[str]:
    p = []
    if not c.target_tokens:
        p.append(f"{where}.target_tokens: give at least one length, e.g. [2048, 8192]")
    for i, n in enumerate(c.target_tokens):
        if not 256 <= n <= MAX_COMPOSE_TOKENS:
            p.append(f"{where}.target_tokens[{i}]: {n} is not in [256, {MAX_COMPOSE_TOKENS}]")
    if len(set(c.target_tokens)) != len(c.target_tokens):
        p.append(f"{where}.target_tokens: lengths repeat; give each once (per_length sets how many)")
    if not 1 <= c.per_length <= 10_000:
        p.append(f"{where}.per_length: {c.per_length} is not in [1, 10000]")
    if c.answer_tokens is not None and c.answer_tokens < 1:
        p.append(f"{where}.answer_tokens: must be at least 1")
    if c.kinds is not None and c.rule != "documents":
        p.append(f"{where}.kinds: only compose.rule documents has kinds")
    elif c.kinds is not None:
        if not c.kinds:
            p.append(f"{where}.kinds: give at least one of {', '.join(DOCUMENT_KINDS)} (or leave it out)")
        for i, k in enumerate(c.kinds):
            if k not in DOCUMENT_KINDS:
                p.append(f"{where}.kinds[{i}]: {k!r} is not a document kind ({', '.join(DOCUMENT_KINDS)})")
        if len(set(c.kinds)) != len(c.kinds):
            p.append(f"{where}.kinds: kinds repeat; give each once (per_length sets how many)")
    return p


def _check_composed_heldout(where: str, d: Domain, held_out: tuple[str, float]) -> list[str]:
    """A long_chat domain holds nothing out: its conversations share prompts (rows repeat across them)
    and their closing questions, so one held out would make every other a contaminated training
    chat (``exact:heldout``), silently dropped. Evaluation builds its own long prompts."""
    if d.compose is None or d.compose.rule != "long_chat" or not held_out[1]:
        return []
    key = "held_out_fraction" if d.held_out_fraction is not None else "held_out_count"
    return [f"{where}.{key}: a long_chat domain must hold out nothing ({key}: 0; now {held_out[0]} "
            f"{held_out[1]:g}): its conversations share prompts and questions, so a held-out one would drop "
            "every other as contaminated"]


def _fraction(key: str, value: float, *, upto_one: bool = False) -> list[str]:
    """A share in [0, 1); ``upto_one``: in [0, 1] (``raw_fraction`` 1.0, every single-turn prompt raw, is
    how a base model with no chat template is ingested; a held-out fraction of 1 leaves nothing to train)."""
    if upto_one:
        return [] if 0.0 <= value <= 1.0 else [f"{key}: {value} is not in [0, 1]"]
    return [] if 0.0 <= value < 1.0 else [f"{key}: {value} is not in [0, 1)"]


def _check_source(where: str, s: Source, m: Manifest, base_dir: str | Path | None) -> list[str]:
    p = []
    if bool(s.path) == bool(s.hf_id):
        p.append(f"{where}: give exactly one of 'path' or 'hf_id'")
    if s.system_field and s.system_field == s.field and not s.messages_field:  # each prompt its own system prompt
        p.append(f"{where}.system_field: '{short_text(s.system_field)}' is the prompt's column (field) too; name the "
                 "column that holds the system prompt, or leave system_field out")
    p += _blank_licence(f"{where}.licence", s.licence)
    if not m.allow_unlicensed:
        if not (s.licence or m.licence):
            p.append(f"{where}.licence: required (or set allow_unlicensed: true)")
        if not s.provenance.strip():
            p.append(f"{where}.provenance: required (or set allow_unlicensed: true)")
    if s.path:
        try:
            path = input_file(s.path, base_dir, key=f"{where}.path")
        except ManifestError as exc:
            p.append(str(exc))
        else:
            if not source_format(s.path, path):
                p.append(f"{where}.path: {Path(s.path).suffix or 'no suffix'} is not .jsonl, .json or .parquet")
    return p


#: The formats of local source files, by suffix.
SOURCE_FORMATS = (".jsonl", ".json", ".parquet")


def source_format(path: str, resolved: Path) -> str:
    """The format of a local source: the suffix of ``path`` as the manifest writes it, else that of the
    file it resolves to ('' if neither is known). A symlink's own name counts first: the Hugging Face
    cache links ``snapshots/<rev>/train.jsonl`` to ``blobs/<sha256>``, which has no suffix. Case does not
    count (``DATA.JSONL``)."""
    return next((x for x in (Path(path).suffix.lower(), resolved.suffix.lower()) if x in SOURCE_FORMATS), "")


def _blank_licence(key: str, licence: str) -> list[str]:
    """A licence of spaces only is no licence, but it is no empty string either: it would count as
    given, and ``serve push`` would put it on the Hub card as the data's licence."""
    if licence and not licence.strip():
        return [f"{key}: blank; give a licence (e.g. CC0-1.0) or leave the key out"]
    return []


def resolve_path(path: str, base_dir: str | Path | None, *, key: str) -> Path:
    """A source path made absolute (``~`` expanded, symlinks resolved) against ``base_dir`` or cwd;
    one the OS cannot take (a NUL byte, a symlink loop, ...) is a ManifestError naming ``key``."""
    return user_path(path, key, error=ManifestError, base_dir=base_dir)


def input_file(path: str, base_dir: str | Path | None, *, key: str) -> Path:
    """:func:`resolve_path` of a file to read; ManifestError naming ``key`` if it is not one."""
    p = resolve_path(path, base_dir, key=key)
    if p.is_dir():
        raise ManifestError(f"{key}: {shown_path(path)} is a directory, not a file")
    if not p.is_file():
        glob = " (a path is one file, not a glob: list each file)" if any(c in str(path) for c in "*?[") else ""
        raise ManifestError(f"{key}: file not found: {shown_path(path)}{glob}")
    return p
