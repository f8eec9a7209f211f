"""QA repros, seventh pass, for the three draft families exported (``serve export``): each family's
export in both formats, as a user reads it."""

from __future__ import annotations

import json
import re

import pytest

from eaglenest.engine import draft_num_speculative_tokens
from eaglenest.errors import ConfigError
from eaglenest.serve.config import ServeConfig
from eaglenest.serve.export import export_draft
from eaglenest.serve.push import plan_push
from eaglenest.train.config import DFlashConfig, PEagleConfig, TrainConfig

FAMILIES = {"eagle3": TrainConfig(draft_vocab_size=16, ttt_steps=2),
            "peagle": TrainConfig(family="peagle", draft_vocab_size=16, peagle=PEagleConfig(num_slots=2))}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, synth, tiny_target):
    root = tmp_path_factory.mktemp("families qa7")
    return {family: synth.untrained_checkpoint(cfg, tiny_target, root / family) for family, cfg in FAMILIES.items()}


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("k", [None, 1])
def test_a_speculators_cards_default_k_is_the_one_its_config_serves(checkpoints, tiny_target, tmp_path, family, k):
    """An Eagle-3 or P-EAGLE draft exported with ``serve.format=speculators``: its config.json serves
    it at K (its proposal's ``speculative_tokens``), yet its card said "speculative tokens when none
    is set | n/a" (the vLLM-format export's card, and a DFlash one's, give the K)."""
    out = export_draft(checkpoints[family], tmp_path / "draft", target_dir=tiny_target, format="speculators",
                       num_speculative_tokens=k)
    served = draft_num_speculative_tokens(str(out), 99)
    assert served == (k or 2)  # the family's default, capped at the 2 tokens a round it was trained for
    card = (out / "README.md").read_text(encoding="utf-8")
    (row,) = re.findall(r"^\| speculative tokens when none is set \| (\S+) ", card, flags=re.M)
    assert row == str(served), row
    vllm = export_draft(checkpoints[family], tmp_path / "vllm", target_dir=tiny_target, num_speculative_tokens=k)
    assert json.loads((vllm / "config.json").read_text())["recommended_num_speculative_tokens"] == served


@pytest.fixture(scope="module")
def dflash_checkpoint(tmp_path_factory, synth, tiny_target):
    cfg = TrainConfig(family="dflash", draft_vocab_size=16, dflash=DFlashConfig(num_layers=1, block_size=4))
    return synth.untrained_checkpoint(cfg, tiny_target, tmp_path_factory.mktemp("dflash qa7") / "ckpt")


@pytest.mark.parametrize("family, fmt, name", [("eagle3", "vllm", "EAGLE-3"), ("peagle", "vllm", "P-EAGLE"),
                                               ("peagle", "speculators", "P-EAGLE"), ("dflash", "vllm", "DFlash"),
                                               ("dflash", "speculators", "DFlash")])
def test_a_pushed_draft_is_tagged_and_committed_as_its_family(checkpoints, dflash_checkpoint, tiny_target, tmp_path,
                                                              family, fmt, name):
    """``serve push`` of a P-EAGLE or DFlash export: the Hub card's tags said ``eagle3`` and the commit
    "eaglenest EAGLE-3 draft", so the Hub listed a DFlash block drafter as an EAGLE-3 head."""
    ckpt = dflash_checkpoint if family == "dflash" else checkpoints[family]
    out = export_draft(ckpt, tmp_path / "draft", target_dir=tiny_target, format=fmt)
    plan = plan_push(out, repo_id="me/draft", licences={"src": "mit"})
    tags = plan.card.split("\ntags:\n", 1)[1].split("\n---\n", 1)[0].split("\n")
    assert f"- {family}" in tags and tags.count("- eagle3") == (family == "eagle3"), tags
    assert plan.commit_message.startswith(f"eaglenest {name} draft ({fmt} format"), plan.commit_message


@pytest.mark.parametrize("subdir", ["serve", "logs", "./serve/", "logs/."])
def test_the_draft_folder_is_not_where_the_servers_write_their_logs(subdir):
    """``serve.draft_subdir=serve``: ``serve up`` (and ``evaluate throughput``) write their server logs
    to ``<workdir>/serve``, every engine command its vLLM log to ``<workdir>/logs``: the draft being
    served gained ``vllm-spec-8000.log``, which ``serve push`` then uploaded with the weights, and the
    next ``serve export`` refused the folder ("holds files that are not an exported draft")."""
    with pytest.raises(ConfigError) as err:
        ServeConfig(draft_subdir=subdir)
    assert str(err.value).startswith(f"serve.draft_subdir: {subdir!r} is where "), str(err.value)
    assert "choose another folder" in str(err.value)
    ServeConfig(draft_subdir="serve/draft")  # a folder inside theirs holds no log
    ServeConfig(draft_subdir="servedraft")


@pytest.mark.parametrize("fmt", ["speculators", "vllm"])
def test_an_export_given_as_the_checkpoint_is_named_as_one(checkpoints, tiny_target, tmp_path, fmt):
    """``serve export serve.checkpoint_subdir=draft`` (re-exporting a speculators export in vLLM's format):
    the refusal said the folder was "not a draft checkpoint; run `train run` first", to a user whose
    training had run; it now says the folder is an export and names the checkpoint it came from."""
    first = export_draft(checkpoints["peagle"], tmp_path / "first", target_dir=tiny_target, format=fmt)
    with pytest.raises(ConfigError) as err:
        export_draft(first, tmp_path / "again", target_dir=tiny_target, format="vllm")
    msg = str(err.value)
    assert msg.startswith(f"serve.checkpoint_subdir: {first} holds an exported draft, not a training checkpoint"), msg
    assert str(checkpoints["peagle"]) in msg and "\n" not in msg
    assert not (tmp_path / "again").exists()
