"""Evaluating a draft of a base model (no chat template) ingested with ``raw_fraction: 1.0``.

Its held-out prompts were rendered with the chat template the model lacks (a transformers ValueError
traceback from `evaluate al` and `evaluate offline`), and so were the context buckets. They are decoded as
the raw completions ingest sends, the buckets as plain documents, and the report says how many were raw.
One store, ingested here without an engine (``Scripted``); the tiny target's untrained draft serves it, as
the base model is the tiny target without its template.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
from pathlib import Path

import pytest

from eaglenest.evaluate.buckets import build_bucket_prompts
from eaglenest.evaluate.cli import main as evaluate_main
from eaglenest.evaluate.config import EvaluateConfig
from eaglenest.evaluate.plan import plan
from eaglenest.evaluate.offline import prompt_ids
from eaglenest.evaluate.prompts import check_prompt_lengths, load_prompt_set
from eaglenest.evaluate.report import markdown
from eaglenest.evaluate.throughput import _point
from eaglenest.hf import load_tokenizer
from eaglenest.ingest.build import build
from eaglenest.ingest.config import IngestConfig
from eaglenest.ingest.manifest import load_manifest
from eaglenest.ingest.pool import load_pool, raw_text

sys.path.insert(0, str(Path(__file__).parents[1] / "ingest"))
from ingest_helpers import Scripted  # noqa: E402  (the ingest tests' scripted backend: no engine)


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_target):
    """(base target, store uri, its pool): the tiny target without a chat template, ingested raw."""
    tmp = tmp_path_factory.mktemp("base model")
    target = tmp / "base target"
    shutil.copytree(tiny_target, target)
    cfg = json.loads((target / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (target / "tokenizer_config.json").write_text(json.dumps(cfg))
    src = tmp / "prompts.jsonl"
    rows = [{"prompt": f"Count from {i} to {i + 3}.", "system": "Be brief." if i % 2 else None} for i in range(10)]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp / "m.yaml").write_text(f"name: base\nlicence: CC0-1.0\nraw_fraction: 1.0\nheld_out_count: 3\ndomains:\n"
                                f"  d:\n    cap_prompts: 10\n    sources:\n      - path: {src}\n        field: prompt\n"
                                "        system_field: system\n        provenance: test\n")
    m = load_manifest(tmp / "m.yaml")
    pool = load_pool(m, target=str(target))
    uri = str(tmp / "store")
    backend = Scripted(load_tokenizer(str(target), trust_remote_code=False))
    build(m, pool, target=str(target), store_uri=uri, cfg=IngestConfig(), backend=backend)
    assert backend.kinds and set(backend.kinds) == {"raw"}, backend.kinds  # a base model is sent raw prompts only
    return target, uri, pool


def test_held_out_prompts_are_decoded_as_ingest_sends_raw_prompts(base):
    target, uri, pool = base
    tok = load_tokenizer(str(target), trust_remote_code=False)
    groups, info = load_prompt_set(EvaluateConfig(), uri)
    prompts = [p for ps in groups.values() for p in ps]
    held = {e.sample_id: e for e in pool if e.split == "heldout"}
    assert sorted(p["sample_id"] for p in prompts) == sorted(held) and info["decoded_raw"] == 3
    assert any(held[sid].system for sid in held)  # a system prompt is part of the raw document
    for p in prompts:
        assert p["raw_text"] == raw_text(held[p["sample_id"]])
        assert prompt_ids(tok, p) == tok(p["raw_text"])["input_ids"]  # as vLLM's generate tokenizes a text
    check_prompt_lengths(tok, prompts, None, max_len=512, max_positions=2048)  # was a ValueError traceback
    assert "decoded as raw completions" in markdown({"num_speculative_tokens": 3, "draft": "d", "target": "t",
                                                    "temperature": 0.0, "split": "heldout", "al_average": "x",
                                                    "prompts": info, "domains": {},
                                                    "overall": {"prompts": 3, "acceptance_length": 2.0,
                                                                "acceptance_rate": 0.5}})


def test_a_chat_prompt_for_a_base_model_is_one_line(base, mt_bench_file):
    """A prompt set that is chat (MT-Bench) on a base model: one ConfigError, not a transformers traceback."""
    target, uri, _ = base
    tok = load_tokenizer(str(target), trust_remote_code=False)
    groups, _ = load_prompt_set(EvaluateConfig(prompt_set="mt_bench", prompt_path=str(mt_bench_file)), uri)
    with pytest.raises(Exception) as exc:
        check_prompt_lengths(tok, [p for ps in groups.values() for p in ps], None, max_len=512, max_positions=2048)
    assert type(exc.value).__name__ == "ConfigError" and "has no chat template" in str(exc.value)


def test_context_buckets_of_a_base_model_are_plain_documents(base):
    """The default context buckets (records, code, recall, chat) were rendered with the chat template: plan()
    raised a ValueError before any engine. They are plain documents of the exact length, starting at BOS."""
    target, uri, _ = base
    cfg = EvaluateConfig(context_buckets=(1024,), bucket_prompts=4)
    p = plan(cfg, target=str(target), store_uri=uri)
    tok = p.tok
    material = [(x["messages"], "fine.") for x in p.pool]
    out = build_bucket_prompts(tok, material, (1024,), per_bucket=4, max_positions=p.max_positions,
                               max_tokens=cfg.bucket_max_tokens, kinds=cfg.bucket_material)
    (rows,) = out.values()
    assert sorted(r["material"] for r in rows) == sorted(cfg.bucket_material)
    n = len(rows[0]["prompt_token_ids"])
    for r in rows:
        ids = r["prompt_token_ids"]
        assert len(ids) == n and ids[0] == tok.bos_token_id and tok.bos_token_id not in ids[1:]
        assert "<|" not in tok.decode(ids[1:])  # no chat markup
    assert "Count from" in tok.decode(next(r for r in rows if r["material"] == "chat")["prompt_token_ids"])


def test_evaluate_offline_on_a_base_model(base, root, tmp_path, toy_export, capsys):
    """`evaluate offline` on the base model's store: it crashed rendering the held-out prompts with a chat
    template; it decodes them raw and records how many."""
    target, uri, _ = base
    work = tmp_path / "w"
    rc = evaluate_main(["offline", f"--recipe={root / 'recipes' / 'toy.yaml'}", f"run.workdir={work}",
                        f"run.target={target}", f"run.store={uri}", f"evaluate.draft={toy_export}",
                        "evaluate.chat_template_kwargs={}", "evaluate.max_tokens=8"])
    assert rc == 0, capsys.readouterr().err
    report = json.loads((work / "eval_offline" / "offline_report.json").read_text())
    assert report["prompts"]["decoded_raw"] == 3 and report["overall"]["prompts"] == 3
    assert report["overall"]["acceptance_length"] >= 1.0


def test_evaluate_al_on_a_base_model(base, root, tmp_path, toy_export, capsys):
    """`evaluate al` under vLLM on the base model's store: its held-out prompts go to ``LLM.generate`` as raw
    text (``LLM.chat`` refused them: no chat template), greedy outputs identical without speculation, and the
    report says they were decoded raw."""
    target, uri, _ = base
    work = tmp_path / "w"
    rc = evaluate_main(["al", f"--recipe={root / 'recipes' / 'toy.yaml'}", f"run.workdir={work}",
                        f"run.target={target}", f"run.store={uri}", f"evaluate.draft={toy_export}",
                        "evaluate.chat_template_kwargs={}", "evaluate.max_tokens=8", "evaluate.context_buckets=[]",
                        "evaluate.ngram_order=0"])
    assert rc == 0, capsys.readouterr().err
    report = json.loads((work / "eval" / "report.json").read_text())
    assert report["prompts"]["decoded_raw"] == 3 and report["overall"]["prompts"] == 3
    assert report["lossless"]["identical"] == report["lossless"]["prompts"] == 3
    assert report["overall"]["acceptance_length"] >= 1.0
    assert "decoded as raw completions" in (work / "eval" / "report.md").read_text()


def test_throughput_requests_of_a_base_model_are_plain_completions(base, tmp_path, openai_server):
    """`evaluate throughput` sent every prompt to /v1/chat/completions: a base model's server answers 400 (no
    chat template). Raw held-out prompts go to /v1/completions; each request yields its output tokens."""
    target, uri, _ = base
    with openai_server(target, tmp_path / "server.log", "--served-model-name", "target", "--max-num-seqs", "4") as url:
        groups, _ = load_prompt_set(EvaluateConfig(), uri)
        prompts = [p for ps in groups.values() for p in ps]
        point = asyncio.run(_point(url, prompts, concurrency=2, max_tokens=6, seed=0))
        assert point["output_tokens"] == 6 * len(prompts) == 18  # ignore_eos: every request runs to max_tokens


def test_raw_training_prompts_are_kept_out_of_a_published_prompt_set(base, tmp_path):
    """A raw training prompt is stored as one ``document`` message, which the overlap check read as a prompt
    with no user turn: an MT-Bench question that a base model (every training prompt raw) was trained on was
    measured anyway. It is excluded, with or without the training prompt's system prompt."""
    _, uri, pool = base
    train = [e for e in pool if e.split == "train"]
    chosen = [next(e for e in train if e.system), next(e for e in train if not e.system)]
    qs = [{"question_id": i, "category": "c", "turns": [e.prompt.upper()]} for i, e in enumerate(chosen)]
    qs.append({"question_id": 9, "category": "c", "turns": ["Something never trained on."]})
    path = tmp_path / "question.jsonl"
    path.write_text("".join(json.dumps(q) + "\n" for q in qs))
    groups, info = load_prompt_set(EvaluateConfig(prompt_set="mt_bench", prompt_path=str(path)), uri)
    assert info["overlap_excluded"] == 2 and sorted(info["overlap_ids"]) == ["mt_bench-0", "mt_bench-1"]
    assert [p["sample_id"] for ps in groups.values() for p in ps] == ["mt_bench-9"]
