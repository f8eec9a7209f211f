"""QA of serving, sixth pass: an exported draft whose ``architectures`` name no draft class vLLM has,
vocabulary maps ``t2d`` and ``d2t`` that disagree (written by export, served by vLLM without a word),
and ``draft_check``'s engine failures and targets of few positions."""

from __future__ import annotations

import json
import shutil

import pytest

from eaglenest.errors import ConfigError, StoreError
from eaglenest.serve import draft_check
from eaglenest.serve.cli import main as serve_main
from eaglenest.serve.draft_files import check_draft_dir, local_target_config
from eaglenest.serve.export import export_draft
from eaglenest.serve.server import Server


def _with_config(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **changes}))
    return dst


def _with_t2d(src, dst, name, flip_ids):
    """A copy of the folder ``src`` whose weights file ``name`` has ``t2d`` flipped at ``flip_ids``."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(dst / name)
    for i in flip_ids:
        tensors["t2d"][i] = not bool(tensors["t2d"][i])
    save_file(tensors, dst / name)
    return dst


def test_serve_up_refuses_a_draft_class_vllm_does_not_have(tmp_path, root, toy_export, monkeypatch, capsys):
    """vLLM renames the draft's class (``X`` to ``Eagle3X``) and fails on one it lacks once its server
    started, with a traceback listing its classes in the server's log."""
    monkeypatch.setattr(Server, "start", lambda self: pytest.fail("a server was started"))
    _with_config(toy_export, tmp_path / "draft", architectures=["LlamaForCausalLMEagle9"])
    code = serve_main(["up", f"--recipe={root / 'recipes' / 'toy.yaml'}", f"run.workdir={tmp_path}",
                       "serve.port=0", "--for-seconds=1"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and lines == [
        f"serve: error: {tmp_path}/draft/config.json: architectures: LlamaForCausalLMEagle9 is no draft model class "
        "the installed vLLM has (it would look for Eagle3LlamaForCausalLMEagle9); export the draft again "
        "(`serve export`)"], lines
    assert not (tmp_path / "serve").exists()


@pytest.mark.parametrize("arch", ["LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "LlamaForCausalLM"])
def test_draft_classes_vllm_renames_to_its_own_are_accepted(tmp_path, toy_export, tiny_target, arch):
    draft = _with_config(toy_export, tmp_path / "draft", architectures=[arch])
    check_draft_dir(draft, local_target_config(tiny_target))


@pytest.mark.parametrize("flip, says", [
    ("unmarked", "t2d does not mark target id "),
    ("extra", "t2d marks 1025 target ids, d2t maps the draft's 1024 to"),
])
def test_an_export_whose_t2d_disagrees_with_d2t_is_refused(tmp_path, toy_export, tiny_target, flip, says):
    from safetensors.numpy import load_file

    t2d = load_file(toy_export / "model.safetensors")["t2d"]
    ids = [int(t2d.nonzero()[0][0])] if flip == "unmarked" else [int((~t2d).nonzero()[0][0])]
    draft = _with_t2d(toy_export, tmp_path / "draft", "model.safetensors", ids)
    with pytest.raises(ConfigError) as err:
        check_draft_dir(draft, local_target_config(tiny_target))
    assert str(err.value).startswith(f"{draft}/model.safetensors: {says}"), err.value
    assert "the two vocabulary maps disagree" in str(err.value)


def test_export_refuses_a_checkpoint_whose_t2d_disagrees_with_d2t(tmp_path, tiny_target):
    """A checkpoint saved with a t2d that is not d2t's (as the toy checkpoint is built, one mark moved)
    was exported as it was: speculators and SpecForge readers take t2d for the draft vocabulary."""
    import torch

    from eaglenest.train.checkpoint import save_checkpoint
    from eaglenest.train.config import TrainConfig
    from eaglenest.train.loop import build_draft
    from eaglenest.train.target import load_target_tensors
    from eaglenest.train.vocab import select_vocab

    vocab = select_vocab(torch.arange(2048, 0, -1).numpy(), 1024)
    model = build_draft(TrainConfig(draft_vocab_size=1024), load_target_tensors(tiny_target), layer_ids=(2, 4, 5),
                        vocab=vocab, seed=0)
    marked = int(model.t2d.nonzero()[0])
    model.t2d[marked] = False
    model.t2d[int((~model.t2d).nonzero()[-1])] = True  # as many marks, one in the wrong place
    ckpt = tmp_path / "train"
    save_checkpoint(ckpt, model, info={"layer_ids": [2, 4, 5], "step": 1, "table_version": 1, "store_uri": "s",
                                       "train_config": {}})
    with pytest.raises(StoreError) as err:
        export_draft(ckpt, tmp_path / "draft", target_dir=tiny_target)
    assert str(err.value).startswith(f"{ckpt}/draft.safetensors: t2d does not mark target id {marked}, "), err.value
    assert not (tmp_path / "draft").exists()


def test_draft_check_says_in_one_line_that_vllm_could_not_start(tmp_path, toy_export, tiny_target, monkeypatch,
                                                                 capsys):
    """vLLM's failed start (here a stub of its engine-core failure: the real one needs an engine that
    loads and then fails) was a traceback; now one line naming what it started, exit 2."""
    def fails(*args, **kwargs):
        raise RuntimeError("Engine core initialization failed. See root cause above. Failed core proc(s): {}")

    monkeypatch.setattr(draft_check, "make_llm", fails)
    monkeypatch.setattr(draft_check, "prompts_from_store", lambda uri, n: [[1, 2, 3]])
    code = draft_check.main([str(tiny_target), str(toy_export), "--prompts-from", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [f"draft_check: error: vLLM could not start an engine on {tiny_target} alone: "
                                 "Engine core initialization failed. See root cause above. Failed core proc(s): {}"]


def test_draft_check_fits_its_engine_to_a_target_of_few_positions(tmp_path, tiny_target, toy_export, monkeypatch):
    """Its engine length (2048, no flag) on a target of 1024 positions was refused whatever the user did."""
    target = _with_config(tiny_target, tmp_path / "target", max_position_embeddings=1024)
    started = []
    monkeypatch.setattr(draft_check, "_run", lambda t, prompts, max_tokens, **kw: (started.append(kw["max_len"]),
                                                                                   ([[1]], {}))[1])
    draft_check.check(str(target), str(toy_export), [[1, 2]])
    draft_check.check(str(tiny_target), str(toy_export), [[1, 2]])
    assert started == [1024, 1024, 2048, 2048]  # the target alone, then with the draft


def test_serve_up_refuses_a_target_config_transformers_refuses_before_the_server(tmp_path, root, tiny_target,
                                                                                 monkeypatch, capsys):
    """A string where config.json takes a whole number: the server started and its engine died in
    transformers' strict config (``vLLM server exited with code 1 during start-up``, a minute later)."""
    monkeypatch.setattr(Server, "start", lambda self: pytest.fail("a server was started"))
    target = _with_config(tiny_target, tmp_path / "target", num_attention_heads="4")
    code = serve_main(["up", f"--recipe={root / 'recipes' / 'toy.yaml'}", f"run.workdir={tmp_path}",
                       f"run.target={target}", "serve.port=0", "--for-seconds=1", "--no-spec"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"serve: error: run.target: {target}: transformers cannot load its config"), lines
    assert "num_attention_heads" in lines[0]
