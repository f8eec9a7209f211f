"""QA repros, eleventh pass, for the long-context material (``evaluate.longctx``) on the tiny target's tokenizer:

* a ``recall`` prompt whose held-out chats start with a blank line (a user message ``"\\nQuestion ..."``, legal
  input) had the filler that makes up its exact length spliced in right after the first turn's fact, inside
  the user's first message (``"... my favourite city is Porto.6 plus 16?\\nIt is 32.<|end|>"``): the splice
  point is found by the first line of the first filler turn, and an empty first line is found at once,
  where the fact ends. The evidence span then covered the spliced text and missed the end of the
  assistant's acknowledgement. A first line the acknowledgement holds ("Nice to meet you") was found inside
  it, splitting it the same way;
* a bucket too short for a kind was refused with "its question and evidence alone take N", N below the
  bucket (a 200-token ``code`` bucket: "take 146"), so the line did not say what length would do; it now
  names the length the prompt needs.
"""

from __future__ import annotations

import re

import pytest
from transformers import AutoTokenizer

from eaglenest.errors import ConfigError
from eaglenest.evaluate.longctx import generate


@pytest.fixture(scope="module")
def tok(tiny_target):
    return AutoTokenizer.from_pretrained(tiny_target)


def _material(lead: str) -> list:
    return [([{"role": "user", "content": f"{lead}Question {i}: what is {i} plus {i}?"}], f"It is {2 * i}.")
            for i in range(40)]


@pytest.mark.parametrize("lead", ["\n", "\n\n", " \n", "  ", "Nice to meet you\n"])
@pytest.mark.parametrize("length", [1024, 2048])
def test_a_recall_prompt_keeps_its_first_turn_whole_whatever_its_filler_starts_with(tok, lead, length):
    clean = generate("recall", tok, length, seed=3, material=_material(""))
    p = generate("recall", tok, length, seed=3, material=_material(lead))
    assert len(p.prompt_token_ids) == length
    evidence = tok.decode(p.prompt_token_ids[slice(*p.evidence)])
    assert evidence == tok.decode(clean.prompt_token_ids[slice(*clean.evidence)]), evidence
    assert "plus" not in evidence and evidence.endswith(f"{p.answer_value}."), evidence  # the turn, nothing spliced
    fact = evidence.index(p.answer_value)
    text = tok.decode(p.prompt_token_ids)
    assert text[:len(evidence) + 200].count(evidence[:fact]) == 1
    # the acknowledgement's turn is closed right after it, and the next user turn opens: what the template
    # writes between an assistant message and the next user message (rendered here), nothing spliced in between
    two = tok.apply_chat_template([{"role": "user", "content": "A"}, {"role": "assistant", "content": "B"},
                                   {"role": "user", "content": "C"}], tokenize=False)
    between = two[two.index("B") + 1:two.index("C")]
    assert between and text[text.index(evidence) + len(evidence):].startswith(between), text[:len(evidence) + 300]


@pytest.mark.parametrize("kind", ["records", "code", "recall"])
def test_a_bucket_too_short_for_a_kind_names_the_length_it_needs(tok, kind):
    """The length the refusal names is one the kind's prompt is built at, and the length refused is below it."""
    err = ""
    for length in range(16, 400):  # up to the first length that builds
        try:
            generate(kind, tok, length, seed=5)
            break
        except ConfigError as exc:
            err = str(exc)
    need = re.search(r"needs at least (\d+) tokens", err)
    assert need, f"{kind}: the refusal at {length - 1} tokens names no length it needs: {err}"
    assert int(need.group(1)) > length - 1, err
    assert len(generate(kind, tok, int(need.group(1)), seed=5).prompt_token_ids) == int(need.group(1))
    with pytest.raises(ConfigError, match=r"needs at least \d+ tokens"):
        generate(kind, tok, 16, seed=5)  # too short for the question itself: a length as well
