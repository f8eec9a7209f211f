"""Served-AL scoring of training snapshots: export (serve stage), then serve with vLLM and measure
acceptance length (evaluate stage) on ``train.select.prompts_per_domain`` prompts per domain of
``train.select.split``. No lossless check, no n-gram reference and no long-context buckets here: the
score is the AL over those prompts, and the checks belong to ``evaluate al`` on the final draft.
(The default buckets alone, 1K to 32K tokens, cost more than the domain prompts: 63K tokens of
prefill per snapshot for a 32K-context target.)

The trainer keeps the books (:mod:`eaglenest.train.selection`); it receives the function built here.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Callable

from eaglenest.engine import has_cuda
from eaglenest.errors import ConfigError
from eaglenest.evaluate.config import EvaluateConfig
from eaglenest.evaluate.plan import plan
from eaglenest.evaluate.run import evaluate_al
from eaglenest.serve.export import export_draft

log = logging.getLogger(__name__)


def served_al_scorer(train_cfg, evaluate_cfg=None, *, target_dir: str, store_uri: str,
                     trust_remote_code: bool = False, serve_cfg=None,
                     off_policy: bool = False) -> Callable[[Path], dict[str, Any]]:
    """A function ``snapshot_dir -> {"served_al", "prompts"}`` for :func:`eaglenest.train.loop.train`.

    ``evaluate_cfg``: the recipe's EvaluateConfig (engine settings, max_tokens, template kwargs);
    the rest is set for selection (:func:`selection_config`). ``serve_cfg``: the recipe's ServeConfig,
    whose export settings (:func:`export_settings`) each snapshot is exported with, so it is scored as
    ``serve export`` will write it. ``off_policy``: ``run.off_policy`` (a target whose weights, tokenizer or
    chat template differ from the features' is exported with a warning, as ``serve export`` does)."""
    cfg = selection_config(train_cfg, evaluate_cfg)
    settings = export_settings(serve_cfg)
    check_exportable(train_cfg, settings)
    # Refused now (a prompt with no room in the engine, every prompt excluded), not at the first snapshot.
    plan(cfg, target=target_dir, store_uri=store_uri, trust_remote_code=trust_remote_code)

    def score(snapshot: Path) -> dict[str, Any]:
        exported = export_draft(snapshot, Path(snapshot).parent / "draft", target_dir=target_dir,
                                argv=["train-select"], off_policy=off_policy, **settings)
        report = evaluate_al(target=target_dir, draft=str(exported), store_uri=store_uri, cfg=cfg,
                             trust_remote_code=trust_remote_code)
        return {"served_al": report["overall"].get("acceptance_length"),
                "prompts": report["overall"].get("prompts")}

    return score


def export_settings(serve_cfg) -> dict[str, Any]:
    """``export_draft`` keywords for a snapshot: the recipe's ``serve.dtype``, ``serve.format`` and
    ``serve.num_speculative_tokens`` (the K the export records), and ``serve.quantization`` where vLLM
    serves it: FP8 drafts are served on CUDA only, so on a CPU the snapshots are scored unquantised."""
    if serve_cfg is None:
        return {}
    quantization = serve_cfg.quantization
    if quantization != "none" and not has_cuda():
        log.warning("train.select: serve.quantization=%s is served on CUDA only: snapshots are scored unquantised "
                    "on this machine (the final export is still %s)", quantization, quantization)
        quantization = "none"
    return {"dtype": serve_cfg.dtype, "format": serve_cfg.format, "quantization": quantization,
            "num_speculative_tokens": serve_cfg.num_speculative_tokens}


def check_exportable(train_cfg, settings: dict[str, Any]) -> None:
    """Refuse now, not at the first snapshot after ``train.select.every_steps`` steps of training, the
    export settings ``export_draft`` refuses for every draft of ``train.family`` (what the recipe
    fixes, not what training learns)."""
    if train_cfg.family == "dflash" and settings.get("quantization", "none") != "none":
        raise ConfigError("serve.quantization: a DFlash draft (train.family=dflash) exports with "
                          "serve.quantization=none only for now; train.select exports every snapshot with it")
    if settings.get("format") == "speculators" and train_cfg.norm_before_fc and train_cfg.fc_norm:
        raise ConfigError("serve.format: speculators refuses train.norm_before_fc together with train.fc_norm "
                          "(its Eagle3SpeculatorConfig allows one) and train.select exports every snapshot with it; "
                          "set serve.format=vllm")


def selection_config(train_cfg, evaluate_cfg=None):
    """The EvaluateConfig a selection round serves with: the recipe's ``evaluate`` section (engine,
    max_tokens, template kwargs) on the store's ``train.select.split`` prompts (whatever
    ``evaluate.prompt_set`` the final evaluation uses), ``train.select.prompts_per_domain`` prompts
    per domain, and nothing the score does not use (lossless check, n-gram reference, context buckets)."""
    base = evaluate_cfg if evaluate_cfg is not None else EvaluateConfig()
    return dataclasses.replace(base, prompt_set="heldout", prompt_path="", split=train_cfg.select.split,
                               check_lossless=False, ngram_order=0, context_buckets=(),
                               max_prompts_per_domain=train_cfg.select.prompts_per_domain)
