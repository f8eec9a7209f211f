"""QA of ``serve export`` for the parallel drafters (P-EAGLE, DFlash): hand-damaged checkpoints that
exported a config vLLM would serve wrongly, and inputs of another family or target. Each is refused
in one line naming the key, the file or the flag to change."""

from __future__ import annotations

import json

import pytest

from eaglenest.engine import speculative_config
from eaglenest.errors import ConfigError, StoreError
from eaglenest.serve.cli import main as serve_main
from eaglenest.serve.draft_files import check_draft_dir, local_target_config
from eaglenest.serve.export import export_draft
from eaglenest.train.config import DFlashConfig, TrainConfig


def _edit(ckpt, edit):
    path = ckpt / "checkpoint.json"
    info = json.loads(path.read_text())
    edit(info)
    path.write_text(json.dumps(info))


@pytest.fixture(scope="module")
def dflash_ckpt(tmp_path_factory, synth, tiny_target):
    cfg = TrainConfig(family="dflash", draft_vocab_size=8, dflash=DFlashConfig(block_size=3, num_layers=1))
    return synth.untrained_checkpoint(cfg, tiny_target, tmp_path_factory.mktemp("dflash") / "ckpt")


@pytest.mark.parametrize("key, bad", [("dflash_block_size", 0), ("dflash_block_size", 4.5),
                                      ("dflash_block_size", 1), ("num_hidden_layers", 0),
                                      ("num_hidden_layers", 1.5)])
def test_a_dflash_shape_that_is_no_block_is_refused(tmp_path, dflash_ckpt, tiny_target, key, bad):
    """A DFlash checkpoint.json with ``block_size`` 0 or 4.5 exported without complaint: ``block_size``
    0 (K = -1) or 4 (4.5 cut to an integer) was written into config.json for vLLM to serve."""
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(dflash_ckpt, ckpt)
    _edit(ckpt, lambda i: (i["draft_config"].update({key: bad}), i["train_config"].pop("dflash")))
    with pytest.raises(StoreError, match="the checkpoint is damaged") as err:
        export_draft(ckpt, tmp_path / "draft", target_dir=tiny_target)
    assert f"draft_config.{key}: " in str(err.value) and repr(bad) in str(err.value)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "draft").exists()


@pytest.mark.parametrize("trained, asked", [("peagle", "dflash"), ("dflash", "peagle"), ("eagle3", "dflash"),
                                            ("eagle3", "peagle")])
def test_export_refuses_a_recipe_family_the_checkpoint_was_not_trained_as(capsys, tmp_path, root, synth,
                                                                          tiny_target, trained, asked):
    """``serve export train.family=dflash`` on a P-EAGLE checkpoint exported the checkpoint's own family
    without a word: the user believed they held the draft they asked for and served another. One line
    naming train.family, nothing written. (A recipe left at the default family exports the checkpoint's.)"""
    cfg = TrainConfig(family=trained, draft_vocab_size=8, dflash=DFlashConfig(block_size=3, num_layers=1))
    work = tmp_path / "work"
    synth.untrained_checkpoint(cfg, tiny_target, work / "train")
    extra = [f"train.family={asked}"]
    code = serve_main(["export", f"--recipe={root / 'recipes' / 'toy.yaml'}", f"run.workdir={work}",
                       f"run.target={tiny_target}", *extra])
    lines = [x for x in capsys.readouterr().err.strip().splitlines() if " INFO " not in x]
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"serve: error: train.family={asked}: "), lines[0]
    assert f"holds a {trained} draft" in lines[0] and f"train.family={trained}" in lines[0], lines[0]
    assert sorted(p.name for p in work.iterdir()) == ["train"]  # nothing written


@pytest.mark.parametrize("named", [True, False])
@pytest.mark.parametrize("family, key", [("peagle", "parallel_drafting"), ("dflash", "dflash_config")])
def test_export_with_the_trained_family_writes_what_vllm_reads(capsys, tmp_path, root, synth, tiny_target,
                                                                family, key, named):
    """Named, or left at the recipe's default: the checkpoint's own family is exported."""
    cfg = TrainConfig(family=family, draft_vocab_size=8, dflash=DFlashConfig(block_size=3, num_layers=1))
    work = tmp_path / "work"
    synth.untrained_checkpoint(cfg, tiny_target, work / "train")
    extra = [f"train.family={family}"] if named else []
    assert serve_main(["export", f"--recipe={root / 'recipes' / 'toy.yaml'}", f"run.workdir={work}",
                       f"run.target={tiny_target}", *extra]) == 0
    written = json.loads((work / "draft" / "config.json").read_text())
    assert key in written and speculative_config(str(work / "draft"), 2)["method"] == (
        "dflash" if family == "dflash" else "eagle3")
    assert speculative_config(str(work / "draft"), 2).get("parallel_drafting") is (True if family == "peagle" else None)


@pytest.mark.parametrize("family, key, bad", [
    ("peagle", "draft_config.peagle_num_slots", 0), ("peagle", "draft_config.peagle_num_slots", 2.5),
    ("peagle", "train_config.peagle.num_slots", 1), ("peagle", "train_config.peagle.num_slots", 2.5),
])
def test_a_peagle_depth_that_is_no_whole_count_is_refused(tmp_path, synth, tiny_target, family, key, bad):
    """A P-EAGLE checkpoint whose slot count (``train_config.peagle.num_slots``, what the exported K
    is read from, or the draft's own ``peagle_num_slots``) is 1, 0 or 2.5 exported a K cut to an
    integer (int(2.5) = 2) or clamped to 1 without a word: the other value, which would have
    contradicted it, is optional (checkpoints before it lack it)."""
    from eaglenest.train.config import PEagleConfig

    cfg = TrainConfig(family=family, draft_vocab_size=8, peagle=PEagleConfig(num_slots=2))
    ckpt = synth.untrained_checkpoint(cfg, tiny_target, tmp_path / "ckpt")
    where, _, name = key.partition(".")

    def damage(info):
        if where == "draft_config":
            info["draft_config"][name] = bad
            info["train_config"].pop(family)  # nothing to contradict it: only its own value is wrong
        else:
            section, _, field = name.partition(".")
            info["train_config"][section][field] = bad
            info["draft_config"].pop(f"{section}_{field}")

    _edit(ckpt, damage)
    with pytest.raises(StoreError, match="the checkpoint is damaged") as err:
        export_draft(ckpt, tmp_path / "draft", target_dir=tiny_target)
    assert f"{key}: a whole number >= 2, got {bad!r}" in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "draft").exists()


@pytest.mark.parametrize("family, depth", [("peagle", 2), ("dflash", 2)])
def test_draft_check_serves_the_k_the_draft_records(monkeypatch, capsys, tmp_path, synth, tiny_target, family,
                                                    depth):
    """``python -m eaglenest.serve.draft_check`` served every draft at K=3 (its --num-spec default):
    a P-EAGLE draft of 2 slots or a DFlash draft of block 3 (trained for 2 tokens a round) was
    checked past its trained depth, unlike ``serve up`` / ``evaluate al``, which serve the K the
    export records. --num-spec given still wins. (The engines are not started: ``check`` is stubbed.)"""
    from eaglenest.serve import draft_check
    from eaglenest.train.config import PEagleConfig

    cfg = TrainConfig(family=family, draft_vocab_size=8, peagle=PEagleConfig(num_slots=depth),
                      dflash=DFlashConfig(block_size=depth + 1, num_layers=1))
    draft = export_draft(synth.untrained_checkpoint(cfg, tiny_target, tmp_path / "ckpt"), tmp_path / "draft",
                         target_dir=tiny_target)
    seen = []
    monkeypatch.setattr(draft_check, "prompts_from_store", lambda uri, n: [[1, 2, 3]])
    monkeypatch.setattr(draft_check, "check", lambda *a, num_spec, **kw: seen.append(num_spec) or {"lossless": True})
    argv = [str(tiny_target), str(draft), "--prompts-from", str(tmp_path / "store")]
    assert draft_check.main(argv) == 0 and draft_check.main([*argv, "--num-spec", "1"]) == 0
    assert seen == [depth, 1]
    assert json.loads((draft / "config.json").read_text())["recommended_num_speculative_tokens"] == depth


@pytest.mark.parametrize("flag", ["yes", 1, "true"])
def test_a_parallel_drafting_flag_that_is_not_a_boolean_is_refused(tmp_path, root, synth, tiny_target, flag):
    """``parallel_drafting: "yes"`` read as no flag (only ``True`` turns parallel drafting on): a P-EAGLE
    draft was served sequentially, past the one slot it learnt. Refused by every reader of the draft."""
    cfg = TrainConfig(family="peagle", draft_vocab_size=8)
    work = tmp_path / "work"
    synth.untrained_checkpoint(cfg, tiny_target, work / "train")
    assert serve_main(["export", f"--recipe={root / 'recipes' / 'toy.yaml'}", f"run.workdir={work}",
                       f"run.target={tiny_target}", "train.family=peagle"]) == 0
    path = work / "draft" / "config.json"
    check_draft_dir(work / "draft", local_target_config(tiny_target))  # as exported: accepted
    path.write_text(json.dumps({**json.loads(path.read_text()), "parallel_drafting": flag}))
    with pytest.raises(ConfigError, match=rf"config.json: parallel_drafting: true or false, got {flag!r}"):
        check_draft_dir(work / "draft", local_target_config(tiny_target))
