"""Earlier answers of a harmony-format (gpt-oss) conversation are found in the prompt and trained on."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from eaglenest.featurestore.capture.build import _turn_spans
from eaglenest.featurestore.capture.turns import assistant_spans, loss_mask
from eaglenest.hf import load_tokenizer


def _ingest_helpers():
    """tests/ingest/ingest_helpers.py: the offline tiny-target copy with gpt-oss's special tokens."""
    path = Path(__file__).resolve().parents[1] / "ingest" / "ingest_helpers.py"
    spec = importlib.util.spec_from_file_location("ingest_helpers_for_capture", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: gpt-oss's chat template for a chat without tools: the last assistant turn, rendered for training (no
#: generation prompt), carries its analysis and ends with ``<|return|>``; an earlier one is its final channel
#: ending with ``<|end|>``.
TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message.role == 'user' -%}<|start|>user<|message|>{{ message.content }}<|end|>"
    "{%- elif message.role == 'assistant' -%}"
    "{%- if loop.last and not add_generation_prompt -%}"
    "{%- if message.thinking -%}<|start|>assistant<|channel|>analysis<|message|>{{ message.thinking }}<|end|>"
    "{%- endif -%}"
    "<|start|>assistant<|channel|>final<|message|>{{ message.content }}<|return|>"
    "{%- else -%}<|start|>assistant<|channel|>final<|message|>{{ message.content }}<|end|>{%- endif -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}")

CONV = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "Answer 1."},
        {"role": "user", "content": "And 3 + 3?"}, {"role": "assistant", "content": "Answer 2."},
        {"role": "user", "content": "And 4 + 4?"}, {"role": "assistant", "content": "Answer 3."}]


@pytest.fixture(scope="module")
def harmony_root(tmp_path_factory, tiny_target):
    """A tiny-target copy (in a folder with a space) with gpt-oss's special tokens and this template."""
    root = _ingest_helpers().harmony_target(tmp_path_factory.mktemp("harmony"), tiny_target)
    tok = load_tokenizer(root, trust_remote_code=False)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(root)
    return root


@pytest.fixture(scope="module")
def harmony_tok(harmony_root):
    return load_tokenizer(harmony_root, trust_remote_code=False)


def _prompt(tok, messages):
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("thinking", [False, True], ids=["content only", "with thinking"])
def test_every_earlier_harmony_answer_gets_the_loss_mask(harmony_tok, thinking):
    # gpt-oss renders the last assistant turn (no generation prompt) with <|return|> (and its analysis), an
    # earlier one as "final ... <|end|>": the turn rendered alone was never a prefix of the conversation, so
    # assistant_spans gave up and capture trained on the last answer only.
    tok = harmony_tok
    conv = [dict(m, thinking=f"Think {i}.") if thinking and m["role"] == "assistant" else m
            for i, m in enumerate(CONV)]
    prompt = _prompt(tok, conv[:-1])
    spans = assistant_spans(tok, conv, prompt)
    assert spans is not None
    got = [tok.decode(prompt[a:b], skip_special_tokens=False) for a, b in spans]
    assert got == ["<|channel|>final<|message|>Answer 1.<|end|>", "<|channel|>final<|message|>Answer 2.<|end|>"]
    # each span opens right after the generation prompt the target answered from
    for (a, _), i in zip(spans, (1, 3)):
        assert prompt[:a] == _prompt(tok, conv[:i])


def test_a_harmony_prompt_of_another_conversation_is_still_refused(harmony_tok):
    tok = harmony_tok
    other = _prompt(tok, [CONV[0], {"role": "assistant", "content": "Something else."}, *CONV[2:5]])
    assert assistant_spans(tok, CONV, other) is None
    # a prompt cut short (a turn missing at the end) is not this conversation either
    assert assistant_spans(tok, CONV, _prompt(tok, CONV[:3])) is None


def test_a_think_block_only_on_the_last_turn_still_gives_every_earlier_answer(tiny_target):
    # Qwen3's template keeps the think block of the turn after the last user message only: an earlier answer
    # rendered as the last message has "<think>...</think>" the whole conversation does not have.
    tok = load_tokenizer(tiny_target, trust_remote_code=False)
    tok.chat_template = tok.chat_template.replace(
        "{% generation %}{{ message['content'] }}",
        "{% generation %}{% if loop.last and not add_generation_prompt %}<think>\n\n</think>\n\n{% endif %}"
        "{{ message['content'] }}")
    assert "<think>" in tok.chat_template  # the template was changed: the case under test is reachable
    prompt = _prompt(tok, CONV[:-1])
    spans = assistant_spans(tok, CONV, prompt)
    assert [tok.decode(prompt[a:b]) for a, b in spans] == ["Answer 1.<|end|>", "Answer 2.<|end|>"]


def test_a_last_turn_that_differs_after_its_end_token_does_not_swallow_the_next_turn(tiny_target):
    # the renderings part after the end-of-turn token (a last turn closed with a blank line): the span still
    # ends at the turn's own end token, not at the next user turn's
    tok = load_tokenizer(tiny_target, trust_remote_code=False)
    tok.chat_template = tok.chat_template.replace(
        "{% endgeneration %}{{ '\\n' }}",
        "{% endgeneration %}{% if loop.last and not add_generation_prompt %}[closed]{% endif %}{{ '\\n' }}")
    assert "[closed]" in tok.chat_template
    prompt = _prompt(tok, CONV[:-1])
    spans = assistant_spans(tok, CONV, prompt)
    assert [tok.decode(prompt[a:b]) for a, b in spans] == ["Answer 1.<|end|>", "Answer 2.<|end|>"]


def test_capture_trains_on_every_harmony_answer(harmony_root, harmony_tok):
    # the path capture takes: the target's tokenizer from disk, the stored row's messages and prompt ids
    prompt = _prompt(harmony_tok, CONV[:-1])
    row = {"sample_id": "d-1", "messages_json": json.dumps(CONV), "prompt_token_ids": prompt}
    spans = list(_turn_spans(str(harmony_root), [row], [])(row))
    assert len(spans) == 2
    mask = loss_mask(len(prompt), 4, spans)
    trained = harmony_tok.decode([t for t, m in zip(prompt, mask) if m], skip_special_tokens=False)
    assert trained == "<|channel|>final<|message|>Answer 1.<|end|><|channel|>final<|message|>Answer 2.<|end|>"
