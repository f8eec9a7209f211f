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
from pathlib import Path
from typing import Any, Callable

from eaglenest.evaluate.config import EvaluateConfig
from eaglenest.evaluate.plan import plan
from eaglenest.evaluate.run import evaluate_al
from eaglenest.serve.export import export_draft


def served_al_scorer(train_cfg, evaluate_cfg=None, *, target_dir: str, store_uri: str,
                     trust_remote_code: bool = False) -> Callable[[Path], dict[str, Any]]:
    """A function ``snapshot_dir -> {"served_al", "prompts"}`` for :func:`eaglenest.train.loop.train`.

    ``evaluate_cfg``: the recipe's EvaluateConfig (engine settings, max_tokens, template kwargs);
    the rest is set for selection (:func:`selection_config`)."""
    cfg = selection_config(train_cfg, evaluate_cfg)
    # Refused now (a prompt with no room in the engine, every prompt excluded), not at the first snapshot.
    plan(cfg, target=target_dir, store_uri=store_uri, trust_remote_code=trust_remote_code)

    def score(snapshot: Path) -> dict[str, Any]:
        exported = export_draft(snapshot, Path(snapshot).parent / "draft", target_dir=target_dir,
                                argv=["train-select"])
        report = evaluate_al(target=target_dir, draft=str(exported), store_uri=store_uri, cfg=cfg,
                             trust_remote_code=trust_remote_code)
        return {"served_al": report["overall"].get("acceptance_length"),
                "prompts": report["overall"].get("prompts")}

    return score


def selection_config(train_cfg, evaluate_cfg=None):
    """The EvaluateConfig a selection round serves with: the recipe's ``evaluate`` section (engine,
    max_tokens, template kwargs) on the store's ``train.select.split`` prompts (whatever
    ``evaluate.prompt_set`` the final evaluation uses), ``train.select.prompts_per_domain`` prompts
    per domain, and nothing the score does not use (lossless check, n-gram reference, context buckets)."""
    base = evaluate_cfg if evaluate_cfg is not None else EvaluateConfig()
    return dataclasses.replace(base, prompt_set="heldout", prompt_path="", split=train_cfg.select.split,
                               check_lossless=False, ngram_order=0, context_buckets=(),
                               max_prompts_per_domain=train_cfg.select.prompts_per_domain)
