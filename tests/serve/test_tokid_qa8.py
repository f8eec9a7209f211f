"""``serve up`` and ``evaluate al`` with a ``run.target`` whose tokenizer or chat template is not the one
the exported draft's features were captured with (QA8). ``serve export`` compared them; before the fix
``serve up`` served the export with an edited copy of the target (or another tokenizer) without a word,
and ``evaluate al`` measured it so: vLLM served the draft on token ids it never saw, a quietly low AL.
No engine starts: every check runs before the server or the engine.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pyarrow as pa
import pytest

from eaglenest.errors import ConfigError
from eaglenest.evaluate.config import EvaluateConfig
from eaglenest.evaluate.plan import plan
from eaglenest.featurestore import schema as S
from eaglenest.featurestore.capture.identity import tokenizer_hashes
from eaglenest.featurestore.table import store
from eaglenest.recipe import load_recipe
from eaglenest.serve.cli import main as serve_main
from eaglenest.serve.commands import up_server
from eaglenest.serve.export import export_draft


@pytest.fixture(scope="module")
def trained(tmp_path_factory, toy_checkpoint, tiny_target, stamp_identity) -> Path:
    """A checkpoint whose features' identity is the tiny target's, exported as ``serve export`` does:
    ``<folder>/train`` and ``<folder>/draft``."""
    folder = tmp_path_factory.mktemp("tokid") / "work dir ü"
    shutil.copytree(toy_checkpoint, folder / "train")
    stamp_identity(folder / "train", tiny_target)
    export_draft(folder / "train", folder / "draft", target_dir=tiny_target)
    return folder


@pytest.fixture
def work(tmp_path, trained) -> Path:
    w = tmp_path / "work dir"
    shutil.copytree(trained, w)
    return w


def _recipe(root, work, target, *overrides):
    return load_recipe(root / "recipes" / "toy.yaml", [f"run.workdir={work}", f"run.target={target}", "serve.port=0",
                                                       *overrides])


def _spec_model(server) -> str:
    return json.loads(server.argv[server.argv.index("--speculative-config") + 1])["model"]


def test_serve_up_refuses_an_edited_template_naming_both_hashes(root, work, tiny_target, edited_target):
    then, now = tokenizer_hashes(str(tiny_target))[1], tokenizer_hashes(str(edited_target))[1]
    with pytest.raises(ConfigError) as err:
        up_server(_recipe(root, work, edited_target))
    line = str(err.value)
    assert "\n" not in line
    # (tokenizer_config.json holds the template: its file is among the tokenizer files the identity hashes)
    assert line.startswith("run.target: the tokenizer files (sha256 "), line
    assert f" and the chat template (sha256 {then[:12]} in the feature identity in {work}/draft/provenance.json, " \
           f"{now[:12]} in {edited_target}) differ from those of {tiny_target}, which the draft was trained on" in line
    assert line.endswith("or set run.off_policy=true if intended"), line


def test_serve_up_refuses_another_tokenizer_in_one_line_before_the_server(capsys, tmp_path, root, work, tiny_target):
    other = tmp_path / "other tokenizer"
    shutil.copytree(tiny_target, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    (other / "tokenizer.json").write_text(json.dumps(tok, indent=1, sort_keys=True) + "\n")
    then, now = tokenizer_hashes(str(tiny_target))[0], tokenizer_hashes(str(other))[0]
    code = serve_main(["up", f"--recipe={root / 'recipes' / 'toy.yaml'}", f"run.workdir={work}",
                       f"run.target={other}", "serve.port=0", "--for-seconds=1"])
    assert code == 2
    lines = [x for x in capsys.readouterr().err.strip().splitlines() if " WARNING " not in x and " INFO " not in x]
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    assert f"run.target: the tokenizer files (sha256 {then[:12]} in the feature identity in " in lines[0], lines
    assert f", {now[:12]} in {other}) differ from those of {tiny_target}" in lines[0], lines
    assert not (work / "serve").exists()  # refused before the server's log was opened


def test_off_policy_serves_with_a_warning_and_the_own_target_without(caplog, root, work, tiny_target, edited_target):
    with caplog.at_level(logging.WARNING):
        server = up_server(_recipe(root, work, edited_target, "run.off_policy=true"))
    assert _spec_model(server) == str(work / "draft")
    said = [r.getMessage() for r in caplog.records if "chat template" in r.getMessage()]
    assert len(said) == 1 and said[0].endswith("serving it anyway because run.off_policy=true"), said
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert _spec_model(up_server(_recipe(root, work, tiny_target))) == str(work / "draft")
        assert up_server(_recipe(root, work, edited_target), no_spec=True).argv  # no draft served: nothing to check
    assert not [r for r in caplog.records if "chat template" in r.getMessage()]


def test_an_export_without_the_record_is_checked_against_its_checkpoint(root, work, edited_target):
    """An export whose provenance.json records no feature identity (written before it) is compared with
    the checkpoint.json it names; one naming none (another tool's draft) is not compared."""
    prov = json.loads((work / "draft" / "provenance.json").read_text())
    del prov["inputs"]["feature_identity"]
    prov["inputs"]["checkpoint"] = str(work / "train")
    (work / "draft" / "provenance.json").write_text(json.dumps(prov))
    with pytest.raises(ConfigError, match=rf"in the feature identity of {work}/train/checkpoint\.json, "):
        up_server(_recipe(root, work, edited_target))
    (work / "draft" / "provenance.json").unlink()
    assert _spec_model(up_server(_recipe(root, work, edited_target))) == str(work / "draft")


def test_an_identity_recorded_before_the_new_files_counted_is_not_refused(tmp_path, root, work, tiny_target):
    """The draft's features were captured when added_tokens.json and chat_template.json did not count: the
    same target holding them is served (and exported) as before; an edit of its tokenizer.json is not."""
    same = tmp_path / "same target"
    shutil.copytree(tiny_target, same)
    (same / "added_tokens.json").write_text('{"<extra_0>": 1141}')
    (same / "chat_template.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    assert tokenizer_hashes(str(same)) != tokenizer_hashes(str(tiny_target))
    assert _spec_model(up_server(_recipe(root, work, same))) == str(work / "draft")
    shutil.rmtree(work / "draft")
    assert serve_main(["export", f"--recipe={root / 'recipes' / 'toy.yaml'}", f"run.workdir={work}",
                       f"run.target={same}"]) == 0
    (same / "tokenizer.json").write_text((same / "tokenizer.json").read_text() + "\n")
    with pytest.raises(ConfigError, match=r"^run\.target: the tokenizer files \(sha256 "):
        up_server(_recipe(root, work, same))


def _prompts_store(path: Path) -> str:
    rows = [dict(sample_id=f"p-{i}", domain="prose", source="test", split="heldout", mode="chat",
                 messages_json=json.dumps([{"role": "user", "content": text}]), prompt_token_ids=[],
                 response_token_ids=[], finish_reason="", gen_params_id="g")
            for i, text in enumerate(["Describe a quiet morning.", "Tell me about the sea."])]
    store.append(str(path), store.PROMPTS, pa.Table.from_pylist(rows, schema=S.PROMPTS_SCHEMA))
    return str(path)


def test_evaluate_plan_warns_of_an_edited_template_once(caplog, tmp_path, work, tiny_target, edited_target):
    """``evaluate al`` measures a draft on the target it is asked to (a measurement, not a refusal), saying in
    one warning line that the template is not the one its features were captured with."""
    uri = _prompts_store(tmp_path / "store")
    cfg = EvaluateConfig(num_speculative_tokens=2, max_tokens=4, max_prompts_per_domain=1, context_buckets=())
    with caplog.at_level(logging.WARNING):
        got = plan(cfg, target=str(edited_target), store_uri=uri, draft=str(work / "draft"))
    assert [p["sample_id"] for ps in got.groups.values() for p in ps]
    said = [r.getMessage() for r in caplog.records if "chat template" in r.getMessage()]
    assert len(said) == 1 and "\n" not in said[0], said
    assert said[0].startswith("run.target: the tokenizer files (sha256 ") and " and the chat template (sha256 " in \
        said[0] and said[0].endswith("vLLM would serve it on token ids it never saw; measuring it anyway"), said
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        plan(cfg, target=str(tiny_target), store_uri=uri, draft=str(work / "draft"))
    assert not [r for r in caplog.records if "chat template" in r.getMessage()]
