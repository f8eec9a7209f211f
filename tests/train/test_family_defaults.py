"""``train.family=<family>`` as the only override picks that family's defaults end to end: its
training shape (train/config.py), the number of speculative tokens ``serve export`` records in the
draft (its measured best, docs/families.md), and what ``serve up`` and ``evaluate`` then use when the
recipe sets no ``num_speculative_tokens``; a recipe's own K still wins. No engine is started."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from eaglenest.engine import RECOMMENDED_K, draft_num_speculative_tokens
from eaglenest.errors import ConfigError
from eaglenest.evaluate.config import EvaluateConfig
from eaglenest.evaluate.settings import evaluate_config, with_draft_k
from eaglenest.recipe import load_recipe
from eaglenest.serve.commands import up_server
from eaglenest.serve.config import ServeConfig
from eaglenest.serve.export import export_draft
from eaglenest.train.config import (BEST_NUM_SPECULATIVE_TOKENS, FAMILIES, DFlashConfig, PEagleConfig, TrainConfig,
                                    recommended_num_speculative_tokens)

TOY = Path(__file__).resolve().parents[2] / "recipes" / "toy.yaml"


def toy(tmp_path: Path, target: Path, *overrides: str):
    """The demo recipe in a scratch workdir; ``chat_template_kwargs`` set so no store is read, any
    free port for ``serve up`` (the default 8000 may be taken on a shared machine)."""
    return load_recipe(TOY, [f"run.workdir={tmp_path / 'w'}", f"run.target={target}",
                             "evaluate.chat_template_kwargs={}", "serve.port=0", *overrides])


def test_chosen_defaults():
    """The values docs/families.md reports as measured best on the demo (bench/families.py)."""
    assert BEST_NUM_SPECULATIVE_TOKENS == {"eagle3": 3, "peagle": 3, "dflash": 7}
    assert (PEagleConfig().num_slots, DFlashConfig().block_size, DFlashConfig().num_layers) == (4, 8, 2)
    # Each family's K is one its default shape was trained for (not capped).
    for family in FAMILIES:
        assert recommended_num_speculative_tokens(dataclasses.asdict(TrainConfig(family=family))) == \
            BEST_NUM_SPECULATIVE_TOKENS[family]


@pytest.mark.parametrize("family", FAMILIES)
def test_family_alone_resolves_its_defaults(family, tmp_path, tiny_target):
    recipe = toy(tmp_path, tiny_target, f"train.family={family}")
    # The demo recipe's sliding_window=auto is valid for every family (no window for DFlash).
    assert recipe.train.family == family and recipe.train.sliding_window == "auto"
    assert recipe.serve.num_speculative_tokens is None and recipe.evaluate.num_speculative_tokens is None
    k = recommended_num_speculative_tokens(dataclasses.asdict(recipe.train))
    assert k == BEST_NUM_SPECULATIVE_TOKENS[family]
    # No draft exported yet (served-AL selection during training): the family's best.
    assert evaluate_config(recipe).num_speculative_tokens == k
    assert evaluate_config(toy(tmp_path, tiny_target, f"train.family={family}",
                               "evaluate.num_speculative_tokens=5")).num_speculative_tokens == 5


def test_recommendation_is_capped_by_the_trained_depth():
    assert recommended_num_speculative_tokens({"family": "peagle", "peagle": {"num_slots": 2}}) == 2
    assert recommended_num_speculative_tokens({"family": "dflash", "dflash": {"block_size": 4}}) == 3
    assert recommended_num_speculative_tokens({"family": "dflash", "dflash": {"block_size": 2}}) == 1
    assert recommended_num_speculative_tokens({"family": "eagle3", "ttt_steps": 1}) == 1
    assert recommended_num_speculative_tokens({}) == BEST_NUM_SPECULATIVE_TOKENS["eagle3"]  # older checkpoints
    with pytest.raises(ConfigError, match="train.family"):
        recommended_num_speculative_tokens({"family": "medusa"})


def test_num_speculative_tokens_null_or_at_least_one():
    assert ServeConfig().num_speculative_tokens is None and EvaluateConfig().num_speculative_tokens is None
    with pytest.raises(ConfigError, match=r"serve\.num_speculative_tokens: must be >= 1 or null"):
        ServeConfig(num_speculative_tokens=0)
    with pytest.raises(ConfigError, match=r"evaluate\.num_speculative_tokens: must be >= 1 or null"):
        EvaluateConfig(num_speculative_tokens=0)


def _with_tokenizer(tmp_path: Path, target: Path) -> Path:
    """A copy of the synthetic target with the repo's tiny-target tokenizer files: ``serve up`` refuses a
    target without a tokenizer (``hf.check_target``)."""
    out = tmp_path / "target"
    shutil.copytree(target, out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copyfile(TOY.parents[1] / "assets" / "tiny-target" / name, out / name)
    return out


def test_dflash_alone_end_to_end(tmp_path, tiny_target, synth):
    """train.family=dflash alone: the trainer's config, the export's recorded K, and the K that
    ``evaluate`` and ``serve up`` resolve from the exported draft."""
    tiny_target = _with_tokenizer(tmp_path, tiny_target)
    recipe = toy(tmp_path, tiny_target, "train.family=dflash")
    s = recipe.serve
    ckpt = synth.untrained_checkpoint(recipe.train, tiny_target, recipe.run.path(s.checkpoint_subdir))
    draft = export_draft(ckpt, recipe.run.path(s.draft_subdir), target_dir=tiny_target,
                         num_speculative_tokens=s.num_speculative_tokens)  # as `serve export` calls it
    cfg = json.loads((draft / "config.json").read_text())
    k = BEST_NUM_SPECULATIVE_TOKENS["dflash"]
    assert cfg[RECOMMENDED_K] == k and cfg["block_size"] == recipe.train.dflash.block_size
    assert f"use {k} when the recipe sets none" in (draft / "README.md").read_text()
    assert draft_num_speculative_tokens(str(draft), 99) == k
    assert evaluate_config(recipe).num_speculative_tokens == k
    assert with_draft_k(EvaluateConfig(), str(draft)).num_speculative_tokens == k  # a config built in code
    argv = up_server(recipe).argv
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec == {"method": "dflash", "model": str(draft), "num_speculative_tokens": k}
    # The recipe's own K wins over the draft's, in both.
    mine = toy(tmp_path, tiny_target, "train.family=dflash", "serve.num_speculative_tokens=2",
               "evaluate.num_speculative_tokens=2")
    assert evaluate_config(mine).num_speculative_tokens == 2
    argv = up_server(mine).argv
    assert json.loads(argv[argv.index("--speculative-config") + 1])["num_speculative_tokens"] == 2


def test_explicit_export_k_is_recorded(tmp_path, tiny_target, synth):
    """``serve.num_speculative_tokens`` given at export is the draft's recorded K; an export without
    the record (older drafts) falls back to the caller's default."""
    ckpt = synth.untrained_checkpoint(TrainConfig(family="peagle"), tiny_target, tmp_path / "ckpt")
    draft = export_draft(ckpt, tmp_path / "draft", target_dir=tiny_target, num_speculative_tokens=2)
    assert draft_num_speculative_tokens(str(draft), 99) == 2
    cfg = json.loads((draft / "config.json").read_text())
    del cfg[RECOMMENDED_K]
    (draft / "config.json").write_text(json.dumps(cfg))
    assert draft_num_speculative_tokens(str(draft), 7) == 7
