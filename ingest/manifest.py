"""The domain manifest: what prompts a run draws, from where, under which licence, how they are split.

Parsed with the YAML safe loader and validated into frozen dataclasses; every problem is reported as
one line naming its dotted key (``domains.code.sources[0].path: file not found``). Validation happens
before anything is written, so a bad manifest costs nothing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

from eaglenest.config import build, load_yaml, to_dict
from eaglenest.errors import ManifestError

MANIFEST_VERSION = 1


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
    licence: str = ""
    provenance: str = ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Generation:
    temperature: float = 0.0
    max_tokens: int = 160
    seed: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class Domain:
    sources: list[Source]
    #: Most prompts kept from this domain (after deduplication), held-out ones included.
    cap_prompts: int
    #: Overrides of the manifest-wide values for this domain.
    held_out_fraction: float | None = None
    raw_fraction: float | None = None


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
    #: Share of training prompts regenerated as raw completions instead of through the chat template.
    raw_fraction: float = 0.2
    generation: Generation = Generation()

    def held_out(self, domain: str) -> float:
        d = self.domains[domain].held_out_fraction
        return self.held_out_fraction if d is None else d

    def raw(self, domain: str) -> float:
        d = self.domains[domain].raw_fraction
        return self.raw_fraction if d is None else d

    def content_hash(self) -> str:
        return hashlib.sha256(json.dumps(to_dict(self), sort_keys=True).encode()).hexdigest()[:16]


def load_manifest(path: str | Path, *, base_dir: str | Path | None = None) -> Manifest:
    """Load and fully validate a manifest (local source paths resolved against ``base_dir`` or cwd)."""
    data = load_yaml(path, error=ManifestError)
    manifest = build(Manifest, data, error=ManifestError)
    validate(manifest, base_dir=base_dir)
    return manifest


def validate(m: Manifest, *, base_dir: str | Path | None = None) -> None:
    if m.version != MANIFEST_VERSION:
        raise ManifestError(f"version: manifest version {m.version}, this eaglenest reads {MANIFEST_VERSION}")
    if not m.domains:
        raise ManifestError("domains: at least one domain is required")
    _fraction("held_out_fraction", m.held_out_fraction)
    _fraction("raw_fraction", m.raw_fraction)
    if m.generation.max_tokens < 1:
        raise ManifestError("generation.max_tokens: must be at least 1")
    for name, d in m.domains.items():
        where = f"domains.{name}"
        if not name.replace("_", "").replace("-", "").isalnum():
            raise ManifestError(f"{where}: domain names use letters, digits, '-' and '_'")
        if d.cap_prompts < 1:
            raise ManifestError(f"{where}.cap_prompts: must be at least 1")
        if d.held_out_fraction is not None:
            _fraction(f"{where}.held_out_fraction", d.held_out_fraction)
        if d.raw_fraction is not None:
            _fraction(f"{where}.raw_fraction", d.raw_fraction)
        if not d.sources:
            raise ManifestError(f"{where}.sources: at least one source is required")
        for i, s in enumerate(d.sources):
            _check_source(f"{where}.sources[{i}]", s, m, base_dir)


def _fraction(key: str, value: float) -> None:
    if not 0.0 <= value < 1.0:
        raise ManifestError(f"{key}: {value} is not in [0, 1)")


def _check_source(where: str, s: Source, m: Manifest, base_dir: str | Path | None) -> None:
    if bool(s.path) == bool(s.hf_id):
        raise ManifestError(f"{where}: give exactly one of 'path' or 'hf_id'")
    if not m.allow_unlicensed:
        if not (s.licence or m.licence):
            raise ManifestError(f"{where}.licence: required (or set allow_unlicensed: true)")
        if not s.provenance:
            raise ManifestError(f"{where}.provenance: required (or set allow_unlicensed: true)")
    if s.path:
        p = resolve_path(s.path, base_dir)
        if not p.is_file():
            raise ManifestError(f"{where}.path: file not found: {s.path}")
        if p.suffix not in (".jsonl", ".json", ".parquet"):
            raise ManifestError(f"{where}.path: {p.suffix or 'no suffix'} is not .jsonl, .json or .parquet")


def resolve_path(path: str, base_dir: str | Path | None) -> Path:
    p = Path(path).expanduser()
    return p if p.is_absolute() or base_dir is None else Path(base_dir) / p
