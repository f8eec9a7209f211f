"""On-policy guard: which target generated the responses, and which one is being used now.

A draft learns to predict the target that generated its training responses. ``ingest build``
records the generating target in every commit's lineage of the ``prompts`` table (``target`` and
``target_id``, the sha256 of its weight files, as the feature-set identity computes it); the
features table's identity already holds the capturing target's ``weights_sha256``. ``ingest
build`` (adding rows), ``featurestore capture`` and ``train run`` compare those records with
``run.target`` and refuse a different target (exit 2) unless ``run.off_policy=true`` says the data
is meant to be off-policy; then they log a warning and go on. Prompts tables written before the
record existed carry none: the check is skipped with a warning naming that. A target named by hub id has
no weight files here (``target_id`` ``hub:<id>``): the lineage also records the revision it was read at
(``target_revision``: ``run.target_revision``, else the commit the cache's ``main`` names), and another
revision of the same id is refused the same way (``identity.revision_change``, as for the features).

The same weights with another tokenizer or chat template (an edited ``chat_template``, another
revision of the same model) tokenize the conversations differently: the stored ids would not be
on-policy either. Each commit's lineage also records ``tokenizer_sha256`` (the tokenizer files, the
chat template left out) and ``chat_template_sha256``; the same commands refuse a change in either
the same way (the template only when chat responses are stored). Commits from before that record
are not compared; a record hashed before ``added_tokens.json``, the other sentencepiece models and the
template files besides ``chat_template.jinja`` counted is compared with the target's files hashed that
way (``identity.legacy_tokenization``: an edit of those files since is not seen for it).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from eaglenest.errors import ConfigError
from eaglenest.featurestore.capture.identity import (hub_revision, legacy_tokenization, revision_change,
                                                     template_hash, vocab_hash, weights_hash)
from eaglenest.featurestore.table import fragments, store, versions

log = logging.getLogger(__name__)


def target_id(target: str) -> str:
    """The target's identity: sha256 over its weight files (featurestore/capture/identity.py)."""
    return weights_hash(target)


def lineage_record(target: str) -> dict[str, str]:
    """What ``ingest build`` writes into each commit's lineage (a hub id's revision too: ``run.target_revision``,
    else the commit its local cache resolves ``main`` to)."""
    revision = hub_revision(str(target))
    return {"target": str(target), "target_id": target_id(str(target)), **tokenization_record(str(target)),
            **({"target_revision": revision} if revision else {})}


#: The tokenization the responses were generated with: lineage key -> what it identifies (named in refusals).
TOKENIZATION = {"tokenizer_sha256": "tokenizer (vocabulary, merges, special tokens)",
                "chat_template_sha256": "chat template"}


def tokenization_record(target: str) -> dict[str, str]:
    """How ``target`` turns conversations into token ids: the sha256 of its tokenizer files (its chat
    template left out) and of its chat template. Empty for a hub id (no files here to hash)."""
    if not Path(target).is_dir():
        return {}
    return {"tokenizer_sha256": vocab_hash(target), "chat_template_sha256": template_hash(Path(target))}


def rendered_kwargs(store_uri: str) -> list[dict]:
    """The distinct ``chat_template_kwargs`` the prompts table's ingest commits rendered with, in
    commit order (the latest last; empty: no prompts table, or none records them), those of versions
    ``gc`` removed included (their rows stay)."""
    if not store.exists(store_uri, store.PROMPTS):
        return []
    lineages = fragments.removed_lineage(store_uri, store.PROMPTS)
    lineages.update({int(v["version"]): v["lineage"] or {} for v in versions.list_versions(store_uri, store.PROMPTS)})
    seen: list[dict] = []
    for _, lin in sorted(lineages.items()):
        kwargs = lin.get("chat_template_kwargs")
        if isinstance(kwargs, dict):
            seen = [k for k in seen if k != kwargs] + [kwargs]
    return seen


def response_lineages(store_uri: str) -> list[dict] | None:
    """The lineage of every prompts-table commit that wrote responses (not the held-out shard), in
    version order, those gc removed included (their rows stay); None when there is no table."""
    if not store.exists(store_uri, store.PROMPTS):
        return None
    ds = store.dataset(store_uri, store.PROMPTS)
    lineages = fragments.removed_lineage(store_uri, store.PROMPTS)
    lineages.update({int(v["version"]): fragments.lineage_of(ds, int(v["version"])) or {}
                     for v in store.version_list(ds, store_uri, store.PROMPTS)})
    return [lin for _, lin in sorted(lineages.items()) if lin.get("shard") != "heldout"]


def generating_targets(store_uri: str) -> dict[str, str] | None:
    """{target_id: target name} over the prompts table's ingest commits that wrote responses
    (empty when none records one: a table from before the record); None when there is no table."""
    lineages = response_lineages(store_uri)
    return None if lineages is None else _targets(lineages)


def _targets(lineages: list[dict]) -> dict[str, str]:
    found: dict[str, str] = {}
    for lin in lineages:
        if lin.get("target_id"):
            found.setdefault(lin["target_id"], lin.get("target", "?"))
    return found


def _refuse_or_warn(message: str, *, off_policy: bool) -> None:
    if off_policy:
        log.warning("%s; going on because run.off_policy=true", message)
        return
    raise ConfigError(f"{message}. The draft would learn another model's outputs. Use the target that "
                      "generated the data, re-run `ingest build` into a new store, or set "
                      "run.off_policy=true if off-policy data is intended")


def check_prompts(store_uri: str, target: str, *, off_policy: bool, stage: str) -> None:
    """Refuse (unless ``off_policy``) when the prompts' responses came from another target, or from
    this one with another tokenizer or chat template (:func:`check_tokenization`)."""
    require_target_folder(target)
    lineages = response_lineages(store_uri)
    if lineages is None:  # nothing generated yet
        return
    found = _targets(lineages)
    if not found:
        if not store.read(store_uri, store.PROMPTS, columns=["sample_id"],
                          filter="split = 'train' AND finish_reason != ''").num_rows:
            return  # no response stored yet: nothing to be off-policy with
        log.warning("%s: the prompts table in %s does not record which target generated its responses "
                    "(written before eaglenest recorded it); cannot check it is on-policy for %s",
                    stage, store_uri, target)
        return
    mine = target_id(str(target))
    others = {k: v for k, v in found.items() if k != mine}
    if others:
        names = ", ".join(f"{name} (weights {tid[:12]})" for tid, name in sorted(others.items())[:3])
        _refuse_or_warn(f"{stage}: responses in {store_uri} were generated by {names}, but run.target is "
                        f"{target} (weights {mine[:12]})", off_policy=off_policy)
    elif mine.startswith("hub:"):  # one hub id: generated at the revision it is read at now?
        for was in sorted({lin["target_revision"] for lin in lineages if lin.get("target_id") == mine
                           and isinstance(lin.get("target_revision"), str) and lin["target_revision"]}):
            message = revision_change({"weights_sha256": mine, "target_revision": was}, str(target),
                                      recorded=f"the lineage of the responses in {store_uri}",
                                      what="responses were generated")
            if message:
                _refuse_or_warn(f"{stage}: {message}", off_policy=off_policy)
                break
    check_tokenization(store_uri, target, off_policy=off_policy, stage=stage, lineages=lineages)


def check_tokenization(store_uri: str, target: str, *, off_policy: bool, stage: str,
                       lineages: list[dict] | None = None) -> None:
    """Refuse (unless ``off_policy``) when ``target``'s tokenizer or chat template is not the one
    ``ingest build`` generated the stored responses with (its lineage's :data:`TOKENIZATION`
    record): the token ids would not be what the target produces now. The chat template counts only
    for a table holding chat responses; commits from before the record are not compared. ``lineages``:
    :func:`response_lineages`, when the caller has read them."""
    mine = tokenization_record(str(target))
    if not mine:  # a hub id: nothing here to compare
        return
    if lineages is None:
        lineages = response_lineages(store_uri) or []
    old = legacy_tokenization(str(target))  # a record from before the files counted since: the same tokenization
    old = {"tokenizer_sha256": old["vocab_sha256"], "chat_template_sha256": old["chat_template_sha256"]}
    changed = []
    for key, what in TOKENIZATION.items():
        then = sorted({lin[key] for lin in lineages if lin.get(key)} - {mine[key], old[key]})
        if then and (key != "chat_template_sha256" or _has_chat_responses(store_uri)):
            changed.append(f"{what} (sha256 {', '.join(t[:12] for t in then[:3])} then, {mine[key][:12]} now)")
    if not changed:
        return
    message = (f"{stage}: the {' and the '.join(changed)} of run.target {target} changed since `ingest build` "
               f"generated the responses in {store_uri}: the stored token ids are not what the target produces "
               "now. Restore the target's files, re-run `ingest build` into a new store, or set "
               "run.off_policy=true if off-policy data is intended")
    if off_policy:
        log.warning("%s; going on because run.off_policy=true", message)
        return
    raise ConfigError(message)


def _has_chat_responses(store_uri: str) -> bool:
    return bool(store.read(store_uri, store.PROMPTS, columns=["sample_id"],
                           filter="split = 'train' AND mode = 'chat' AND finish_reason != ''").num_rows)


def require_target_folder(target: str) -> None:
    """A ``run.target`` written as a local path (absolute, ``./``, ``~``, in an existing folder, or of
    more than two parts) that is no folder: one line saying so, before any identity is compared (a
    hub id such as ``org/name`` is left to the stage that downloads it)."""
    text = str(target)
    if Path(text).expanduser().is_dir() or "://" in text:
        return
    local = (os.path.isabs(text) or text.startswith((".", "~")) or text.count("/") > 1
             or (os.sep in text and os.path.isdir(os.path.dirname(text))))
    if local:
        raise ConfigError(f"run.target: {text} does not exist (or is not a folder)")


def check_features(meta, target: str, *, off_policy: bool, stage: str) -> None:
    """Refuse (unless ``off_policy``) features captured from another target than ``target``."""
    require_target_folder(target)
    comps = meta.identity_components or {}
    have = comps.get("weights_sha256")
    if not have:
        return
    mine = target_id(str(target))
    if have != mine:
        _refuse_or_warn(f"{stage}: features table holds hidden states of {meta.target} (weights {have[:12]}), "
                        f"but run.target is {target} (weights {mine[:12]})", off_policy=off_policy)
    elif message := revision_change(comps, str(target), recorded="the features table's identity"):
        _refuse_or_warn(f"{stage}: {message}", off_policy=off_policy)  # one hub id at another revision


__all__ = ["check_features", "check_prompts", "check_tokenization", "generating_targets", "lineage_record",
           "require_target_folder", "response_lineages", "target_id", "tokenization_record"]
