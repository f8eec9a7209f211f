"""``serve export`` QA repros (no engine starts): each case printed a traceback, blamed the wrong file,
failed on a usable folder, or wrote a draft vLLM would serve wrongly, before its fix.

* a target whose config.json lacks ``vocab_size`` (or holds text) was reported as a damaged
  *checkpoint*; a target of another vocabulary or with fewer layers than the draft's aux ids
  (a checkpoint exported with the wrong ``run.target``) exported without a word;
* ``--out`` a symlink to a folder (an empty one, or an earlier export) failed with "Not a directory";
* a checkpoint holding NaN (a diverged run), weights past float16's range, or a ``d2t`` mapping
  draft ids outside the target's vocabulary exported as if whole;
* a damaged record of the run in checkpoint.json (text where the model card formats a number, a
  list where it reads keys) was a traceback from the card.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch

from eaglenest.errors import ConfigError, StoreError
from eaglenest.serve.cli import main as serve_main
from eaglenest.serve.export import export_draft, is_export


def _target(tmp_path: Path, tiny_target: Path, **changes) -> Path:
    """A copy of the tiny target's config.json (all export reads of a target) with ``changes``
    (a value None removes the key)."""
    out = tmp_path / "other-target"
    out.mkdir()
    cfg = {**json.loads((tiny_target / "config.json").read_text()), **changes}
    (out / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    return out


@pytest.mark.parametrize("changes, says", [
    ({"vocab_size": None}, "config.json: vocab_size: a positive integer, got None"),
    ({"vocab_size": "big"}, "config.json: vocab_size: a positive integer, got 'big'"),
    ({"num_hidden_layers": None}, "config.json: num_hidden_layers: a positive integer, got None"),
    ({"vocab_size": 1000}, "config.json has vocab_size 1000, the draft in "),
    ({"hidden_size": 256}, "config.json has hidden_size 256, the draft in "),
    ({"num_hidden_layers": 4}, "config.json has 4 layers, the draft in "),
], ids=["no-vocab", "text-vocab", "no-layers", "other-vocab", "other-hidden", "fewer-layers"])
def test_export_for_another_target_is_refused(capsys, tmp_path, root, toy_checkpoint, tiny_target, changes, says):
    target = _target(tmp_path, tiny_target, **changes)
    work = tmp_path / "work"
    shutil.copytree(toy_checkpoint, work / "train")
    code = serve_main(["export", f"--recipe={root / 'recipes' / 'toy.yaml'}", f"run.workdir={work}",
                       f"run.target={target}"])
    assert code == 2
    lines = [x for x in capsys.readouterr().err.strip().splitlines() if " INFO " not in x]
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    assert lines[0].startswith(f"serve: error: run.target: {target}/config.json") and says in lines[0], lines[0]
    assert "checkpoint is damaged" not in lines[0]  # the target's file is named, not the checkpoint
    assert sorted(p.name for p in work.iterdir()) == ["train"]  # nothing written


def test_aux_ids_past_the_targets_layers_are_named(tmp_path, toy_checkpoint, tiny_target):
    target = _target(tmp_path, tiny_target, num_hidden_layers=4)
    with pytest.raises(ConfigError, match=r"reads aux layers \[4, 5\] \(vLLM ids 0\.\.3\)"):
        export_draft(toy_checkpoint, tmp_path / "draft", target_dir=target)


@pytest.mark.parametrize("earlier", [False, True], ids=["empty", "earlier-export"])
def test_out_may_be_a_symlink_to_a_folder(tmp_path, toy_checkpoint, toy_export, tiny_target, earlier):
    real = tmp_path / "disk" / "draft"
    if earlier:
        shutil.copytree(toy_export, real)
        (real / "README.md").write_text("old card")
    else:
        real.mkdir(parents=True)
    link = tmp_path / "draft"
    link.symlink_to(real, target_is_directory=True)
    assert export_draft(toy_checkpoint, link, target_dir=tiny_target) == link
    assert link.is_symlink() and link.resolve() == real.resolve()  # the link kept, pointing at the export
    assert is_export(real) and (real / "README.md").read_text() != "old card"
    assert sorted(p.name for p in real.parent.iterdir()) == ["draft"]  # no side folder left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["disk", "draft"]


def _checkpoint(out: Path, tiny_target: Path, damage) -> Path:
    """A toy checkpoint (as conftest's ``toy_checkpoint``) whose draft ``damage`` changed before it was
    saved: what a run writes, digest and all."""
    from eaglenest.train.checkpoint import save_checkpoint
    from eaglenest.train.config import TrainConfig
    from eaglenest.train.loop import build_draft
    from eaglenest.train.target import load_target_tensors
    from eaglenest.train.vocab import select_vocab

    vocab = select_vocab(torch.arange(2048, 0, -1).numpy(), 1024)
    model = build_draft(TrainConfig(draft_vocab_size=1024), load_target_tensors(tiny_target), layer_ids=(2, 4, 5),
                        vocab=vocab, seed=0)
    with torch.no_grad():
        damage(model)
    return save_checkpoint(out, model, info={"layer_ids": [2, 4, 5], "step": 1, "table_version": 1,
                                             "store_uri": "s", "train_config": {}})


def _state(model) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters()) | dict(model.named_buffers())


@pytest.mark.parametrize("quantization", ["none", "fp8"])
def test_nan_weights_are_refused(tmp_path, tiny_target, quantization):
    ckpt = _checkpoint(tmp_path / "train", tiny_target,
                       lambda m: _state(m)["midlayer.self_attn.q_proj.weight"].__setitem__((3, 5), float("nan")))
    with pytest.raises(StoreError, match=r"draft\.safetensors: tensor midlayer\.self_attn\.q_proj\.weight holds NaN"):
        export_draft(ckpt, tmp_path / "draft", target_dir=tiny_target, quantization=quantization)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train"]


def test_weights_past_float16_are_refused_naming_the_dtype(tmp_path, tiny_target):
    ckpt = _checkpoint(tmp_path / "train", tiny_target, lambda m: _state(m)["fc.weight"].__setitem__((0, 0), 1e6))
    with pytest.raises(ConfigError, match=r"serve\.dtype: tensor fc\.weight .* past float16's range .*1e\+06"):
        export_draft(ckpt, tmp_path / "draft", target_dir=tiny_target, dtype="float16")
    assert is_export(export_draft(ckpt, tmp_path / "draft", target_dir=tiny_target, dtype="bfloat16"))


@pytest.mark.parametrize("damage, says", [
    (lambda d2t: d2t.add_(3000), "d2t maps draft id 0 to target id 3000, outside the target's vocabulary 0..2047"),
    (lambda d2t: d2t.copy_(-torch.arange(len(d2t))), "d2t maps two draft ids to the same target id"),
], ids=["out-of-range", "duplicate"])
def test_a_vocab_map_outside_the_target_is_refused(tmp_path, tiny_target, damage, says):
    ckpt = _checkpoint(tmp_path / "train", tiny_target, lambda m: damage(_state(m)["d2t"]))
    with pytest.raises(StoreError, match=f"draft.safetensors: {says}"):
        export_draft(ckpt, tmp_path / "draft", target_dir=tiny_target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train"]


@pytest.mark.parametrize("key, value, says", [
    ("metrics", {"loss": "x"}, "metrics.loss: a number, got 'x'"),
    ("metrics", {"step_acc": "ab"}, "metrics.step_acc: a list of numbers, got 'ab'"),
    ("metrics", [1], "metrics: an object, got [1]"),
    ("train_config", [], "train_config: an object, got []"),
    ("train_config", {"ttt_steps": "x"}, "train_config.ttt_steps: a whole number >= 1, got 'x'"),
    ("train_config", {"family": 3}, "train_config: train.family: 'eagle3', 'peagle', 'dflash', got 3"),
    ("vocab_coverage", "x", "vocab_coverage: a number, got 'x'"),
    ("num_parameters", "many", "num_parameters: a number, got 'many'"),
    ("feature_meta", ["fs"], "feature_meta: an object, got ['fs']"),
], ids=["loss", "step-acc", "metrics", "train-config", "ttt-steps", "family", "coverage", "parameters", "meta"])
def test_a_damaged_run_record_is_one_line(capsys, tmp_path, root, toy_checkpoint, tiny_target, key, value, says):
    """checkpoint.json's record of the run (what the model card prints): before, a ValueError or
    AttributeError traceback from the card, or ``train.family`` blamed on the recipe."""
    work = tmp_path / "work"
    shutil.copytree(toy_checkpoint, work / "train")
    info = work / "train" / "checkpoint.json"
    info.write_text(json.dumps({**json.loads(info.read_text()), key: value}))
    code = serve_main(["export", f"--recipe={root / 'recipes' / 'toy.yaml'}", f"run.workdir={work}",
                       f"run.target={tiny_target}"])
    assert code == 2
    lines = [x for x in capsys.readouterr().err.strip().splitlines() if " INFO " not in x]
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    assert lines[0].startswith(f"serve: error: {info}: {says}") and "train again" in lines[0], lines[0]
    assert sorted(p.name for p in work.iterdir()) == ["train"]


@pytest.fixture
def umask():
    """Sets the process umask for the test (restored after)."""
    before = os.umask(0o022)
    yield os.umask
    os.umask(before)


@pytest.mark.parametrize("mask, folder, file", [(0o022, 0o755, 0o644), (0o077, 0o700, 0o600)],
                         ids=["umask-022", "umask-077"])
def test_the_users_umask_decides_the_exports_modes(tmp_path, toy_checkpoint, tiny_target, umask, mask, folder, file):
    """Before: the draft folder was mkdtemp's 0700 and model.safetensors safetensors' 0600 whatever the
    umask, so a server running as another user could not read a draft exported under umask 022."""
    umask(mask)
    out = export_draft(toy_checkpoint, tmp_path / "draft", target_dir=tiny_target)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in [out, *out.iterdir()]}
    assert modes == {"draft": folder, **{name: file for name in
                                         ("config.json", "model.safetensors", "README.md", "provenance.json")}}


@pytest.mark.parametrize("layer_ids, draft, says", [
    ([2, 2, 5], {}, "layer_ids: a list of distinct layer ids, got [2, 2, 5]"),
    ([True, 4, 5], {}, "layer_ids: a list of distinct layer ids, got [True, 4, 5]"),
    ([4, 5], {}, "layer_ids [4, 5] are not the aux layers draft_config reads ([2, 4, 5])"),
    ([2, 4, 5], {"rope_parameters": "default"}, "draft_config.rope_parameters: an object, got 'default'"),
    ([2, 4, 5], {"hidden_size": 64}, "draft_config.hidden_size 64 is not the target's 128"),
], ids=["duplicate-ids", "bool-id", "fewer-ids", "text-rope", "other-hidden"])
def test_a_damaged_draft_record_is_one_line(capsys, tmp_path, root, toy_checkpoint, tiny_target, layer_ids, draft,
                                            says):
    """checkpoint.json's description of the draft, damaged: before, aux ids [2, 2, 5], [True, 4, 5] (read
    as layer 1) or [4, 5] (fc is 3 layers wide) exported a draft vLLM would fail on mid-request or serve
    on other layers; a rope_parameters string was an AttributeError traceback; a draft hidden size unlike
    the target's was a line naming no file."""
    work = tmp_path / "work"
    shutil.copytree(toy_checkpoint, work / "train")
    info_path = work / "train" / "checkpoint.json"
    info = json.loads(info_path.read_text())
    info["layer_ids"], info["draft_config"] = layer_ids, {**info["draft_config"], **draft}
    info_path.write_text(json.dumps(info))
    code = serve_main(["export", f"--recipe={root / 'recipes' / 'toy.yaml'}", f"run.workdir={work}",
                       f"run.target={tiny_target}"])
    assert code == 2
    lines = [x for x in capsys.readouterr().err.strip().splitlines() if " INFO " not in x]
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    assert lines[0].startswith(f"serve: error: {info_path}: {says}") and "train again" in lines[0], lines[0]
    assert sorted(p.name for p in work.iterdir()) == ["train"]


def test_an_fp8_row_too_small_for_a_float32_scale_stays_finite(tmp_path, tiny_target):
    """A row whose largest |w| is under 448 x float32's smallest subnormal (here 1e-44) got scale
    amax / 448 = 0 (underflow), so its codes were 0 / 0 = NaN: the FP8 export held NaN weights."""
    from safetensors.torch import load_file

    from eaglenest.serve import fp8

    def tiny_row(model):
        w = _state(model)["midlayer.mlp.down_proj.weight"]
        w[7] = 0.0
        w[7, 3] = 1e-44

    ckpt = _checkpoint(tmp_path / "train", tiny_target, tiny_row)
    out = export_draft(ckpt, tmp_path / "draft", target_dir=tiny_target, dtype="float32", quantization="fp8")
    weights = load_file(str(out / "model.safetensors"))
    q, scale = weights["midlayer.mlp.down_proj.weight"], weights["midlayer.mlp.down_proj.weight_scale"]
    assert bool(torch.isfinite(q.float()).all()) and bool((scale > 0).all()), scale[7]
    row = fp8.dequantise(q, scale)[7]
    assert bool(torch.isfinite(row).all()) and float(row.abs().max()) <= 1e-43
