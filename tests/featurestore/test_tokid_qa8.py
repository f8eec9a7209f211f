"""Tokenizer identity completeness (QA8): every file transformers reads a tokenizer or a chat template
from is part of the feature-set identity and of ``ingest build``'s lineage record. Before the fix an
edited ``added_tokens.json``, a sentencepiece model named otherwise than ``tokenizer.model``
(``spiece.model``, ...), the processor's ``chat_template.json`` or a named template in
``additional_chat_templates/`` left the identity as it was: a store captured with the old files was
reused, and the on-policy checks passed. No engine starts.
"""

from __future__ import annotations

import json
import shutil

import pytest
from transformers import AutoTokenizer

from eaglenest.errors import ConfigError
from eaglenest.featurestore.capture import identity
from eaglenest.featurestore.capture.policy import check_tokenization, tokenization_record


def _copy(tiny_target, tmp_path, name="tok target ü"):
    dst = tmp_path / name
    shutil.copytree(tiny_target, dst)
    return dst


def _feature_set(target) -> str:
    return identity.identity_hash(identity.components(target=str(target), layer_ids=[2, 4, 5], last_layer_id=8,
                                                      dtype="float32", storage="raw", sample_ids=["a"],
                                                      gen_params_ids=["g"]))


@pytest.mark.parametrize("name", ["added_tokens.json", "spiece.model", "sentencepiece.bpe.model", "spm.model",
                                  "tokenizer.model.v3"])
def test_an_edited_tokenizer_file_of_another_name_changes_the_identity(tmp_path, tiny_target, name):
    """Each of these is a file transformers (or mistral_common) builds the vocabulary from: adding it
    or editing it is another tokenizer, so another feature set and another lineage record; the chat
    template's hash is not touched."""
    target = _copy(tiny_target, tmp_path)
    before = (identity.tokenizer_hashes(str(target)), tokenization_record(str(target)), _feature_set(target))
    (target / name).write_text('{"<extra_0>": 1141}' if name.endswith(".json") else "piece 1\n")
    added = (identity.tokenizer_hashes(str(target)), tokenization_record(str(target)), _feature_set(target))
    (target / name).write_text('{"<extra_0>": 1142}' if name.endswith(".json") else "piece 2\n")
    edited = (identity.tokenizer_hashes(str(target)), tokenization_record(str(target)), _feature_set(target))
    for a, b in ((before, added), (added, edited)):
        assert a[0][0] != b[0][0] and a[0][1] == b[0][1]
        assert a[1]["tokenizer_sha256"] != b[1]["tokenizer_sha256"]
        assert a[1]["chat_template_sha256"] == b[1]["chat_template_sha256"]
        assert a[2] != b[2]


def test_the_processor_template_file_changes_the_template_identity_only(tmp_path, tiny_target):
    """``chat_template.json`` is the template AutoProcessor (asked first by vLLM for a multimodal target)
    renders with, over the .jinja files: an edit is another rendering. Absent, nothing changes."""
    target = _copy(tiny_target, tmp_path)
    before = identity.tokenizer_hashes(str(target))
    assert before == identity.tokenizer_hashes(str(tiny_target))
    (target / "chat_template.json").write_text(json.dumps({"chat_template": "{{ messages[0]['content'] }}"}))
    added = identity.tokenizer_hashes(str(target))
    (target / "chat_template.json").write_text(json.dumps({"chat_template": "{{ messages[-1]['content'] }}"}))
    edited = identity.tokenizer_hashes(str(target))
    assert before[1] != added[1] != edited[1] != before[1]
    assert before[0] == added[0] == edited[0]  # the vocabulary is the same
    assert tokenization_record(str(target))["chat_template_sha256"] == edited[1]
    assert tokenization_record(str(target))["tokenizer_sha256"] == tokenization_record(str(tiny_target))[
        "tokenizer_sha256"]


@pytest.mark.parametrize("with_default", [False, True])
def test_named_templates_are_the_templates_the_tokenizer_loads(tmp_path, tiny_target, with_default):
    """``additional_chat_templates/<name>.jinja`` replace tokenizer_config.json's template as AutoTokenizer
    loads it (beside ``chat_template.jinja``, the default, or alone): the identity holds what it loads,
    and an edit of a named one (``tool_use``, what vLLM renders a request with tools with) changes it."""
    target = _copy(tiny_target, tmp_path)
    before = identity.tokenizer_hashes(str(target))[1]
    if with_default:
        (target / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    (target / "additional_chat_templates").mkdir()
    (target / "additional_chat_templates" / "tool_use.jinja").write_text("TOOLS {{ tools }}")
    loaded = AutoTokenizer.from_pretrained(target).chat_template
    assert isinstance(loaded, dict) and ("default" in loaded) == with_default
    assert json.loads(identity.chat_template_text(target)) == loaded
    first = identity.tokenizer_hashes(str(target))[1]
    (target / "additional_chat_templates" / "tool_use.jinja").write_text("TOOLS: {{ tools }}")
    assert before != first != identity.tokenizer_hashes(str(target))[1]
    assert tokenization_record(str(target))["chat_template_sha256"] == identity.tokenizer_hashes(str(target))[1]


def test_a_single_template_file_keeps_the_text_the_tokenizer_loads(tmp_path, tiny_target):
    """One template (tokenizer_config.json's, or chat_template.jinja over it) stays its text, so stores
    captured before the named templates counted keep their identity."""
    target = _copy(tiny_target, tmp_path)
    assert identity.chat_template_text(target) == AutoTokenizer.from_pretrained(target).chat_template
    (target / "chat_template.jinja").write_text("{{ messages }}")
    loaded = AutoTokenizer.from_pretrained(target).chat_template
    assert identity.chat_template_text(target) == "{{ messages }}" == loaded


def test_records_from_before_the_new_files_counted_are_still_the_same_tokenization(tmp_path, tiny_target):
    """A store ingested or captured before added_tokens.json, chat_template.json and named templates counted
    recorded the hashes without them: those (what a copy without the files gives now) are the same
    tokenization, not a refusal; a record of another vocabulary still is."""
    target = _copy(tiny_target, tmp_path)
    assert identity.legacy_tokenization(str(target)) == {**dict(zip(("tokenizer_sha256", "chat_template_sha256"),
                                                                    identity.tokenizer_hashes(str(target)))),
                                                         "vocab_sha256": identity.vocab_hash(str(target))}
    then = tokenization_record(str(target))
    (target / "added_tokens.json").write_text('{"<extra_0>": 1141}')
    (target / "chat_template.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    assert tokenization_record(str(target)) != then
    old = identity.legacy_tokenization(str(target))
    assert old["vocab_sha256"] == then["tokenizer_sha256"] and old["chat_template_sha256"] == then[
        "chat_template_sha256"]
    check_tokenization("unused", str(target), off_policy=False, stage="capture", lineages=[then])  # not refused
    other = {**then, "tokenizer_sha256": "0" * 64}
    with pytest.raises(ConfigError, match=r"^capture: the tokenizer \(vocabulary, merges, special tokens\) \(sha256 "
                                          r"000000000000 then, "):
        check_tokenization("unused", str(target), off_policy=False, stage="capture", lineages=[other])


@pytest.mark.parametrize("where", ["chat_template.jinja", "additional_chat_templates/tool_use.jinja"])
def test_a_template_file_that_is_not_utf8_is_one_line_naming_it(tmp_path, tiny_target, where):
    target = _copy(tiny_target, tmp_path)
    (target / where).parent.mkdir(exist_ok=True)
    (target / where).write_bytes("{{ 'caf\u00e9' }}".encode("latin-1"))
    with pytest.raises(ConfigError, match=rf"^run\.target: {target / where} is not a readable UTF-8 chat template"):
        identity.tokenizer_hashes(str(target))
