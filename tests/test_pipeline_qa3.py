"""QA repros, third pass, for ``pipeline`` (``train run`` with served-AL selection): no engine and no
training, the scorer and the trainer are stubbed, so only what ``cmd_run`` decides before them is checked."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest


def _prompts(uri: str) -> None:
    from eaglenest.featurestore import schema as S
    from eaglenest.featurestore.table import store

    row = dict(sample_id="h0", domain="d", source="test", split="heldout", mode="chat",
               messages_json=json.dumps([{"role": "user", "content": "Hello."}]), prompt_token_ids=[],
               response_token_ids=[], finish_reason="", gen_params_id="g")
    store.append(uri, store.PROMPTS, pa.Table.from_pylist([row], schema=S.PROMPTS_SCHEMA))


@pytest.mark.parametrize("damage", ["{not json", "[1, 2]"])
def test_selection_does_not_read_an_earlier_export_it_never_serves(tmp_path, root, tiny_target, monkeypatch,
                                                                   capsys, damage):
    """``train run train.select.every_steps=5`` beside a damaged ``<workdir>/draft/config.json`` (an
    export killed or edited by hand): selection serves each snapshot at the K its own export records,
    yet resolving the evaluate settings read that earlier export's K first, and ``train run`` refused to
    train ("not an exported draft: run `serve export` again", which needs the training it refused)."""
    import eaglenest.pipeline.commands as commands
    from eaglenest.pipeline.train_cli import main as train_main

    built = []

    def no_training(*args, **kwargs):  # stands in for the trainer: reaching it means nothing was refused
        raise SystemExit(0)

    monkeypatch.setattr(commands, "served_al_scorer", lambda train_cfg, cfg, **kw: built.append(cfg) or "scorer")
    monkeypatch.setattr(commands, "train", no_training)
    work = tmp_path / "work"
    _prompts(str(work / "store"))
    (work / "draft").mkdir()
    (work / "draft" / "config.json").write_text(damage)
    try:
        code = train_main(["run", f"--recipe={root / 'recipes' / 'toy.yaml'}", f"run.workdir={work}",
                           f"run.target={tiny_target}", "train.select.every_steps=5"])
    except SystemExit as stopped:  # the stub trainer
        code = stopped.code
    assert code == 0, capsys.readouterr().err
    (cfg,) = built
    assert cfg.num_speculative_tokens is None  # each snapshot's own K
    assert cfg.chat_template_kwargs is not None  # rendered as `evaluate` renders: resolved, not left open
