"""``serve export`` of a checkpoint whose record contradicts its draft: a ``train_config.family`` (or
slot count / block size) hand-edited away from what ``draft_config`` builds exported silently with
the other family's K; a mask token outside the target's vocabulary was written into the export. And
a P-EAGLE/DFlash depth longer than a packed row is refused when the recipe loads (it failed to
allocate at the first step). The card's usage snippet serves the K the export records."""

from __future__ import annotations

import json

import pytest

from eaglenest.errors import ConfigError, StoreError
from eaglenest.serve.export import export_draft
from eaglenest.train.config import DFlashConfig, PEagleConfig, TrainConfig


def _edit(ckpt, edit):
    path = ckpt / "checkpoint.json"
    info = json.loads(path.read_text())
    edit(info)
    path.write_text(json.dumps(info))


@pytest.mark.parametrize("cfg, edit, says", [
    (TrainConfig(family="peagle", peagle=PEagleConfig(num_slots=2)),
     lambda i: i["train_config"].update(family="eagle3"), "train_config.family 'eagle3' does not describe the peagle"),
    (TrainConfig(family="eagle3"),
     lambda i: i["train_config"].update(family="dflash"), "train_config.family 'dflash' does not describe the eagle3"),
    (TrainConfig(family="peagle", peagle=PEagleConfig(num_slots=2)),
     lambda i: i["train_config"]["peagle"].update(num_slots=6), "train_config.peagle.num_slots 6 is not the draft's 2"),
    (TrainConfig(family="dflash", dflash=DFlashConfig(block_size=3, num_layers=1)),
     lambda i: i["draft_config"].update(mask_token_id=10**6), "draft_config.mask_token_id: a token id of the target's"),
])
def test_a_record_that_contradicts_the_draft_is_refused(tmp_path, synth, tiny_target, cfg, edit, says):
    ckpt = synth.untrained_checkpoint(cfg, tiny_target, tmp_path / "ckpt")
    _edit(ckpt, edit)
    with pytest.raises(StoreError, match="the checkpoint is damaged") as err:
        export_draft(ckpt, tmp_path / "draft", target_dir=tiny_target)
    assert says in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "draft").exists()


def test_the_card_snippet_serves_the_recorded_k(tmp_path, synth, tiny_target):
    ckpt = synth.untrained_checkpoint(TrainConfig(family="eagle3", ttt_steps=2), tiny_target, tmp_path / "ckpt")
    card = (export_draft(ckpt, tmp_path / "draft", target_dir=tiny_target) / "README.md").read_text()
    assert '"num_speculative_tokens": 2' in card and '"num_speculative_tokens": 3' not in card


@pytest.mark.parametrize("family, key, cfg", [
    ("peagle", "peagle.num_slots", {"peagle": PEagleConfig(num_slots=65)}),
    ("dflash", "dflash.block_size", {"dflash": DFlashConfig(block_size=65)}),
])
def test_a_depth_longer_than_a_packed_row_is_refused(family, key, cfg):
    with pytest.raises(ConfigError, match=f"train.{key}: 65 is more than a packed row holds"):
        TrainConfig(family=family, pack_tokens=64, attn_chunk_tokens=64, **cfg)
    TrainConfig(family=family, pack_tokens=65, attn_chunk_tokens=65, **cfg)
