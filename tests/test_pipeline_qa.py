"""QA repros for ``pipeline`` (``train run`` with served-AL selection), no engine and no training:
the scorer and the trainer are stubbed where noted, so only what ``cmd_run`` hands them is checked."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from eaglenest.evaluate.settings import with_draft_k


def _prompts(uri: str) -> None:
    from eaglenest.featurestore import schema as S
    from eaglenest.featurestore.table import store

    row = dict(sample_id="h0", domain="d", source="test", split="heldout", mode="chat",
               messages_json=json.dumps([{"role": "user", "content": "Hello."}]), prompt_token_ids=[],
               response_token_ids=[], finish_reason="", gen_params_id="g")
    store.append(uri, store.PROMPTS, pa.Table.from_pylist([row], schema=S.PROMPTS_SCHEMA))


def _draft(path, k: int):
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"recommended_num_speculative_tokens": k}))
    return path


def _train_run(tmp_path, root, tiny_target, monkeypatch, *overrides, kwargs: list | None = None) -> list:
    """``train run`` with selection on; returns the evaluate configs it built scorers with (their other
    keywords appended to ``kwargs``)."""
    import eaglenest.pipeline.commands as commands
    from eaglenest.pipeline.train_cli import main as train_main

    built, kwargs = [], kwargs if kwargs is not None else []

    def no_training(*args, **kwargs):  # stands in for the trainer: the scorer it was given is all we check
        raise SystemExit(0)

    monkeypatch.setattr(commands, "served_al_scorer", lambda train_cfg, cfg, **kw: built.append(cfg) or
                        kwargs.append(kw) or "scorer")
    monkeypatch.setattr(commands, "train", no_training)
    work = tmp_path / "work"
    _prompts(str(work / "store"))
    _draft(work / "draft", 7)  # an earlier run's export: a DFlash draft, K 7
    with pytest.raises(SystemExit) as stopped:  # by the stand-in trainer, not by a refusal before it
        train_main(["run", f"--recipe={root / 'recipes' / 'toy.yaml'}", f"run.workdir={work}",
                    f"run.target={tiny_target}", "train.select.every_steps=5", "evaluate.chat_template_kwargs={}",
                    *overrides])
    assert stopped.value.code == 0
    return built


def test_selection_serves_each_snapshot_at_its_own_k(tmp_path, root, tiny_target, monkeypatch):
    """An EAGLE-3 run with selection in a workdir holding an earlier run's DFlash export: every
    snapshot was scored at that export's K (7) instead of the K its own export records (3)."""
    built = _train_run(tmp_path, root, tiny_target, monkeypatch)
    assert len(built) == 1
    snapshot = _draft(tmp_path / "snapshot" / "draft", 3)  # what served_al exports a snapshot to
    assert with_draft_k(built[0], str(snapshot)).num_speculative_tokens == 3


def test_selection_keeps_a_k_the_recipe_sets(tmp_path, root, tiny_target, monkeypatch):
    built = _train_run(tmp_path, root, tiny_target, monkeypatch, "evaluate.num_speculative_tokens=2")
    snapshot = _draft(tmp_path / "snapshot" / "draft", 3)
    assert with_draft_k(built[0], str(snapshot)).num_speculative_tokens == 2


@pytest.mark.parametrize("endpoint", ["node0:²", "node0:２９４００", "[::1]:٢٩٤٠٠"])
def test_launch_refuses_a_port_of_non_ascii_digits(capsys, tmp_path, root, endpoint):
    """``train launch --rdzv-endpoint node0:²``: str.isdigit() passed it, then int() raised a traceback
    (fullwidth digits went on to torchrun, which raised its own)."""
    from eaglenest.pipeline.train_cli import main as train_main

    code = train_main(["launch", "--nnodes", "2", "--rdzv-endpoint", endpoint,
                       f"--recipe={root / 'recipes' / 'toy.yaml'}", f"run.workdir={tmp_path / 'w'}"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert "--rdzv-endpoint must be HOST:PORT" in lines[0] and repr(endpoint) in lines[0], lines[0]
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("host", ["node0..lan", "x" * 64])
def test_launch_names_a_host_that_is_not_a_host_name(capsys, tmp_path, root, host):
    """``train launch --rdzv-endpoint node0..lan:29400`` (a typo): resolving it raised UnicodeError
    from the idna codec, not OSError, and the launch ended in a traceback."""
    from eaglenest.pipeline.train_cli import main as train_main

    endpoint = f"{host}:29400"
    code = train_main(["launch", "--nnodes", "2", "--rdzv-endpoint", endpoint,
                       f"--recipe={root / 'recipes' / 'toy.yaml'}", f"run.workdir={tmp_path / 'w'}"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert f"--rdzv-endpoint {endpoint}: cannot resolve host {host!r} (" in lines[0], lines[0]


def test_selection_exports_each_snapshot_as_serve_export_will(tmp_path, root, tiny_target, monkeypatch,
                                                               toy_checkpoint, caplog):
    """Snapshots were exported with export's defaults (the target's dtype, vLLM's format, the family's
    K), whatever ``serve`` says, so the checkpoint chosen was scored as another draft than the one
    shipped. Now the recipe's serve settings reach the export; FP8, which vLLM serves on CUDA only,
    is scored unquantised on a CPU, with a warning."""
    from eaglenest.engine import has_cuda
    from eaglenest.pipeline.served_al import export_settings
    from eaglenest.serve.config import ServeConfig
    from eaglenest.serve.export import export_draft

    kwargs = []
    _train_run(tmp_path, root, tiny_target, monkeypatch, "serve.dtype=float32", "serve.format=speculators",
               "serve.num_speculative_tokens=2", kwargs=kwargs)
    s = kwargs[0]["serve_cfg"]
    assert (s.dtype, s.format, s.num_speculative_tokens) == ("float32", "speculators", 2)
    out = export_draft(toy_checkpoint, tmp_path / "snap" / "draft", target_dir=tiny_target, **export_settings(s))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and cfg["transformer_layer_config"]["dtype"] == "float32"
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 2
    fp8 = export_settings(ServeConfig(quantization="fp8"))
    assert fp8["quantization"] == ("fp8" if has_cuda() else "none")
    if not has_cuda():
        assert any("scored unquantised" in r.getMessage() for r in caplog.records)
