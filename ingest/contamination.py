"""Keep evaluation prompts out of training: exact and (optionally) near-duplicate checks.

Evaluation sets are read at run time from files the manifest names (MT-Bench ``question.jsonl``:
``{"turns": [...]}``; SPEED-Bench style JSONL: ``prompt``, ``turns`` or ``messages``), never vendored.
A training conversation is contaminated when any of its user turns equals an evaluation prompt
(:func:`eaglenest.text.content_key`, the same identity deduplication uses) or, with a threshold, is
a near duplicate of one (Jaccard similarity of word 5-gram sets, letter 5-grams in Chinese, Japanese or
Thai: :func:`eaglenest.ingest.neardup.shingles`). The pool's held-out split is an
evaluation set too: a training conversation with a user turn equal to a held-out one (the same
question under another system prompt, or inside a multi-turn chat) is contaminated, and with a
threshold so is a near duplicate of one.

Trade-off: near-duplicate search is an inverted index over shingles, exact Jaccard on candidates:
simple and exact, fine for eval sets and held-out splits of ~10^5 prompts; the pool's own
near-duplicate removal (:mod:`eaglenest.ingest.neardup`, MinHash + LSH) is built for larger sets.
"""

from __future__ import annotations

import collections
import logging

from eaglenest.errors import ManifestError
from eaglenest.ingest import compose
from eaglenest.ingest.manifest import Manifest
from eaglenest.ingest.neardup import jaccard, shingles
from eaglenest.ingest.pool import PoolEntry, evaluation_prompts, load_eval_prompts  # noqa: F401 - re-exported
from eaglenest.text import content_key

log = logging.getLogger(__name__)


class NearIndex:
    """Exact Jaccard over candidates found through a shingle -> documents index."""

    def __init__(self, texts: list[str]):
        self.sets = [shingles(t) for t in texts]
        self.index: dict[str, list[int]] = collections.defaultdict(list)
        for i, s in enumerate(self.sets):
            for g in s:
                self.index[g].append(i)

    def best(self, text: str) -> float:
        q = shingles(text)
        cands = {i for g in q for i in self.index.get(g, ())}
        return max((jaccard(q, self.sets[i]) for i in cands), default=0.0)


def check(pool: list[PoolEntry], manifest: Manifest, *, base_dir=None, stored_split: dict[str, str] | None = None,
          stored_heldout: dict[str, list[str]] | None = None,
          evals: list[str] | None = None) -> tuple[list[PoolEntry], dict]:
    """``(pool without contaminated training entries, report)``; raises if ``action: error``.

    ``stored_split`` (``{sample_id: split}``) and ``stored_heldout`` (``{sample_id: user turns}`` of
    the held-out ones) describe the prompts table of earlier runs, perhaps under another manifest. A
    stored prompt keeps its stored split (a re-run skips it), so that split is the one checked here;
    a stored training prompt found contaminated cannot be dropped any more: refused, whatever the action.
    ``evals``: the prompts of the manifest's evaluation files when the caller has read them (read here if not)."""
    stored_split, stored_heldout = stored_split or {}, stored_heldout or {}
    split = {e.sample_id: stored_split.get(e.sample_id, e.split) for e in pool}
    c = manifest.contamination
    evals = evaluation_prompts(manifest, base_dir=base_dir) if evals is None else evals
    eval_keys = {content_key(t) for t in evals}
    threshold = c.near_duplicate_threshold
    near_eval = NearIndex(evals) if threshold else None
    heldout = [t for e in pool if split[e.sample_id] == "heldout" and e.sample_id not in stored_heldout
               for t in e.user_turns()]
    heldout += [t for turns in stored_heldout.values() for t in turns if isinstance(t, str)]
    heldout_keys = {content_key(t) for t in heldout}
    near_held = NearIndex(heldout) if threshold else None
    hits: dict[str, str] = {}
    for e in pool:
        if split[e.sample_id] != "train":
            continue
        for t in compose.prompts_of(e.source, e.user_turns()):  # a long chat's first prompt too
            key = content_key(t)
            if key in eval_keys:
                hits[e.sample_id] = "exact:eval"
            elif key in heldout_keys:  # the same question held out with another system prompt or chat
                hits[e.sample_id] = "exact:heldout"
            elif threshold and near_eval.best(t) >= threshold:
                hits[e.sample_id] = "near:eval"
            elif threshold and near_held.best(t) >= threshold:
                hits[e.sample_id] = "near:heldout"
            if e.sample_id in hits:
                break
    report = {"eval_prompts": len(evals), "contaminated": len(hits),
              "by_reason": dict(collections.Counter(hits.values())),
              "by_domain": dict(collections.Counter(s.rsplit("-", 1)[0] for s in hits)),
              "sample_ids": sorted(hits)}
    _refuse_stored(hits, stored_split)
    if hits and c.action == "error":
        first = sorted(hits)[0]
        raise ManifestError(f"contamination: {len(hits)} training prompt(s) match evaluation sets "
                            f"(first: {first}, {hits[first]}); set contamination.action: drop to remove them")
    if hits:
        log.warning("contamination: dropped %d training prompt(s): %s", len(hits), report["by_reason"])
    return [e for e in pool if e.sample_id not in hits], report


def _refuse_stored(hits: dict[str, str], stored_split: dict[str, str]) -> None:
    """Contaminated training prompts an earlier run stored (an evaluation file or threshold added since,
    a held-out policy changed): dropping them from this pool would leave them in the table, answered,
    to be captured and trained on, while the report said they were dropped."""
    stored = sorted(sid for sid in hits if sid in stored_split)
    if stored:
        raise ManifestError(f"contamination: {len(stored)} training prompt(s) stored already in the prompts table "
                            f"match evaluation sets or held-out prompts (first: {stored[0]}, {hits[stored[0]]}); "
                            "a table keeps its rows: ingest into a new store (run.store)")
