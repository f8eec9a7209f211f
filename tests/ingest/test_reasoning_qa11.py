"""Think tags of a harmony-format target (gpt-oss): its thinking is the ``analysis`` channel, closed by ``<|end|>``."""

from __future__ import annotations

import json
import shutil

from eaglenest.hf import load_tokenizer
from eaglenest.ingest.reasoning import ThinkCheck, resolve_tags

#: What gpt-oss's chat template writes for an earlier answer's reasoning (its analysis channel).
HARMONY = ('{%- if message.thinking %}{{- "<|start|>assistant<|channel|>analysis<|message|>" + message.thinking '
           '+ "<|end|>" }}{%- endif %}')


def _harmony_target(tmp_path, tiny_target):
    """A tiny-target copy whose chat template also renders the analysis channel as gpt-oss's does."""
    root = tmp_path / "harmony target"
    shutil.copytree(tiny_target, root)
    cfg = json.loads((root / "tokenizer_config.json").read_text())
    cfg["chat_template"] = cfg["chat_template"] + "{% for message in [] %}" + HARMONY + "{% endfor %}"
    (root / "tokenizer_config.json").write_text(json.dumps(cfg))
    return root


def test_the_analysis_channel_of_a_harmony_target_is_its_think_block(tmp_path, tiny_target):
    # gpt-oss (a supported target) thinks in "<|channel|>analysis<|message|>...<|end|>": none of the known pairs,
    # so the tags fell back to <think>, which it never writes, and answers cut off by max_tokens inside the
    # analysis were stored and trained on as if they were answers.
    root = _harmony_target(tmp_path, tiny_target)
    tok = load_tokenizer(root, trust_remote_code=False)
    tags = resolve_tags([], tok)
    assert tags == ("<|channel|>analysis<|message|>", "<|end|>")
    check = ThinkCheck(*tags, target=str(root))

    def ids(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    prompt = ids("<|start|>user<|message|>What is 2 + 2?<|end|><|start|>assistant")
    thinking = "<|channel|>analysis<|message|>The user asks for a sum, so"
    assert check.truncated(prompt, ids(thinking), "length")  # cut off inside the analysis: dropped
    assert not check.truncated(prompt, ids(thinking), "stop")
    answered = thinking + " 4.<|end|><|start|>assistant<|channel|>final<|message|>2 + 2 is"
    assert not check.truncated(prompt, ids(answered), "length")  # cut off in the final answer: kept
