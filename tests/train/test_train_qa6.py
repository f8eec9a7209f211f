"""QA pass 6 on the training core: optimiser rates the float32 weights cannot take, a decay that
flips every weight's sign, and a draft vocabulary's bounds as the config checks them; each one line
naming the key, before any work."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from eaglenest.errors import ConfigError
from eaglenest.pipeline.train_cli import main
from eaglenest.train.config import TrainConfig
from eaglenest.train.vocab import select_vocab

sys.path.insert(0, str(Path(__file__).parent))
from test_qa_train import RECIPE  # noqa: E402  (shared helpers)


@pytest.mark.parametrize("lr", [1e39, 1e300])
def test_a_rate_past_float32_is_one_line_naming_it(tmp_path, capsys, lr):
    """train.lr=1e39 passed the recipe; AdamW's first step raised torch's RuntimeError "value cannot
    be converted to type float without overflow" (a traceback naming no key, after the data loaded)."""
    with pytest.raises(ConfigError) as info:
        TrainConfig(lr=lr)
    assert str(info.value).startswith("train.lr: at most 3.4e+38") and f"got {lr:g}" in str(info.value)
    rc = main(["run", "--recipe", RECIPE, f"run.workdir={tmp_path / 'w'}", f"train.lr={lr}", "--dry-run"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "error: train.lr: at most" in err[0], err
    assert TrainConfig(lr=1e30).lr == 1e30  # a diverging rate that torch takes: the loop's NaN check stops it


@pytest.mark.parametrize("lr, weight_decay", [(3e-3, 400.0), (1.0, 1.0), (3e-3, 1e300)])
def test_a_decay_that_flips_every_weight_is_refused_naming_it(lr, weight_decay):
    """AdamW multiplies each weight by 1 - lr x weight_decay every step: train.weight_decay=1e300
    trained to a NaN loss whose line blamed train.lr (the default, 0.003), and 400 flipped every
    weight's sign each step without a word."""
    with pytest.raises(ConfigError) as info:
        TrainConfig(lr=lr, weight_decay=weight_decay)
    msg = str(info.value)
    assert msg.startswith(f"train.weight_decay: {weight_decay:g} x train.lr={lr:g} is ") and ">= 1" in msg, msg
    assert TrainConfig(lr=lr, weight_decay=0.99 / lr).weight_decay == pytest.approx(0.99 / lr)


def test_a_draft_vocab_past_the_targets_names_the_range_the_config_takes():
    """The range named for train.draft_vocab_size said [1, V] where the config refuses 1 (a draft
    vocabulary of one token learns nothing): a user who lowered it to 1 met a second error."""
    counts = np.array([5, 3, 1, 0])
    with pytest.raises(ConfigError) as info:
        select_vocab(counts, 100)
    assert str(info.value) == "train.draft_vocab_size: 100 must be in [2, 4] (the target's vocabulary size)"
    with pytest.raises(ConfigError, match=r"^train.draft_vocab_size: must be >= 2"):
        TrainConfig(draft_vocab_size=1)
    assert select_vocab(counts, 2).draft_ids.tolist() == [0, 1]


@pytest.mark.parametrize("flag", ["norm_before_fc", "fc_norm", "norm_before_residual", "norm_output"])
def test_an_eagle31_option_on_a_dflash_draft_is_refused_naming_it(tmp_path, capsys, flag):
    """train.family=dflash train.fc_norm=true trained a DFlash draft without the norm (its layers have
    none), wrote fc_norm: true into checkpoint.json's draft_config, and `serve export` dropped it:
    the option asked for was silently not trained."""
    with pytest.raises(ConfigError) as info:
        TrainConfig(family="dflash", **{flag: True})
    assert str(info.value).startswith(f"train.{flag}: an EAGLE-3.1 option of train.family=eagle3 or peagle")
    rc = main(["run", "--recipe", RECIPE, f"run.workdir={tmp_path / 'w'}", "train.family=dflash",
               f"train.{flag}=true", "--dry-run"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and f"error: train.{flag}: an EAGLE-3.1 option" in err[0], err
    assert getattr(TrainConfig(family="peagle", **{flag: True}), flag) is True


@pytest.mark.parametrize("window", [2**31, 2**70])
def test_a_window_past_int32_is_one_line_naming_it(tmp_path, capsys, window):
    """train.sliding_window=2**70 passed the recipe, the data and the target loaded, and the first
    step died in the draft's attention mask with "OverflowError: int too big to convert" (a traceback,
    exit 1); vLLM's attention kernels take the window as a 32-bit integer."""
    with pytest.raises(ConfigError) as info:
        TrainConfig(sliding_window=window)
    assert str(info.value) == (f"train.sliding_window: at most {2**31 - 1} positions (vLLM's attention takes a "
                               f"32-bit window), 0 for none or 'auto', got {window}")
    rc = main(["run", "--recipe", RECIPE, f"run.workdir={tmp_path / 'w'}", f"train.sliding_window={window}",
               "--dry-run"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "error: train.sliding_window: at most" in err[0], err
    assert TrainConfig(sliding_window=2**31 - 1).sliding_window == 2**31 - 1
