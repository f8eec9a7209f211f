"""``serve export``'s check that ``run.target`` is the target the draft was trained with.

The draft learnt the hidden states of one set of weights over the token ids one tokenizer and one
chat template produced; vLLM serves it with the target it is exported for, tokenizing prompts with
that target's tokenizer and rendering chats with its template. A target of the same shape but other
weights, another tokenizer or an edited template would serve the draft on inputs it never saw: a
valid config.json and a quietly low acceptance length. So export compares what the checkpoint
records (``target_weights_sha256``; its features' identity ``tokenizer_sha256`` and
``chat_template_sha256``, featurestore/capture/identity.py) with the target's files, and refuses a
difference in one line naming both sides, or with ``run.off_policy=true`` exports with a warning.

``serve up`` and ``evaluate al`` / ``throughput`` / ``parity`` serve an export with ``run.target`` and compare
the same way (:func:`check_served_tokenization`: the identity the export's provenance.json records, else its
checkpoint's): ``serve up`` refuses a difference as export does, ``evaluate`` measures with a warning.

They also compare the weights (a warning, serving or measuring): those the draft was trained with
(checkpoint.json's ``target_weights_sha256``, else the feature identity's ``weights_sha256``) with the local
target folder's, hashed once per process (``identity.weights_hash`` caches each content by its files' stat).

A target named by hub id has no files here: its weights are ``hub:<id>``, and what pins them is the revision
it is read at (``run.target_revision``, else the one its local cache resolves ``main`` to: ``identity.hub_revision``),
which the feature identity records as ``target_revision``: export refuses another revision of the same id as it
refuses other weights, ``serve up`` and ``evaluate`` warn (``identity.revision_change``, as capture and train).
An identity recorded before revisions were (a ``hub:<id>`` alone) is an unknown revision: a warning, never a
refusal.

Trade-off: a checkpoint without the record (saved before it, or trained from imported features that
carry no identity), or a hub id on one side and a local folder on the other, is not checked.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any, Literal

from eaglenest.errors import ConfigError
from eaglenest.featurestore.capture.identity import (legacy_tokenization, revision_change, tokenizer_hashes,
                                                     weights_hash)
from eaglenest.paths import shown_path

log = logging.getLogger(__name__)

#: Feature identity key -> what it hashes (named in the refusal).
TOKENIZATION = {"tokenizer_sha256": "tokenizer files", "chat_template_sha256": "chat template"}
#: ``chat_template_sha256`` of a target without a chat template: its features hold no chat, so a template
#: added since changes nothing the draft learnt (a base model's draft, ingested raw).
NO_TEMPLATE = hashlib.sha256(b"").hexdigest()


def check_target_weights(info: dict[str, Any], target: str, *, ckpt: Path, off_policy: bool) -> None:
    """``target`` holds the weights the draft was trained with (checkpoint.json's ``target_weights_sha256``;
    a checkpoint saved before it, or a target named by hub id on either side, is not checked): a target
    of the same shape but other weights is refused, or with ``off_policy`` exported with a warning."""
    want = info.get("target_weights_sha256")
    if not isinstance(want, str) or not want:
        return
    have = weights_hash(target)
    if have == want and want.startswith("hub:"):  # the same hub id: the same weights if the same revision
        meta = info.get("feature_meta")
        message = revision_change(_identity(meta.get("identity") if isinstance(meta, dict) else None), target,
                                  recorded=f"the feature identity of {shown_path(ckpt)}")
        if not message:
            return
    elif have == want or "hub:" in (have[:4], want[:4]):  # a hub id beside a folder: no weights to compare
        return
    else:
        message = (f"run.target: {target} (weights {have[:12]}) is not the target the draft in {shown_path(ckpt)} "
                   f"was trained with ({info.get('target')}, weights {want[:12]})")
    if off_policy:
        log.warning("%s; exporting anyway because run.off_policy=true", message)
        return
    raise ConfigError(f"{message}: export it with that target, or set run.off_policy=true if intended")


def check_tokenization(info: dict[str, Any], target: str, *, ckpt: Path, off_policy: bool) -> None:
    """``target``'s tokenizer files and chat template are the ones the draft's features were captured
    with (``feature_meta.identity`` in checkpoint.json): another tokenizer or template is refused naming
    both hashes and where each comes from, or with ``off_policy`` exported with a warning."""
    meta = info.get("feature_meta")
    comps = _identity(meta.get("identity") if isinstance(meta, dict) else None)
    message = _tokenization_changes(comps, target, trained_on=str(comps.get("target") or info.get("target") or "?"),
                                    recorded=f"the feature identity of {shown_path(ckpt)}")
    if not message:
        return
    if off_policy:
        log.warning("%s; exporting anyway because run.off_policy=true", message)
        return
    raise ConfigError(f"{message}; export it with the target's tokenizer and template it was trained with, or set "
                      "run.off_policy=true if intended")


def check_served_tokenization(draft: str | Path, target: str, *, off_policy: bool,
                              stage: Literal["serving", "measuring"] = "serving") -> None:
    """``serve up`` / ``evaluate al``: ``target``'s tokenizer files and chat template are the ones the
    exported ``draft``'s features were captured with (its provenance.json's ``inputs.feature_identity``,
    else the identity in the checkpoint.json it was exported from). Serving, another one is refused in
    one line unless ``off_policy`` (a warning then); measuring (``evaluate al``), it is a warning. An
    export that records no identity (another tool's draft, or one exported before the record) is not
    checked."""
    prov = _json_file(Path(draft) / "provenance.json")
    inputs = prov.get("inputs") if isinstance(prov.get("inputs"), dict) else {}
    comps = _identity(inputs.get("feature_identity"))
    recorded = f"the feature identity in {shown_path(Path(draft) / 'provenance.json')}"
    ckpt = Path(inputs["checkpoint"]) / "checkpoint.json" if isinstance(inputs.get("checkpoint"), str) \
        and inputs["checkpoint"] else None
    info = _json_file(ckpt) if ckpt else {}
    if not comps and ckpt:
        meta = info.get("feature_meta")
        comps = _identity(meta.get("identity") if isinstance(meta, dict) else None)
        recorded = f"the feature identity of {shown_path(ckpt)}"
    trained_on = str(comps.get("target") or inputs.get("target") or "?")
    weights = _served_weights(comps, info, target, trained_on=trained_on, recorded=recorded, ckpt=ckpt)
    if weights:  # a warning, serving or measuring: the draft still drafts, at a lower acceptance length
        log.warning("%s; %s it anyway", weights, stage)
    message = _tokenization_changes(comps, target, trained_on=trained_on, recorded=recorded)
    if not message:
        return
    if stage == "measuring" or off_policy:
        log.warning("%s; %s it anyway%s", message, stage, " because run.off_policy=true" if off_policy else "")
        return
    raise ConfigError(f"{message}; serve it with the target's tokenizer and template it was trained with, or set "
                      "run.off_policy=true if intended")


def _served_weights(comps: dict[str, Any], info: dict[str, Any], target: str, *, trained_on: str, recorded: str,
                    ckpt: Path | None) -> str:
    """The line naming ``target``'s weights when they are not those the draft was trained with (``info``:
    its checkpoint.json's ``target_weights_sha256``, else the feature identity ``comps``' ``weights_sha256``),
    both local folders; for a hub id, its revision (``identity.revision_change``). Empty when they agree, or
    when nothing (or a hub id beside a folder) can be compared."""
    want, where = info.get("target_weights_sha256"), shown_path(ckpt) if ckpt else ""
    if not isinstance(want, str) or not want:
        want, where = comps.get("weights_sha256"), recorded
    if not isinstance(want, str) or not want:
        return ""
    if want.startswith("hub:"):
        return revision_change(comps, target, recorded=recorded) if want == f"hub:{target}" else ""
    if not Path(target).is_dir():
        return ""
    have = weights_hash(target)  # cached per process by the files' stat: not hashed again by a later check
    if have == want:
        return ""
    return (f"run.target: {target} (weights {have[:12]}) is not the target the draft was trained with "
            f"({trained_on}, weights {want[:12]} in {where}): its drafts are verified by other weights")


def _tokenization_changes(comps: dict[str, Any], target: str, *, trained_on: str, recorded: str) -> str:
    """The line naming the tokenizer files or chat template of ``target`` that differ from the feature
    identity ``comps`` (``recorded``: where it was read); empty when none does, when the identity records
    none, or when either side is a hub id (no files to compare)."""
    if not comps or not Path(target).is_dir() or str(comps.get("weights_sha256", "")).startswith("hub:"):
        return ""
    have = dict(zip(TOKENIZATION, tokenizer_hashes(target)))
    old = legacy_tokenization(target)  # an identity from before the files counted since: the same tokenization
    changed = [f"{what} (sha256 {comps[key][:12]} in {recorded}, {have[key][:12]} in {target})"
               for key, what in TOKENIZATION.items() if isinstance(comps.get(key), str)
               and comps[key] not in (have[key], old[key])
               and not (key == "chat_template_sha256" and comps[key] == NO_TEMPLATE)]
    if not changed:
        return ""
    return (f"run.target: the {' and the '.join(changed)} differ from those of {trained_on}, which the draft "
            "was trained on: vLLM would serve it on token ids it never saw")


def _json_file(path: Path) -> dict[str, Any]:
    """A JSON object file's contents; {} when absent, unreadable or not an object (nothing recorded)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _identity(text: Any) -> dict[str, Any]:
    """The feature identity's components (a JSON object in ``feature_meta.identity``); {} when absent or
    not an object (a table imported from a peer's dump records none)."""
    if not isinstance(text, str) or not text:
        return {}
    try:
        comps = json.loads(text)
    except ValueError:
        return {}
    return comps if isinstance(comps, dict) else {}
