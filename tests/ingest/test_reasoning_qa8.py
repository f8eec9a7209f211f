"""Think tags of a target whose tokenizer holds named chat templates (a list in tokenizer_config.json)."""

from __future__ import annotations

import json
import shutil

from eaglenest.hf import load_tokenizer
from eaglenest.ingest.reasoning import ThinkCheck, resolve_tags


def _named_templates_target(tmp_path, tiny_target):
    """A tiny-target copy whose templates are named (default, tool_use); the default opens <thinking>."""
    root = tmp_path / "named target"
    shutil.copytree(tiny_target, root)
    cfg = json.loads((root / "tokenizer_config.json").read_text())
    plain = cfg["chat_template"]
    thinking = plain.replace("{{ bos_token }}", "{{ bos_token }}{% if enable_thinking %}<thinking>\n{% endif %}", 1)
    cfg["chat_template"] = [{"name": "default", "template": thinking + "{# </thinking> closes the block #}"},
                            {"name": "tool_use", "template": plain}]
    (root / "tokenizer_config.json").write_text(json.dumps(cfg))
    return root


def test_the_tags_of_named_chat_templates_are_found(tmp_path, tiny_target):
    # transformers gives such a tokenizer's chat_template as a dict: its templates were not looked at, the tags
    # fell back to <think>, and answers cut off inside an open <thinking> block were stored and trained on.
    root = _named_templates_target(tmp_path, tiny_target)
    tok = load_tokenizer(root, trust_remote_code=False)
    assert isinstance(tok.chat_template, dict)  # the case this test is about
    tags = resolve_tags([], tok)
    assert tags == ("<thinking>", "</thinking>")
    check = ThinkCheck(*tags, target=str(root))
    cut = tok("<thinking> still weighing it", add_special_tokens=False)["input_ids"]
    assert check.truncated([], cut, "length")
