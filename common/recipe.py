"""The root recipe: one section per stage, each validated by that stage's own frozen dataclass.

Sections are resolved lazily (``eaglenest.<stage>.config``) so that loading a recipe imports no
heavy dependency. Every stage command validates the whole recipe, so a typo in any section is
reported before work starts.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import logging
from pathlib import Path
from typing import Any

from eaglenest.config import apply_overrides, build, load_yaml, short_text, to_dict, unknown_key
from eaglenest.errors import ConfigError
from eaglenest.target import max_positions, read_config

log = logging.getLogger(__name__)

DEFAULT_RECIPE = "recipes/toy.yaml"
#: The engine lengths (section -> key path) fitted to a local target's positions when the recipe leaves
#: them unset (:func:`_fit_lengths`).
LENGTHS = {"ingest": ("engine", "max_model_len"), "featurestore": ("engine", "max_model_len"),
           "evaluate": ("engine", "max_model_len"), "serve": ("max_model_len",)}

SECTIONS = {
    "run": "eaglenest.runconfig:RunConfig",
    "ingest": "eaglenest.ingest.config:IngestConfig",
    "featurestore": "eaglenest.featurestore.config:FeaturestoreConfig",
    "train": "eaglenest.train.config:TrainConfig",
    "serve": "eaglenest.serve.config:ServeConfig",
    "evaluate": "eaglenest.evaluate.config:EvaluateConfig",
}


def _section_class(name: str):
    module, cls = SECTIONS[name].split(":")
    return getattr(importlib.import_module(module), cls)


@dataclasses.dataclass(frozen=True)
class Recipe:
    """The validated recipe: ``recipe.train`` is a ``TrainConfig`` and so on."""

    path: str
    sections: dict[str, Any]

    def __getattr__(self, name: str) -> Any:
        # Read through __dict__: copy and pickle ask for attributes before ``sections`` is set, and
        # ``self.sections`` would come back here for ever.
        try:
            return self.__dict__["sections"][name]
        except KeyError:
            raise AttributeError(name) from None

    def to_dict(self) -> dict[str, Any]:
        return {k: to_dict(v) for k, v in self.sections.items()}


def _section_hint(key: str, *, besides: str = "") -> str:
    """'; did you mean train.lr?' for a section-less key (``lr=1e-4``) that some section has, or for a
    key of section ``besides`` that another section has (``train.workdir``: ``run.workdir``)."""
    owners = [f"{name}.{key}" for name in SECTIONS
              if name != besides and key in {f.name for f in dataclasses.fields(_section_class(name))}]
    return f"; did you mean {' or '.join(owners)}?" if owners else ""


def _close_section(name: str) -> str:
    """'; did you mean train?' for a misspelt section (``trian.lr=3``), or ''."""
    close = difflib.get_close_matches(name, list(SECTIONS), n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


def _misplaced_key(name: str, section: Any) -> str | None:
    """The line for a key section ``name`` does not have but another section does, typed under the
    wrong section (``train.workdir=...``); None when there is none, or when the section's own message
    helps more (a renamed key, a close match among its own keys): :func:`build` reports those."""
    if not isinstance(section, dict):
        return None
    cls = _section_class(name)
    own = {f.name for f in dataclasses.fields(cls) if f.init}
    for key in sorted(map(str, set(section) - own)):
        line = unknown_key(cls, name, key)
        if line.endswith(": unknown key") and (hint := _section_hint(key, besides=name)):
            return line + hint
    return None


def load_recipe(path: str | Path | None = None, overrides: list[str] | None = None) -> Recipe:
    """Load, override and validate a recipe. Raises :class:`ConfigError` naming the bad key."""
    if path is not None and not str(path).strip():
        raise ConfigError("--recipe: empty path")
    if path is None and not Path(DEFAULT_RECIPE).is_file():
        raise ConfigError(f"{DEFAULT_RECIPE}: file not found (the default recipe, read from the current "
                          "directory: run from an eaglenest checkout or give --recipe)")
    path = str(path or DEFAULT_RECIPE)
    texts: dict[str, str] = {}  # override values read as numbers, as typed (a text key takes the text)
    # An empty recipe is refused: a truncated file or a failed `--recipe <(cmd)` would run every default.
    data = apply_overrides(load_yaml(path, allow_empty=False), list(overrides or []), texts)
    unknown = sorted(map(str, set(data) - set(SECTIONS)))
    if unknown:
        raise ConfigError(f"{short_text(unknown[0])}: unknown recipe section (known: {', '.join(SECTIONS)})"
                          f"{_section_hint(unknown[0]) or _close_section(unknown[0])}")
    for name in SECTIONS:
        if line := _misplaced_key(name, data.get(name)):
            raise ConfigError(line)
    sections = {name: build(_section_class(name), data.get(name), where=name, texts=texts) for name in SECTIONS}
    return Recipe(path=path, sections=_fit_lengths(sections, data))


def _given(data: dict[str, Any], name: str, keys: tuple[str, ...]) -> bool:
    node: Any = data.get(name)
    for key in keys:
        if not isinstance(node, dict) or key not in node:
            return False
        node = node[key]
    return True


def _fit_lengths(sections: dict[str, Any], data: dict[str, Any]) -> dict[str, Any]:
    """Each engine length of :data:`LENGTHS` the recipe leaves unset, lowered to the positions of a
    local ``run.target`` that has fewer than its default (a 2048-position target: TinyLlama, OPT, Pythia;
    the default is 4096, ``serve``'s 2048), so the documented commands run on it as they stand. A length
    the recipe or an override gives is kept, and refused by the stage's own check when the target cannot
    take it; a hub id, or a target whose config.json does not say (``target.max_positions``), is left to
    those checks too."""
    target = sections["run"].target
    if not Path(target).is_dir():
        return sections
    try:
        limit = max_positions(read_config(target))
    except ConfigError:  # a damaged config.json: the stage that reads it says so
        return sections
    if limit is None:
        return sections
    positions, how = limit
    out = dict(sections)
    for name, keys in LENGTHS.items():
        if _given(data, name, keys):
            continue
        parents = [out[name]]
        for key in keys[:-1]:
            parents.append(getattr(parents[-1], key))
        if getattr(parents[-1], keys[-1]) <= positions:
            continue
        log.info("%s.%s: %d positions (%s) for %s, fewer than the default %d", name, ".".join(keys), positions,
                 how, target, getattr(parents[-1], keys[-1]))
        value: Any = positions
        for parent, key in zip(reversed(parents), reversed(keys)):
            value = dataclasses.replace(parent, **{key: value})
        out[name] = value
    return out
