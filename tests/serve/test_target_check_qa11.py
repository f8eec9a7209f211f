"""The target a draft is served or exported with (hostile pass 11).

A target named by hub id recorded ``hub:<id>`` alone: two captures of one id at two revisions were the same
feature set, and export, ``serve up`` and ``evaluate`` could not tell a draft trained on another revision.
The identity now records the revision the local cache resolves the id to (``target_revision``); export
refuses another one, serving and measuring warn, and an identity from before (no revision) is a warning,
never a refusal. Local folders: ``serve up`` / ``evaluate`` compared the tokenizer and template but never the
weights; other weights are now a one-line warning naming both hashes, hashed once per process.
No engine: the checks read provenance.json, checkpoint.json and the target's files."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

FS_TESTS = Path(__file__).resolve().parents[1] / "featurestore"
if str(FS_TESTS) not in sys.path:
    sys.path.insert(0, str(FS_TESTS))

import fs_helpers as H  # noqa: E402

from eaglenest.errors import ConfigError, StoreError  # noqa: E402
from eaglenest.featurestore.capture import build, identity  # noqa: E402
from eaglenest.featurestore.table import store  # noqa: E402
from eaglenest.serve.target_check import check_served_tokenization, check_target_weights  # noqa: E402

HUB = "acme/tiny"


@pytest.fixture
def hub_cache(tmp_path, tiny_target, monkeypatch):
    """A local Hugging Face cache holding the tiny target as ``acme/tiny``: ``revision(commit)`` adds a
    snapshot and points ``refs/main`` at it (what every loader then reads)."""
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    repo = cache / "models--acme--tiny"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)

    def revision(commit: str) -> None:
        shutil.copytree(tiny_target, repo / "snapshots" / commit)
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / "main").write_text(commit)

    return revision


def _components(target: str) -> dict:
    return identity.components(target=target, layer_ids=[2, 4, 5], last_layer_id=8, dtype="float32", storage="raw",
                               sample_ids=["a0", "a1"], gen_params_ids=["g0"])


def _meta(comps: dict):
    return dataclasses.replace(H.meta(target=comps["target"]), feature_set_id=identity.identity_hash(comps),
                               identity=json.dumps(comps, sort_keys=True))


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


# -- gap 1: the revision of a hub id ----------------------------------------------------------------


def test_two_revisions_of_one_hub_id_are_two_feature_sets(hub_cache, tiny_target):
    assert "target_revision" not in _components(HUB)  # not cached: nothing to record
    hub_cache("abc123")
    first = _components(HUB)
    assert first["weights_sha256"] == f"hub:{HUB}" and first["target_revision"] == "abc123"
    assert identity.target_record(HUB)["target_revision"] == "abc123"
    hub_cache("def456")
    second = _components(HUB)
    assert second["target_revision"] == "def456"
    assert identity.identity_hash(first) != identity.identity_hash(second)
    assert identity.differences(first, second) == [f"target_revision (key {identity.KEYS['target_revision']})"]
    # A local folder records no revision: the identities of the stores captured before stay the same.
    assert "target_revision" not in _components(str(tiny_target))


def test_a_capture_at_another_revision_is_refused_and_one_from_before_revisions_is_reused(hub_cache, tmp_path):
    hub_cache("abc123")
    at_first = _components(HUB)
    old = {k: v for k, v in at_first.items() if k != "target_revision"}  # captured before revisions counted
    hub_cache("def456")
    now = _meta(_components(HUB))
    for name, comps in (("at-abc", at_first), ("old", old)):
        store.append(str(tmp_path / "store"), name, H.table(["a0", "a1"], _meta(comps)), meta=_meta(comps))
    with pytest.raises(StoreError, match=r"differs in target_revision \(key run\.target"):
        build.check_reuse(str(tmp_path / "store"), "at-abc", now, pool_ids=["a0", "a1"])
    reused = build.check_reuse(str(tmp_path / "store"), "old", now, pool_ids=["a0", "a1"])
    assert reused is not None and reused.feature_set_id == identity.identity_hash(old)


def test_export_refuses_another_revision_of_the_hub_id_the_draft_was_trained_on(hub_cache, tmp_path, caplog):
    hub_cache("abc123")
    info = {"target": HUB, "target_weights_sha256": identity.weights_hash(HUB),
            "feature_meta": {"identity": json.dumps(_components(HUB))}}
    ckpt = tmp_path / "train" / "checkpoint.json"
    check_target_weights(info, HUB, ckpt=ckpt, off_policy=False)  # the same revision: exported
    hub_cache("def456")
    with pytest.raises(ConfigError) as err:
        check_target_weights(info, HUB, ckpt=ckpt, off_policy=False)
    assert "\n" not in str(err.value) and str(err.value).startswith(
        f"run.target: {HUB} is at revision def456 in the local Hugging Face cache, not at abc123"), err.value
    assert "run.off_policy=true" in str(err.value)
    with caplog.at_level(logging.WARNING):
        check_target_weights(info, HUB, ckpt=ckpt, off_policy=True)
    assert any("not at abc123" in w and "exporting anyway" in w for w in _warnings(caplog)), caplog.text
    # Recorded before revisions were: unknown, a warning, not a refusal.
    caplog.clear()
    old = {k: v for k, v in _components(HUB).items() if k != "target_revision"}
    with caplog.at_level(logging.WARNING):
        check_target_weights({**info, "feature_meta": {"identity": json.dumps(old)}}, HUB, ckpt=ckpt, off_policy=False)
    assert any("records no revision" in w and "def456" in w for w in _warnings(caplog)), caplog.text


def _draft(tmp_path, comps: dict, *, trained_weights: str | None = None) -> Path:
    """An export folder whose provenance.json records ``comps`` (and a checkpoint recording ``trained_weights``)."""
    draft, ckpt = tmp_path / "draft", tmp_path / "train"
    draft.mkdir()
    ckpt.mkdir()
    if trained_weights:
        (ckpt / "checkpoint.json").write_text(json.dumps({"target_weights_sha256": trained_weights}))
    (draft / "provenance.json").write_text(json.dumps({"inputs": {
        "checkpoint": str(ckpt), "target": comps["target"], "feature_identity": json.dumps(comps)}}))
    return draft


@pytest.mark.parametrize("stage", ["serving", "measuring"])
def test_serving_another_revision_of_the_hub_id_warns(hub_cache, tmp_path, caplog, stage):
    hub_cache("abc123")
    draft = _draft(tmp_path, _components(HUB), trained_weights=identity.weights_hash(HUB))
    with caplog.at_level(logging.WARNING):
        check_served_tokenization(draft, HUB, off_policy=False, stage=stage)
    assert _warnings(caplog) == []
    hub_cache("def456")
    with caplog.at_level(logging.WARNING):
        check_served_tokenization(draft, HUB, off_policy=False, stage=stage)
    (warning,) = _warnings(caplog)
    assert "is at revision def456" in warning and "not at abc123" in warning and f"{stage} it anyway" in warning


# -- gap 2: the weights of a local target folder -------------------------------------------------------


def _other_weights(src: Path, dst: Path) -> Path:
    """A copy of ``src`` whose weights differ in one value (same shapes, same tokenizer and template)."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] += 1
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("stage", ["serving", "measuring"])
@pytest.mark.parametrize("recorded_in", ["checkpoint", "identity"])
def test_serving_with_other_local_weights_warns_naming_both(tmp_path, tiny_target, caplog, monkeypatch, stage,
                                                            recorded_in):
    trained = identity.weights_hash(str(tiny_target))
    comps = _components(str(tiny_target))
    draft = _draft(tmp_path, comps, trained_weights=trained if recorded_in == "checkpoint" else None)
    same = tmp_path / "same weights"  # moved: a path is a name, the content is the identity
    shutil.copytree(tiny_target, same)
    other = _other_weights(tiny_target, tmp_path / "other weights")
    hashed = []
    real = identity._sha_file
    monkeypatch.setattr(identity, "_sha_file", lambda path, full: hashed.append(path.name) or real(path, full=full))
    with caplog.at_level(logging.WARNING):
        check_served_tokenization(draft, str(same), off_policy=False, stage=stage)
    assert _warnings(caplog) == []
    have = identity.weights_hash(str(other))
    assert have != trained
    for _ in range(2):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            check_served_tokenization(draft, str(other), off_policy=False, stage=stage)  # a warning, not a refusal
        (warning,) = _warnings(caplog)
        assert "\n" not in warning and warning.startswith(f"run.target: {other} (weights {have[:12]}) is not the "
                                                          f"target the draft was trained with ({tiny_target}, "
                                                          f"weights {trained[:12]} in "), warning
        assert f"{stage} it anyway" in warning
    assert hashed == ["model.safetensors", "model.safetensors"]  # each folder once, not once per check
