"""``evaluate throughput``, ``evaluate parity`` and ``evaluate offline`` with a ``run.target`` whose chat
template is not the one the exported draft's features were captured with (QA9). ``evaluate al`` says so in
one warning line (``serve/target_check.check_served_tokenization``, QA8); before the fix the throughput sweep
and the parity check served the draft on such a target (and the offline replay decoded it) without a word.
No engine or server starts: each run is stopped by a later refusal, after the check.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pyarrow as pa
import pytest

from eaglenest.errors import ConfigError
from eaglenest.evaluate.cli import main as evaluate_main
from eaglenest.evaluate.config import EvaluateConfig
from eaglenest.evaluate.throughput import run_sweep
from eaglenest.featurestore import schema as S
from eaglenest.featurestore.table import store
from eaglenest.serve.export import export_draft

NEVER_SAW = "vLLM would serve it on token ids it never saw; measuring it anyway"


@pytest.fixture(scope="module")
def work(tmp_path_factory, toy_checkpoint, tiny_target, stamp_identity) -> Path:
    """``<work>/train``: a checkpoint whose features' identity is the tiny target's; ``<work>/draft``: its export."""
    folder = tmp_path_factory.mktemp("measured") / "work dir"
    shutil.copytree(toy_checkpoint, folder / "train")
    stamp_identity(folder / "train", tiny_target)
    export_draft(folder / "train", folder / "draft", target_dir=tiny_target)
    return folder


@pytest.fixture(scope="module")
def prompts_uri(tmp_path_factory) -> str:
    rows = [dict(sample_id=f"p-{i}", domain="prose", source="test", split="heldout", mode="chat",
                 messages_json=json.dumps([{"role": "user", "content": text}]), prompt_token_ids=[],
                 response_token_ids=[], finish_reason="", gen_params_id="g")
            for i, text in enumerate(["Describe a quiet morning.", "Tell me about the sea."])]
    uri = str(tmp_path_factory.mktemp("measured_store") / "store")
    store.append(uri, store.PROMPTS, pa.Table.from_pylist(rows, schema=S.PROMPTS_SCHEMA))
    return uri


def _warned(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "chat template" in r.getMessage()]


def test_throughput_warns_of_an_edited_template_before_its_servers(caplog, tmp_path, work, prompts_uri,
                                                                    tiny_target, edited_target):
    # throughput_max_tokens past the engine's 4096 positions: refused (before the servers) after the check
    cfg = EvaluateConfig(num_speculative_tokens=2, throughput_max_tokens=5000, context_buckets=(),
                         chat_template_kwargs={})
    for target, warned in ((edited_target, 1), (tiny_target, 0)):
        caplog.clear()
        with caplog.at_level(logging.WARNING), pytest.raises(ConfigError, match=r"^evaluate.engine.max_model_len: "):
            run_sweep(target=str(target), draft=str(work / "draft"), store_uri=prompts_uri, cfg=cfg, serve_cfg=None,
                      log_dir=tmp_path / "logs")
        said = _warned(caplog)
        assert len(said) == warned, said
        if warned:
            assert "\n" not in said[0] and said[0].startswith("run.target: the tokenizer files (sha256 "), said
            assert said[0].endswith(NEVER_SAW), said
    assert not (tmp_path / "logs").exists()  # no server was started


def test_parity_warns_of_an_edited_template(caplog, capsys, root, work, edited_target):
    argv = ["parity", f"--recipe={root / 'recipes' / 'toy.yaml'}", f"run.workdir={work}", f"run.target={edited_target}",
            "evaluate.temperature=0.5", "evaluate.num_speculative_tokens=2",  # greedy only: refused after the check
            "evaluate.chat_template_kwargs={}"]
    with caplog.at_level(logging.WARNING):
        assert evaluate_main(argv) == 2
    assert "evaluate.temperature: the parity check is greedy only" in capsys.readouterr().err
    said = _warned(caplog)
    assert len(said) == 1 and said[0].endswith(NEVER_SAW), said
    assert f"in {work}/draft/provenance.json" in said[0], said


def test_offline_warns_of_an_edited_template(caplog, capsys, root, work, edited_target):
    """``evaluate offline`` replays an export on the Hugging Face target with its tokenizer and template too."""
    argv = ["offline", f"--recipe={root / 'recipes' / 'toy.yaml'}", f"run.workdir={work}",
            f"run.target={edited_target}",
            "evaluate.temperature=0.5", "evaluate.num_speculative_tokens=2",  # greedy only: refused after the check
            "evaluate.chat_template_kwargs={}"]
    with caplog.at_level(logging.WARNING):
        assert evaluate_main(argv) == 2
    assert "evaluate.temperature: offline AL is greedy only" in capsys.readouterr().err
    said = _warned(caplog)
    assert len(said) == 1 and said[0].endswith(NEVER_SAW), said
