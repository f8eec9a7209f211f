"""What ``evaluate`` measures with, resolved against the rest of the recipe and the store.

``recipe.evaluate`` alone leaves three things open: which draft (``evaluate.draft``, else where
``serve export`` writes it), how many tokens it drafts a round (``evaluate.num_speculative_tokens``,
null by default: the draft's recorded default, :func:`with_draft_k`; with no draft yet, as for
the served-AL selection during training, the best K of the recipe's ``train.family``) and the chat-template
kwargs. Every command that serves a draft for AL
resolves them here, ``evaluate`` itself and the served-AL checkpoint selection during training
(``eaglenest.pipeline``), so both render prompts the same way.

The kwargs (``evaluate.chat_template_kwargs``, null by default) resolve, first match wins, to:

1. the recipe's ``evaluate.chat_template_kwargs`` when set (``{}``: the template's defaults);
2. with ``--manifest M``: the kwargs ingest would render with under ``M`` (``ingest.chat_template_kwargs``
   with ``M``'s ``generation.reasoning`` on top), as ``ingest build --manifest M`` did;
3. what the store records: every ``ingest build`` commit to the prompts table stores the kwargs it
   rendered with in its lineage (:func:`rendered_with`), so a pool built with another manifest than
   the recipe's is evaluated in its own mode;
4. a store from before that record: the recipe's manifest (``ingest.manifest``), as in (2).

When (2) or (3) decides and the other source (the store, or the recipe's manifest) says something
else, one warning line names both. Trade-off: the recipe's manifest is still read to say so, so a
recipe whose manifest is not at hand logs that it was not read.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

from eaglenest.engine import draft_family, draft_num_speculative_tokens
from eaglenest.errors import ConfigError, ManifestError
from eaglenest.evaluate.config import EvaluateConfig
from eaglenest.featurestore.capture import policy
from eaglenest.ingest.manifest import load_manifest
from eaglenest.ingest.reasoning import template_kwargs
from eaglenest.paths import read_json_object
from eaglenest.train.checkpoint import INFO
from eaglenest.train.config import BEST_NUM_SPECULATIVE_TOKENS, TrainConfig, recommended_num_speculative_tokens

log = logging.getLogger(__name__)


def draft_dir(recipe) -> str:
    """The draft evaluated: ``evaluate.draft``, else where ``serve export`` writes it."""
    return recipe.evaluate.draft or str(recipe.run.path(recipe.serve.draft_subdir))


def check_draft_family(recipe, draft: str) -> None:
    """Refuse an exported ``draft`` of another family than the recipe's ``train.family``, when it names
    one other than the default (as ``serve export`` reads it): ``evaluate al train.family=dflash`` given
    an EAGLE-3 export would measure that draft under the other family's name. No draft there yet: left to
    the command to refuse, naming it; a train checkpoint (no config.json) records its own family."""
    asked = recipe.train.family
    path = Path(draft) / "config.json"
    if asked == TrainConfig.family or not path.is_file():
        return
    exported = draft_family(read_json_object(path, error=ConfigError,
                                             then="not an exported draft: run `serve export` again"))
    if exported != asked:
        raise ConfigError(f"train.family={asked}: the draft {draft} is a {exported} draft (its config.json); "
                          f"evaluate it with train.family={exported}, or export a {asked} draft there first "
                          f"(`train run` and `serve export` with train.family={asked})")


def with_draft_k(cfg: EvaluateConfig, draft: str,
                 default: int = BEST_NUM_SPECULATIVE_TOKENS["eagle3"]) -> EvaluateConfig:
    """``cfg`` with a null ``num_speculative_tokens`` set to ``draft``'s recorded default (``default``:
    no draft there, or an export from before the record). Every function serving a draft with an
    ``EvaluateConfig`` calls it, so a config built in code behaves as one from a recipe."""
    if cfg.num_speculative_tokens is not None:
        return cfg
    return dataclasses.replace(cfg, num_speculative_tokens=draft_num_speculative_tokens(draft, default))


def rendered_with(store_uri: str) -> dict | None:
    """The ``chat_template_kwargs`` the store's prompts were rendered with, from the lineage of the
    prompts table's commits (None: no commit records them, or there is no prompts table). Commits
    made with different kwargs (a pool extended under another manifest): the latest, with a warning."""
    seen = policy.rendered_kwargs(store_uri)
    if len(seen) > 1:
        log.warning("evaluate: the prompts table holds prompts rendered with %d different chat_template_kwargs "
                    "(%s); rendering with the latest", len(seen), "; ".join(map(_show, seen)))
    return seen[-1] if seen else None


def _from_manifest(recipe, path: str, *, quiet: bool) -> dict | None:
    """The kwargs ingest renders with under manifest ``path`` (None: the manifest cannot be read)."""
    try:
        reasoning = load_manifest(path).generation.reasoning
    except ManifestError as exc:
        if not quiet:
            log.warning("evaluate: manifest not read (%s); rendering with ingest.chat_template_kwargs only", exc)
        return None
    return template_kwargs(reasoning, recipe.ingest.chat_template_kwargs) or {}


def _show(kwargs: dict) -> str:
    return "{" + ", ".join(f"{k}: {v}" for k, v in sorted(kwargs.items())) + "}"


def _trained_with(draft: str, recipe) -> dict:
    """The ``train`` section ``draft`` was trained with: a train checkpoint's recorded one (``evaluate
    offline --draft CKPT``), else the recipe's. A checkpoint.json that cannot be read is left to the
    draft's loader to refuse, naming its flag."""
    try:
        recorded = json.loads((Path(draft) / INFO).read_text(encoding="utf-8")).get("train_config")
        recommended_num_speculative_tokens(recorded)  # a family it does not know: the recipe's
    except (OSError, ValueError, AttributeError, TypeError, ConfigError):
        return dataclasses.asdict(recipe.train)
    return recorded


def evaluate_config(recipe, *, manifest: str | None = None, draft: str | None = None) -> EvaluateConfig:
    """``recipe.evaluate`` with ``chat_template_kwargs`` and ``num_speculative_tokens`` resolved
    (module docstring); ``manifest``: the command's ``--manifest``; ``draft``: the draft served
    (``--draft``, a compared draft; default :func:`draft_dir`), whose recorded K a null
    ``evaluate.num_speculative_tokens`` takes."""
    draft = draft or draft_dir(recipe)
    cfg = with_draft_k(recipe.evaluate, draft, recommended_num_speculative_tokens(_trained_with(draft, recipe)))
    return dataclasses.replace(cfg, chat_template_kwargs=resolve_chat_template_kwargs(recipe, manifest=manifest))


def resolve_chat_template_kwargs(recipe, *, manifest: str | None = None) -> dict:
    """The kwargs every prompt is rendered with (module docstring: the recipe's, ``--manifest``'s, the
    store's record, the recipe's manifest), without reading a draft: the served-AL selection during
    training serves no draft of ``<workdir>/<serve.draft_subdir>`` and needs the kwargs alone."""
    if recipe.evaluate.chat_template_kwargs is not None:
        return recipe.evaluate.chat_template_kwargs
    stored = rendered_with(recipe.run.store_uri)
    if manifest:
        # Named on the command line: a manifest that cannot be read is refused (ManifestError, exit 2).
        kwargs = template_kwargs(load_manifest(manifest).generation.reasoning, recipe.ingest.chat_template_kwargs) or {}
        if stored is not None and stored != kwargs:
            log.warning("evaluate: rendering prompts with chat_template_kwargs %s from --manifest %s; the store's "
                        "prompts were rendered with %s", _show(kwargs), manifest, _show(stored))
    elif stored is not None:
        kwargs = stored
        recipe_says = _from_manifest(recipe, recipe.ingest.manifest, quiet=True)
        if recipe_says is not None and recipe_says != stored:
            log.warning("evaluate: rendering prompts with chat_template_kwargs %s, as the store's prompts were "
                        "rendered; the recipe's manifest %s would give %s (set evaluate.chat_template_kwargs or "
                        "pass --manifest to choose)", _show(stored), recipe.ingest.manifest, _show(recipe_says))
    else:
        kwargs = _from_manifest(recipe, recipe.ingest.manifest, quiet=False)
        if kwargs is None:
            kwargs = dict(recipe.ingest.chat_template_kwargs or {})
    return kwargs
