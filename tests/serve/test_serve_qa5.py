"""QA of serving and export, fourth pass: an exported config.json hand-edited in ways vLLM fails on
only once started (or on the first request), and checkpoint.json records whose damage exported
without complaint or as a traceback. Each is refused in one line naming the key and the file."""

from __future__ import annotations

import json
import shutil

import pytest

from eaglenest.errors import ConfigError, StoreError
from eaglenest.serve.cli import main as serve_main
from eaglenest.serve.draft_files import check_draft_dir, local_target_config
from eaglenest.serve.export import export_draft
from eaglenest.train.config import DFlashConfig, TrainConfig


def _copy(src, dst, edit=None, name="config.json"):
    shutil.copytree(src, dst)
    if edit is not None:
        path = dst / name
        data = json.loads(path.read_text())
        edit(data)
        path.write_text(json.dumps(data))
    return dst


@pytest.fixture(scope="module")
def dflash_export(tmp_path_factory, synth, tiny_target):
    """A 2-layer DFlash draft exported in vLLM's flat format."""
    cfg = TrainConfig(family="dflash", draft_vocab_size=8, dflash=DFlashConfig(block_size=3, num_layers=2))
    ckpt = synth.untrained_checkpoint(cfg, tiny_target, tmp_path_factory.mktemp("dflash") / "ckpt")
    return export_draft(ckpt, tmp_path_factory.mktemp("dflash_export") / "draft", target_dir=tiny_target)


@pytest.fixture(scope="module")
def speculators_export(tmp_path_factory, toy_checkpoint, tiny_target):
    return export_draft(toy_checkpoint, tmp_path_factory.mktemp("spec_export") / "draft", target_dir=tiny_target,
                        format="speculators")


@pytest.mark.parametrize("value, says", [
    (0, "num_hidden_layers: a positive integer, got 0"),
    ("1", "num_hidden_layers: a positive integer, got '1'"),
    (2, "num_hidden_layers is 2, "),
])
def test_an_eagle3_layer_count_vllm_cannot_build_is_refused(tmp_path, toy_export, tiny_target, value, says):
    """vLLM builds ``num_hidden_layers`` decoder layers: 0 fails on the weights' ``midlayer``, 2 on
    the layer the weights lack, both only once the engine has started."""
    draft = _copy(toy_export, tmp_path / "draft", lambda c: c.update(num_hidden_layers=value))
    with pytest.raises(ConfigError) as err:
        check_draft_dir(draft, local_target_config(tiny_target))
    assert says in str(err.value) and str(draft / "config.json") in str(err.value), err.value
    if value == 2:
        assert "model.safetensors holds 1 decoder layer(s)" in str(err.value)


@pytest.mark.parametrize("value", [0, 3])
def test_a_dflash_layer_count_other_than_the_weights_is_refused(tmp_path, dflash_export, tiny_target, value):
    draft = _copy(dflash_export, tmp_path / "draft", lambda c: c.update(num_hidden_layers=value))
    with pytest.raises(ConfigError, match="num_hidden_layers") as err:
        check_draft_dir(draft, local_target_config(tiny_target))
    assert repr(value) in str(err.value) or f"is {value}," in str(err.value)
    assert "holds 2 decoder layer(s)" in str(err.value) or "got 0" in str(err.value)


def test_a_speculators_layer_count_is_read_where_vllm_reads_it(tmp_path, speculators_export, tiny_target):
    draft = _copy(speculators_export, tmp_path / "draft",
                  lambda c: c["transformer_layer_config"].update(num_hidden_layers=0))
    with pytest.raises(ConfigError, match=r"transformer_layer_config\.num_hidden_layers: a positive integer, got 0"):
        check_draft_dir(draft, local_target_config(tiny_target))


@pytest.mark.parametrize("ids, key", [
    ([2, 4], "eagle_aux_hidden_state_layer_ids: 2 aux layers"),
    ([2, 4, 5, 6], "eagle_aux_hidden_state_layer_ids: 4 aux layers"),
])
def test_aux_layers_fc_cannot_read_are_refused(tmp_path, toy_export, tiny_target, ids, key):
    """vLLM sizes ``fc`` from ``eagle_config``'s list (3 ids) and concatenates the top-level ids' states:
    another count loads, then fails on the first request."""
    draft = _copy(toy_export, tmp_path / "draft", lambda c: c.update(eagle_aux_hidden_state_layer_ids=ids))
    with pytest.raises(ConfigError) as err:
        check_draft_dir(draft, local_target_config(tiny_target))
    assert key in str(err.value) and "fc.weight [128, 384]" in str(err.value), err.value


def test_serve_up_on_a_hand_edited_draft_is_one_line_and_starts_nothing(capsys, monkeypatch, tmp_path, root,
                                                                      toy_export):
    from eaglenest.serve.server import Server

    monkeypatch.setattr(Server, "start", lambda self: pytest.fail("a server was started"))
    _copy(toy_export, tmp_path / "draft", lambda c: c.update(eagle_aux_hidden_state_layer_ids=[2, 4]))
    code = serve_main(["up", f"--recipe={root / 'recipes' / 'toy.yaml'}", f"run.workdir={tmp_path}",
                       "serve.port=0", "--for-seconds=1"])
    assert code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"serve: error: {tmp_path}/draft/config.json: eagle_aux_hidden_state_layer_ids: 2 aux layers "
                     f"of 128 do not make the input of {tmp_path}/draft/model.safetensors's fc.weight [128, 384]; "
                     "export the draft again (`serve export`)"], lines
    assert not (tmp_path / "serve").exists()  # no server log: none started


def test_an_fc_width_vllm_would_build_otherwise_is_refused(tmp_path, toy_export, tiny_target):
    draft = _copy(toy_export, tmp_path / "draft",
                  lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[1, 3]))
    with pytest.raises(ConfigError, match=r"eagle_config\.eagle_aux_hidden_state_layer_ids: 2 aux layers of 128"):
        check_draft_dir(draft, local_target_config(tiny_target))


def test_a_draft_whose_fc_vllm_would_drop_is_refused(tmp_path, toy_export, tiny_target):
    """``eagle_config.use_aux_hidden_state: false``: vLLM skips ``fc`` and serves a draft without it."""
    draft = _copy(toy_export, tmp_path / "draft", lambda c: c["eagle_config"].update(use_aux_hidden_state=False))
    with pytest.raises(ConfigError, match=r"eagle_config\.use_aux_hidden_state: true .* got False"):
        check_draft_dir(draft, local_target_config(tiny_target))


def test_a_speculators_type_eaglenest_does_not_serve_is_refused(tmp_path, speculators_export, tiny_target):
    draft = _copy(speculators_export, tmp_path / "draft", lambda c: c.update(speculators_model_type="eagle9"))
    with pytest.raises(ConfigError, match=r"speculators_model_type: one of eagle3, peagle, dflash, got 'eagle9'"):
        check_draft_dir(draft, local_target_config(tiny_target))


def test_every_intact_export_passes(dflash_export, speculators_export, toy_export, tmp_path, toy_checkpoint,
                                    tiny_target):
    fp8 = export_draft(toy_checkpoint, tmp_path / "fp8", target_dir=tiny_target, quantization="fp8")
    for draft in (dflash_export, speculators_export, toy_export, fp8):
        check_draft_dir(draft, local_target_config(tiny_target))


def _ckpt(tmp_path, toy_checkpoint, edit):
    return _copy(toy_checkpoint, tmp_path / "ckpt", edit, name="checkpoint.json")


@pytest.mark.parametrize("window", ["x", 0, None])
def test_a_damaged_window_is_named(tmp_path, toy_checkpoint, tiny_target, window):
    """A sliding-window checkpoint whose window is not a count: "x" was "bad or missing value", 0 was
    exported as a window of 0 tokens."""
    ckpt = _ckpt(tmp_path, toy_checkpoint, lambda i: i["draft_config"].update(
        layer_types=["sliding_attention"], sliding_window=window))
    with pytest.raises(StoreError) as err:
        export_draft(ckpt, tmp_path / "draft", target_dir=tiny_target)
    assert f"draft_config.sliding_window: a whole number of tokens >= 1 for a sliding_attention layer, got " \
           f"{window!r}" in str(err.value), err.value
    assert not (tmp_path / "draft").exists()


@pytest.mark.parametrize("record", [[1], "x"])
def test_a_train_config_that_is_no_object_is_one_line(tmp_path, toy_checkpoint, tiny_target, record):
    """Was an AttributeError traceback from the family check."""
    ckpt = _ckpt(tmp_path, toy_checkpoint, lambda i: i.update(train_config=record))
    with pytest.raises(StoreError) as err:
        export_draft(ckpt, tmp_path / "draft", target_dir=tiny_target)
    assert f"checkpoint.json: train_config: an object, got {record!r}" in str(err.value), err.value


@pytest.mark.parametrize("steps", ["3", 2.5, 0, True])
def test_a_ttt_depth_that_is_no_count_is_refused(tmp_path, toy_checkpoint, tiny_target, steps):
    """The trained depth export records came from ``int(ttt_steps)``: 2.5 recorded 2, 0 and true 1."""
    ckpt = _ckpt(tmp_path, toy_checkpoint, lambda i: i["train_config"].update(ttt_steps=steps))
    with pytest.raises(StoreError, match=r"train_config\.ttt_steps: a whole number >= 1, got ") as err:
        export_draft(ckpt, tmp_path / "draft", target_dir=tiny_target)
    assert repr(steps) in str(err.value)


@pytest.mark.parametrize("name, dtype, says", [
    ("fc.weight", "int32", "tensor fc.weight is int32, the draft's is float32"),
    ("d2t", "float32", "tensor d2t is float32, the draft's is int64"),
])
def test_a_tensor_of_the_wrong_kind_is_refused(tmp_path, toy_checkpoint, tiny_target, name, dtype, says):
    """An integer weight was exported as is (vLLM would copy the integers into its float parameter) and a
    float ``d2t`` truncated to integers, with no word."""
    import torch
    from safetensors.torch import load_file, save_file

    ckpt = _ckpt(tmp_path, toy_checkpoint, lambda i: i.pop("weights_sha256", None))  # a hand-made checkpoint
    weights = ckpt / "draft.safetensors"
    state = load_file(str(weights))
    state[name] = state[name].to(getattr(torch, dtype)) + (0.5 if dtype == "float32" else 0)
    save_file(state, str(weights))
    with pytest.raises(StoreError) as err:
        export_draft(ckpt, tmp_path / "draft", target_dir=tiny_target)
    assert says in str(err.value) and "draft.safetensors" in str(err.value), err.value
    assert not (tmp_path / "draft").exists()


@pytest.mark.parametrize("scheme", ["file://", ""])
def test_an_export_into_a_file_uri_store_is_refused(capsys, tmp_path, root, toy_checkpoint, tiny_target, scheme):
    """``run.store=file:///...`` is a local store too: an export into a folder inside it was written there."""
    work, store = tmp_path / "work", tmp_path / "store"
    shutil.copytree(toy_checkpoint, work / "train")
    (store / "features.lance").mkdir(parents=True)
    code = serve_main(["export", f"--recipe={root / 'recipes' / 'toy.yaml'}", f"run.workdir={work}",
                       f"run.target={tiny_target}", f"run.store={scheme}{store}", "--out", str(store / "draft")])
    assert code == 2
    lines = [x for x in capsys.readouterr().err.strip().splitlines() if " INFO " not in x]
    assert lines == [f"serve: error: --out: {store}/draft would overwrite the feature store ({store}); "
                     "choose an empty or new folder"], lines
    assert sorted(p.name for p in store.iterdir()) == ["features.lance"]
