"""QA repros for ``evaluate al``'s context buckets and prompt lengths: what cannot run is refused in
one line before the engine starts (it used to fail after every group had been decoded, losing that
work, or inside vLLM with a traceback). The engine is replaced by a stub that only records that it
was asked for: reaching it means nothing was refused."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from eaglenest.engine import EngineConfig
from eaglenest.errors import ConfigError
from eaglenest.evaluate import run as run_mod
from eaglenest.evaluate.buckets import bucket_lengths
from eaglenest.evaluate.config import EvaluateConfig


class EngineStarted(Exception):
    """Raised by the stub engine: every check before the engine passed."""


@pytest.fixture
def no_engine(monkeypatch):
    def make_llm(*args, **kwargs):
        raise EngineStarted()

    monkeypatch.setattr(run_mod, "make_llm", make_llm)


@pytest.fixture
def draft(toy_export):
    """An exported draft (the checks before the engine read its files; the engine is stubbed)."""
    return str(toy_export)


def _store(path, texts: dict[str, str]) -> str:
    from eaglenest.featurestore import schema as S
    from eaglenest.featurestore.table import store

    rows = [dict(sample_id=sid, domain="d", source="test", split="heldout", mode="chat",
                 messages_json=json.dumps([{"role": "user", "content": text}]), prompt_token_ids=[],
                 response_token_ids=[], finish_reason="", gen_params_id="g") for sid, text in texts.items()]
    uri = str(path / "store")
    store.append(uri, store.PROMPTS, pa.Table.from_pylist(rows, schema=S.PROMPTS_SCHEMA))
    return uri


def _evaluate(tiny_target, draft, store_uri, **cfg):
    cfg = EvaluateConfig(num_speculative_tokens=2, **cfg)
    return run_mod.evaluate_al(target=str(tiny_target), draft=draft, store_uri=store_uri, cfg=cfg)


def test_bucket_lengths_at_the_boundary():
    # The tiny target's 32768 positions: a bucket at positions - output is kept whole, one past it shortened.
    assert bucket_lengths((1024, 32704, 32705, 40000), max_positions=32768, max_tokens=64) == {
        1024: 1024, 32704: 32704, 32705: 32704, 40000: 32704}
    with pytest.raises(ConfigError) as err:
        bucket_lengths((1024,), max_positions=1040, max_tokens=1030)
    assert str(err.value) == ("evaluate.context_buckets: 1024 leaves no room for 1030 output tokens "
                              "within 1040 positions")


def test_bucket_without_room_is_refused_before_the_engine(tmp_path, tiny_target, draft, no_engine):
    uri = _store(tmp_path, {"a": "Hello there."})
    with pytest.raises(ConfigError) as err:
        _evaluate(tiny_target, draft, uri, context_buckets=(1024, 32768), bucket_max_tokens=32760)
    assert str(err.value).startswith("evaluate.context_buckets: 1024 leaves no room for 32760 output tokens")


def test_chat_material_without_heldout_prompts_is_refused_before_the_engine(tmp_path, tiny_target, draft,
                                                                          no_engine):
    """MT-Bench questions with buckets of ``chat`` material and a store with no held-out prompts: the
    chats are read before the engine starts, not after every category has been decoded."""
    path = tmp_path / "question.jsonl"
    path.write_text(json.dumps({"question_id": 1, "category": "math", "turns": ["What is 2 + 2?"]}) + "\n")
    empty_store = str(tmp_path / "nostore")
    with pytest.raises(ConfigError) as err:
        _evaluate(tiny_target, draft, empty_store, prompt_set="mt_bench", prompt_path=str(path),
                  context_buckets=(1024,), bucket_material=("records", "chat"))
    assert str(err.value).startswith("evaluate.bucket_material: chat needs held-out chats from the store "
                                     f"(no prompts table in {empty_store}")
    # Generated material needs no held-out chats: nothing to refuse.
    with pytest.raises(EngineStarted):
        _evaluate(tiny_target, draft, empty_store, prompt_set="mt_bench", prompt_path=str(path),
                  context_buckets=(1024,), bucket_material=("records", "code"))


def test_prompt_longer_than_the_engine_is_refused_before_it_starts(tmp_path, tiny_target, draft, no_engine):
    """vLLM refuses a prompt of max_model_len tokens or more mid-run, with a traceback, after the groups
    before it were decoded; the check names the prompt, its length and the key to raise."""
    uri = _store(tmp_path, {"short": "Hello there.", "long": "word " * 600})
    small = EngineConfig(max_model_len=256, memory_fraction=0.1)
    with pytest.raises(ConfigError) as err:
        _evaluate(tiny_target, draft, uri, context_buckets=(), engine=small)
    msg = str(err.value)
    assert msg.startswith("evaluate.engine.max_model_len: prompt long has ") and "within 256: raise it" in msg, msg
    assert "no room for 1 output token(s)" in msg
    # The engine is raised to fit the longest bucket: then the same prompt fits.
    with pytest.raises(EngineStarted):
        _evaluate(tiny_target, draft, uri, context_buckets=(2048,), bucket_material=("records",), engine=small)
    # Longer than the target's positions: no key can make room.
    uri = _store(tmp_path / "huge", {"huge": "word " * 40000})
    with pytest.raises(ConfigError) as err:
        _evaluate(tiny_target, draft, uri, context_buckets=(), engine=small)
    assert "prompt huge has" in str(err.value) and "within the target's 32768 positions" in str(err.value)


def test_throughput_prompt_without_room_for_its_output_is_refused_before_the_servers(tmp_path, tiny_target, draft,
                                                                                    monkeypatch):
    """``evaluate throughput`` sends ``ignore_eos`` requests of ``throughput_max_tokens``: a prompt without
    room for them got a 400 from its server mid-sweep (an httpx traceback, the sweep lost)."""
    from eaglenest.evaluate import throughput

    def server(*args, **kwargs):
        raise EngineStarted()

    monkeypatch.setattr(throughput, "Server", server)
    uri = _store(tmp_path, {"short": "Hello there.", "long": "word " * 100})
    cfg = EvaluateConfig(num_speculative_tokens=2, throughput_max_tokens=48,
                         engine=EngineConfig(max_model_len=256, memory_fraction=0.1))
    with pytest.raises(ConfigError) as err:
        throughput.run_sweep(target=str(tiny_target), draft=draft, store_uri=uri, cfg=cfg, serve_cfg=None,
                             log_dir=tmp_path)
    msg = str(err.value)
    assert msg.startswith("evaluate.engine.max_model_len: prompt long has ") and "no room for 48 output" in msg, msg
    with pytest.raises(EngineStarted):  # room for 8 output tokens: the servers start
        throughput.run_sweep(target=str(tiny_target), draft=draft, store_uri=uri, log_dir=tmp_path, serve_cfg=None,
                             cfg=EvaluateConfig(num_speculative_tokens=2, throughput_max_tokens=8,
                                                engine=EngineConfig(max_model_len=256, memory_fraction=0.1)))


def test_bucket_too_short_for_its_material_is_refused_before_the_engine(tmp_path, tiny_target, draft, no_engine):
    """``evaluate.context_buckets=[128]`` passes the config (>= 16 tokens) but a ``code`` prompt's question
    and evidence alone take more: refused before the engine, not after every group was decoded."""
    uri = _store(tmp_path, {"a": "Hello there."})
    with pytest.raises(ConfigError) as err:
        _evaluate(tiny_target, draft, uri, context_buckets=(1024, 128), bucket_material=("records", "code"),
                  bucket_prompts=2)
    assert str(err.value).startswith("evaluate.context_buckets: 128 tokens is too short for "
                                     "evaluate.bucket_material kind 'code'"), str(err.value)
    with pytest.raises(EngineStarted):  # chat material fits any length; records fit 256 tokens
        _evaluate(tiny_target, draft, uri, context_buckets=(1024, 256), bucket_material=("records", "chat"),
                  bucket_prompts=2)


def test_chat_prompt_whose_question_outgrows_the_bucket_keeps_its_bos(tiny_target):
    """A held-out question longer than a short bucket is cut at the front; the cut used to take the
    BOS token with it (the prompt then started mid-question, unlike every other bucket prompt)."""
    from transformers import AutoTokenizer

    from eaglenest.evaluate.buckets import build_bucket_prompts

    tok = AutoTokenizer.from_pretrained(tiny_target)
    material = [([{"role": "user", "content": "word " * 80 + "?"}], "Answer.")]
    out = build_bucket_prompts(tok, material, (32, 64), per_bucket=1, max_positions=4096, max_tokens=16, seed=0)
    for bucket, (row,) in out.items():
        ids = row["prompt_token_ids"]
        assert len(ids) == bucket and ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1, bucket
        assert tok.decode(ids).rstrip().endswith("<|assistant|>")  # the question's end and the template stay
    assert out[64][0]["prompt_token_ids"][-31:] == out[32][0]["prompt_token_ids"][-31:]  # paired: same tail


def test_no_ratio_to_the_shortest_bucket_claims_no_method():
    """Buckets without draft rounds (AL None) get no ``al_ratio_to_shortest``; the report used to say
    anyway that ratios were drawn "paired", and report.md explained an "AL / 1024" column of dashes."""
    from eaglenest.evaluate.intervals import add_intervals
    from eaglenest.evaluate.report import markdown

    def bucket(al):
        per = [{"sample_id": f"p{i}", "pair": i, "material": "chat", "evidence_distance_tokens": None,
                "answer_found": None, "draft_rounds": 0 if al is None else 4, "accepted_tokens": 0} for i in range(2)]
        return {"prompts": 2, "prompt_tokens": 1, "acceptance_length": al, "acceptance_rate": None,
                "acceptance_by_position": [], "per_prompt": per}

    row = {"prompts": 1, "acceptance_length": None, "acceptance_rate": None, "acceptance_by_position": []}
    report = {"target": "t", "draft": "d", "split": "heldout", "temperature": 0.0, "num_speculative_tokens": 2,
              "al_average": "pooled", "domains": {"g": dict(row)}, "overall": dict(row),
              "context_buckets": {"1024": bucket(None), "2048": bucket(None)}}
    add_intervals(report, resamples=100, seed=0)
    assert "ratio_to_shortest" not in report["bucket_intervals"]
    assert "al_ratio_to_shortest" not in report["context_buckets"]["2048"]
    assert "**AL / " not in markdown(report)
    report["context_buckets"]["1024"] = bucket(1.0)  # with an AL to divide by, the ratio and its method are back
    report["context_buckets"]["2048"] = bucket(1.0)
    add_intervals(report, resamples=100, seed=0)
    assert report["bucket_intervals"]["ratio_to_shortest"]["paired"] is True
    assert report["context_buckets"]["2048"]["al_ratio_to_shortest"] == 1.0
