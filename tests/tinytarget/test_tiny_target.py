"""Tests of the tiny target: corpus determinism, the committed fixture, its template and its claims.

All CPU, no vLLM (``python -m eaglenest.tinytarget.engine_check`` is the engine check). The fixture
tests read ``assets/tiny-target`` as committed; they fail if it is missing or stale.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jinja2
import pytest

from eaglenest.tinytarget import corpus, prompts

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "assets" / "tiny-target"
PROMPTS = ROOT / "recipes" / "data"


@pytest.fixture(scope="module")
def hf_tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(FIXTURE))


@pytest.fixture(scope="module")
def model():
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    return AutoModelForCausalLM.from_pretrained(str(FIXTURE)).eval()


def test_corpus_is_deterministic_and_covers_all_domains():
    a, b = corpus.generate(200, seed=3), corpus.generate(200, seed=3)
    assert a == b
    assert a != corpus.generate(200, seed=4)
    assert {s["domain"] for s in a} == set(corpus.DOMAINS)
    assert all(s["prompt"] and s["response"] for s in a)
    assert any("system" in s for s in a)


def test_arithmetic_answers_are_correct():
    for s in corpus.generate(400, seed=1, domains=("arithmetic",)):
        a, op, b = re.search(r"(\d+) ([+x-]) (\d+)", s["prompt"]).groups()
        want = {"+": int(a) + int(b), "-": int(a) - int(b), "x": int(a) * int(b)}[op]
        assert s["response"].endswith(f"So {a} {op} {b} = {want}.")


def test_prompt_files_are_fresh_deterministic_and_committed(tmp_path):
    prompts.write_prompt_files(tmp_path)
    for domain in corpus.DOMAINS:
        committed = (PROMPTS / f"{domain}.jsonl").read_bytes()
        assert (tmp_path / f"{domain}.jsonl").read_bytes() == committed
        recs = [json.loads(line) for line in committed.decode().splitlines()]
        assert len(recs) == prompts.NUM_PROMPTS_PER_DOMAIN
        assert len({r["id"] for r in recs}) == len(recs)
        assert all(set(r) <= {"id", "prompt", "system"} for r in recs)
    committed = (PROMPTS / "dialogue.jsonl").read_bytes()
    assert (tmp_path / "dialogue.jsonl").read_bytes() == committed
    dialogues = [json.loads(line) for line in committed.decode().splitlines()]
    assert len(dialogues) == prompts.NUM_DIALOGUES
    lo, hi = prompts.DIALOGUE_TURNS
    assert all(lo <= len(d["messages"]) <= hi and {m["role"] for m in d["messages"]} == {"user"} for d in dialogues)


def test_fixture_shape_and_dtype():
    from safetensors import safe_open

    config = json.loads((FIXTURE / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (8, 128, 2048)
    assert config["max_position_embeddings"] == 32768
    assert config["dtype"] == "float32" and config["tie_word_embeddings"] is False
    with safe_open(str(FIXTURE / "model.safetensors"), "pt") as f:
        dtypes = {str(f.get_slice(k).get_dtype()) for k in f.keys()}
    assert dtypes == {"F32"}
    assert (FIXTURE / "model.safetensors").stat().st_size < 20 * 2**20


def test_fixture_loads_with_transformers(model, hf_tok):
    import torch

    assert model.config.num_hidden_layers == 8 and model.dtype == torch.float32
    assert hf_tok.eos_token == "<|end|>" and hf_tok.eos_token_id == model.config.eos_token_id
    assert hf_tok.bos_token_id == model.config.bos_token_id
    assert hf_tok.pad_token_id == model.config.pad_token_id
    text = "Compute 47 + 38.\n\nSo 47 + 38 = 85."
    ids = hf_tok(text)["input_ids"]
    assert ids[0] == hf_tok.bos_token_id
    assert hf_tok.decode(ids, skip_special_tokens=True) == text


def test_chat_template_and_assistant_mask(hf_tok):
    msgs = [{"role": "system", "content": "Show your working."},
            {"role": "user", "content": "What is 2 + 3?"},
            {"role": "assistant", "content": "So 2 + 3 = 5."}]
    text = hf_tok.apply_chat_template(msgs, tokenize=False)
    assert text == ("<|bos|><|system|>\nShow your working.<|end|>\n<|user|>\nWhat is 2 + 3?<|end|>\n"
                    "<|assistant|>\nSo 2 + 3 = 5.<|end|>\n")
    prompt = hf_tok.apply_chat_template(msgs[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|user|>\nWhat is 2 + 3?<|end|>\n<|assistant|>\n")
    enc = hf_tok.apply_chat_template(msgs, tokenize=True, return_dict=True,
                                     return_assistant_tokens_mask=True)
    ids, mask = enc["input_ids"], enc["assistant_masks"]
    first = mask.index(1)
    n = sum(mask)
    assert mask[first:first + n] == [1] * n  # one contiguous span
    assert hf_tok.decode(ids[first:first + n]) == "So 2 + 3 = 5.<|end|>"
    assert hf_tok.convert_ids_to_tokens(ids[first - 1]) == "Ċ"  # the newline after <|assistant|>
    with pytest.raises(jinja2.exceptions.TemplateError, match="^unknown role: tool$"):
        hf_tok.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_greedy_arithmetic_answer_is_well_formed(model, hf_tok):
    import torch

    rec = json.loads((PROMPTS / "arithmetic.jsonl").read_text().splitlines()[0])
    msgs = ([{"role": "system", "content": rec["system"]}] if rec.get("system") else [])
    msgs.append({"role": "user", "content": rec["prompt"]})
    enc = hf_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                     return_dict=True, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, do_sample=False, max_new_tokens=120,
                             eos_token_id=hf_tok.eos_token_id, pad_token_id=hf_tok.pad_token_id)
    new = out[0, enc["input_ids"].shape[1]:].tolist()
    assert new[-1] == hf_tok.eos_token_id, hf_tok.decode(new)
    text = hf_tok.decode(new, skip_special_tokens=True)
    a, op, b = re.search(r"(\d+) ([+x-]) (\d+)", rec["prompt"]).groups()
    lines = text.split("\n")
    assert len(lines) == 3, text
    assert re.fullmatch(r"(Add|Subtract|Multiply) the ones: .*\.", lines[0]), text
    assert re.fullmatch(r"(Add|Subtract|Multiply) the tens: .*\.", lines[1]), text
    assert re.fullmatch(rf"So {a} {re.escape(op)} {b} = \d+\.", lines[2]), text


def test_held_out_loss_ordering_matches_the_card(model, hf_tok):
    from eaglenest.tinytarget.train import evaluate_domains

    held_out = corpus.generate(4 * 25, seed=424242)
    stats = evaluate_domains(model, hf_tok, held_out)
    assert stats["arithmetic"]["loss"] < stats["prose"]["loss"]
    assert stats["records"]["loss"] < stats["prose"]["loss"]
    assert stats["arithmetic"]["top1_accuracy"] > stats["prose"]["top1_accuracy"]
    # The card and provenance report the same ordering from the build's own held-out set.
    recorded = json.loads((FIXTURE / "provenance.json").read_text())["metrics"]["held_out"]
    assert recorded["arithmetic"]["loss"] < recorded["prose"]["loss"]
    card = (FIXTURE / "README.md").read_text()
    for domain in corpus.DOMAINS:
        assert f"| {domain} | {recorded[domain]['loss']:.3f} |" in card
