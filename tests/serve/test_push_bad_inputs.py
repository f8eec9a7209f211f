"""``serve push`` with a damaged eval/report.json or draft/provenance.json: exit 2, one line naming
the file (before the fix: a traceback). Nothing reaches the network: both are read before the Hub."""

from __future__ import annotations

import json
import shutil

import pytest

from eaglenest.serve.cli import main as serve_main


@pytest.mark.parametrize("file, text, says", [
    ("eval/report.json", "nope", "eval/report.json: not valid JSON"),
    ("eval/report.json", "[1, 2]", "eval/report.json: not a JSON object"),
    ("eval/report.json", json.dumps({"domains": [1, 2]}), "eval/report.json: domains: not an object"),
    ("eval/report.json", json.dumps({"domains": {"x": {"acceptance_length": "abc"}}}),
     "eval/report.json: domains.x.acceptance_length: not a number"),
    ("eval/report.json", json.dumps({"num_speculative_tokens": "abc"}), "eval/report.json: num_speculative_tokens"),
    ("draft/provenance.json", '{"x":', "draft/provenance.json: not valid JSON"),
    ("draft/provenance.json", json.dumps({"inputs": [1]}), "draft/provenance.json: inputs: not an object"),
    ("draft/provenance.json", json.dumps({"format": "vllm\n---\nlicense: mit"}),
     "draft/provenance.json: format: 'vllm\\n---\\nlicense: mit' is not one of vllm, speculators"),
])
def test_push_damaged_files_are_one_line(capsys, monkeypatch, tmp_path, root, toy_export, file, text, says):
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_token")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    work = tmp_path / "work"
    shutil.copytree(toy_export, work / "draft")
    (work / "eval").mkdir()
    (work / file).write_text(text)
    code = serve_main(["push", f"--recipe={root / 'recipes' / 'toy.yaml'}", f"run.workdir={work}",
                       f"ingest.manifest={root / 'recipes' / 'manifests' / 'toy.yaml'}", "serve.hub_repo_id=me/x"])
    assert code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    assert says in lines[0], lines[0]
