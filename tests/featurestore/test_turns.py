"""Earlier assistant turns of a multi-turn conversation are located by the chat template and trained on."""

from __future__ import annotations

from transformers import AutoTokenizer

from eaglenest.featurestore.capture.turns import assistant_spans, loss_mask

CONV = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "2 + 3 = 5"}, {"role": "user", "content": "And times 4?"},
        {"role": "assistant", "content": "5 x 4 = 20"}, {"role": "user", "content": "In words?"},
        {"role": "assistant", "content": "twenty"}]


def _prompt(tok, messages):
    return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])


def test_spans_cover_each_earlier_answer_and_its_end_token(tiny_target):
    tok = AutoTokenizer.from_pretrained(tiny_target)
    prompt = _prompt(tok, CONV[:-1])
    spans = assistant_spans(tok, CONV, prompt)
    assert [tok.decode(prompt[a:b]) for a, b in spans] == ["2 + 3 = 5<|end|>", "5 x 4 = 20<|end|>"]
    mask = loss_mask(len(prompt), 3, spans)
    assert sum(mask) == sum(b - a for a, b in spans) + 3 and mask[-3:] == [1, 1, 1]
    assert mask[:spans[0][0]] == [0] * spans[0][0]


def test_single_turn_has_no_spans_and_a_mismatch_is_reported(tiny_target):
    tok = AutoTokenizer.from_pretrained(tiny_target)
    assert assistant_spans(tok, CONV[:3], _prompt(tok, CONV[:2])) == []
    other = _prompt(tok, [*CONV[:2], {"role": "assistant", "content": "something else"}, CONV[3]])
    assert assistant_spans(tok, CONV[:5], other) is None


def test_spans_are_found_under_the_kwargs_the_prompt_was_rendered_with(tiny_target):
    """A reasoning mode changes the rendered tokens: the spans come out only when the template is
    rendered as ingest rendered the prompt (the kwargs the prompts table records)."""
    tok = AutoTokenizer.from_pretrained(tiny_target)
    tok.chat_template = "{% if enable_thinking %}[thinking on]{% endif %}" + tok.chat_template
    prompt = list(tok.apply_chat_template(CONV[:-1], add_generation_prompt=True, tokenize=True,
                                          enable_thinking=True)["input_ids"])
    assert assistant_spans(tok, CONV, prompt) is None  # the template's defaults give other tokens
    spans = assistant_spans(tok, CONV, prompt, {"enable_thinking": True})
    assert [tok.decode(prompt[a:b]) for a, b in spans] == ["2 + 3 = 5<|end|>", "5 x 4 = 20<|end|>"]
