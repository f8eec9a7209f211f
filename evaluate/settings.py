"""What ``evaluate`` measures with, resolved against the rest of the recipe.

``recipe.evaluate`` alone leaves two things open: which draft (``evaluate.draft``, else where
``serve export`` writes it) and the chat-template kwargs (null: those ingest rendered the training
prompts with). Every command that serves a draft for AL resolves them here, ``evaluate`` itself and
the served-AL checkpoint selection during training (``eaglenest.pipeline``), so both render prompts
the same way.
"""

from __future__ import annotations

import dataclasses
import logging

from eaglenest.errors import ManifestError
from eaglenest.evaluate.config import EvaluateConfig
from eaglenest.ingest.manifest import load_manifest
from eaglenest.ingest.reasoning import template_kwargs

log = logging.getLogger(__name__)


def draft_dir(recipe) -> str:
    """The draft evaluated: ``evaluate.draft``, else where ``serve export`` writes it."""
    return recipe.evaluate.draft or str(recipe.run.path(recipe.serve.draft_subdir))


def evaluate_config(recipe) -> EvaluateConfig:
    """``recipe.evaluate`` with ``chat_template_kwargs`` resolved: as set, or (null) what ingest
    rendered the training prompts with: ``ingest.chat_template_kwargs`` with the manifest's
    ``generation.reasoning`` on top (``eaglenest.ingest.reasoning.template_kwargs``)."""
    cfg = recipe.evaluate
    if cfg.chat_template_kwargs is not None:
        return cfg
    reasoning = "default"
    try:
        reasoning = load_manifest(recipe.ingest.manifest).generation.reasoning
    except ManifestError as exc:  # evaluating without the manifest at hand: the recipe's kwargs alone
        log.warning("evaluate: manifest not read (%s); rendering with ingest.chat_template_kwargs only", exc)
    kwargs = template_kwargs(reasoning, recipe.ingest.chat_template_kwargs) or {}
    return dataclasses.replace(cfg, chat_template_kwargs=kwargs)
