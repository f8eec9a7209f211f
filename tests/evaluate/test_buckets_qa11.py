"""QA repros, eleventh pass, for the ``chat`` context-bucket prompts (``evaluate.buckets``):

a target whose chat template writes a default system turn when the conversation has none (Llama 3.1-3.3's
dated system header, Qwen2.5's "You are Qwen ...") got ``chat`` bucket prompts with that system turn in the
middle, right before the closing question, and the last earlier turn cut short by the system turn's length:
the question's own rendering (the template's head included) was taken as the tail of the long chat's. The
head now stays at the front, once, and the turns before the question are whole.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from eaglenest.evaluate.buckets import build_bucket_prompts

SYSTEM = "You are a helpful assistant. Today Date: 7 Dec 2026."
MATERIAL = [([{"role": "user", "content": f"Tell me fact {i}."}], f"Fact {i} is that owls hunt at night.")
            for i in range(6)]


@pytest.fixture(scope="module")
def default_system_tok(tiny_target, tmp_path_factory):
    """The tiny target's tokenizer with a template that writes a system turn when none is given."""
    out = tmp_path_factory.mktemp("default system")
    for name in ("tokenizer.json", "special_tokens_map.json"):
        shutil.copy(Path(tiny_target) / name, out / name)
    cfg = json.loads((Path(tiny_target) / "tokenizer_config.json").read_text(encoding="utf-8"))
    head = "{{ bos_token }}"
    assert cfg["chat_template"].startswith(head)
    cfg["chat_template"] = (head + "{% if messages[0]['role'] != 'system' %}<|system|>\n" + SYSTEM + "<|end|>\n"
                            "{% endif %}" + cfg["chat_template"][len(head):])
    (out / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")
    return AutoTokenizer.from_pretrained(str(out))


@pytest.mark.parametrize("length", [120, 200, 1024])
def test_a_default_system_turn_stays_at_the_front_and_the_last_turn_whole(default_system_tok, length):
    tok = default_system_tok
    prompts = build_bucket_prompts(tok, MATERIAL, (length,), per_bucket=3, max_positions=4096, max_tokens=64,
                                   kinds=("chat",))
    for p in prompts[length]:
        ids = p["prompt_token_ids"]
        text = tok.decode(ids)
        assert len(ids) == length and ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
        assert text.count("<|system|>") == 1 and text.startswith("<|bos|><|system|>\n" + SYSTEM[:20]), text
        # the question, after a whole earlier turn: its answer in full, then the question's turn
        end = re.search(r"<\|assistant\|>\n(Fact \d is that owls hunt at night\.)<\|end\|>\n"
                        r"<\|user\|>\nTell me fact \d\.<\|end\|>\n<\|assistant\|>\n$", text)
        assert end, text[-300:]


def test_prompts_of_a_template_without_a_default_turn_are_unchanged(tiny_target):
    """The plain template's prompts are what they were: BOS, the history cut at the front, the question."""
    tok = AutoTokenizer.from_pretrained(tiny_target)
    length = 150
    ids = build_bucket_prompts(tok, MATERIAL, (length,), per_bucket=1, max_positions=4096, max_tokens=64,
                               kinds=("chat",))[length][0]["prompt_token_ids"]
    rng = random.Random("0:0")
    q_msgs, _ = MATERIAL[rng.randrange(len(MATERIAL))]
    tail = tok.apply_chat_template(q_msgs, add_generation_prompt=True, tokenize=False)
    assert len(ids) == length and tok.decode(ids).endswith(tail[len("<|bos|>"):])
    assert tok.decode(ids[:1]) == "<|bos|>" and not tok.decode(ids[1:]).startswith("<|user|>")  # cut mid-text


def test_building_long_prompts_does_not_warn_of_indexing_errors(tiny_target):
    """The renders a bucket prompt is cut from run past the tokenizer's ``model_max_length`` (a 32K bucket's chat
    history: 34,874 tokens on the long fixture), and transformers warned "Running this sequence through the model
    will result in indexing errors" on every long-context evaluation, of prompts that are then cut to fit."""
    tok = AutoTokenizer.from_pretrained(tiny_target, model_max_length=300)
    out = build_bucket_prompts(tok, MATERIAL, (290,), per_bucket=4, max_positions=4096, max_tokens=64,
                               kinds=("records", "code", "recall", "chat"))
    assert all(len(p["prompt_token_ids"]) == 290 for p in out[290])
    warned = tok.deprecation_warnings.get("sequence-length-is-longer-than-the-specified-maximum", False)
    assert not warned, "transformers warned of indexing errors while the bucket prompts were built"
    tok("owls hunt at night " * 100)  # the control: a text past model_max_length encoded as such sets the flag
    assert tok.deprecation_warnings.get("sequence-length-is-longer-than-the-specified-maximum", False), \
        "transformers no longer records this warning under that key: the check above would check nothing"
