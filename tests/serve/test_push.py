"""``serve push`` against a Hub stand-in on loopback: the real ``huggingface_hub`` client talks HTTP to
a small recording server (HF_ENDPOINT), so the test sees exactly what would reach the Hub: the repo
creation, the branch, the commit's files and card, and the token only in the Authorization header.

The stand-in answers the five endpoints a commit of small files uses (create repo, create branch,
validate-yaml, preupload, commit) and tells the client to send every file inline ("regular"); how
the real Hub stores large files (LFS/Xet) is the client's business and not exercised here.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from eaglenest.serve.cli import main

TOKEN = "hf_test_secret_0123456789abcdef"


class _Hub(BaseHTTPRequestHandler):
    requests: list  # set per server

    def do_POST(self):  # noqa: N802 - http.server's naming
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.requests.append({"path": self.path, "auth": self.headers.get("Authorization"), "body": body})
        parts = self.path.split("?")[0].strip("/").split("/")
        base = f"http://127.0.0.1:{self.server.server_port}"
        if self.headers.get("Authorization") != f"Bearer {TOKEN}":
            return self._json({"error": "Invalid credentials in Authorization header"}, status=401)
        if self.path == "/api/repos/create":
            d = json.loads(body)
            return self._json({"url": f"{base}/{d['organization']}/{d['name']}"})
        if parts[:2] == ["api", "validate-yaml"] or parts[-2:-1] == ["branch"]:
            return self._json({})
        if len(parts) == 6 and parts[4] == "preupload":
            files = json.loads(body)["files"]
            return self._json({"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                         for f in files]})
        if len(parts) == 6 and parts[4] == "commit":
            return self._json({"commitUrl": f"{base}/{parts[2]}/{parts[3]}/commit/{'a' * 40}",
                               "commitOid": "a" * 40, "pullRequestUrl": None})
        self._json({"error": "not found"}, status=404)

    def do_GET(self):  # noqa: N802 - e.g. repo_info after a refused create: unknown here
        self.requests.append({"path": self.path, "auth": self.headers.get("Authorization"), "body": b""})
        self._json({"error": "Repository not found"}, status=404)

    def _json(self, data, status=200):
        raw = json.dumps(data).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *args):  # keep test output quiet
        pass


@pytest.fixture
def hub():
    handler = type("Hub", (_Hub,), {"requests": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}", handler.requests
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, synth):
    """A workdir with an exported draft, an evaluate report of it, and a manifest naming licences."""
    from eaglenest.serve.export import export_draft
    from eaglenest.train.checkpoint import save_checkpoint
    from eaglenest.train.config import TrainConfig
    from eaglenest.train.loop import build_draft
    from eaglenest.train.target import load_target_tensors
    from eaglenest.train.vocab import select_vocab

    tmp = tmp_path_factory.mktemp("push")
    target = synth.make_target(tmp / "target")
    vocab = select_vocab(torch.randint(0, 100, (2048,)).numpy(), 700)
    model = build_draft(TrainConfig(draft_vocab_size=700), load_target_tensors(target), layer_ids=(2, 4, 5),
                        vocab=vocab, seed=0)
    meta = {"feature_set_id": "fs-1234", "identity": json.dumps({"target": "t", "layer_ids": [2, 4, 5]})}
    save_checkpoint(tmp / "w" / "train", model, info={"layer_ids": [2, 4, 5], "step": 42, "table_version": 7,
                                                      "store_uri": str(tmp / "w" / "store"), "table": "features",
                                                      "feature_meta": meta, "train_config": {}})
    draft = export_draft(tmp / "w" / "train", tmp / "w" / "draft", target_dir=target)
    row = {"prompts": 3, "acceptance_length": 2.5, "acceptance_length_per_request": 2.4,
           "acceptance_by_position": [0.8, 0.5, 0.2]}
    (tmp / "w" / "eval").mkdir()
    (tmp / "w" / "eval" / "report.json").write_text(json.dumps(
        {"draft": str(draft), "num_speculative_tokens": 3, "temperature": 0.0, "domains": {"arithmetic": row},
         "overall": row, "lossless": {"identical": 3, "prompts": 3}}))
    for name in ("a", "b"):
        (tmp / f"{name}.jsonl").write_text('{"prompt": "hi"}\n')
    manifest = tmp / "manifest.yaml"
    manifest.write_text(f"""name: pushtest
licence: CC0-1.0
domains:
  arithmetic:
    cap_prompts: 5
    sources:
      - {{path: {tmp / 'a.jsonl'}, field: prompt, provenance: test}}
  prose:
    cap_prompts: 5
    sources:
      - {{path: {tmp / 'b.jsonl'}, field: prompt, provenance: test}}
""")
    return tmp, draft, manifest


def _cli(root, run_dir, *overrides, env_extra=None, home=None):
    tmp, _, manifest = run_dir
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HF_ENDPOINT", "HF_HUB_OFFLINE")}
    env.update(HF_HOME=str(home or tmp / "hf-home"), HF_HUB_DISABLE_TELEMETRY="1", **(env_extra or {}))
    argv = [sys.executable, "-m", "eaglenest.serve.cli", "push", "--recipe", str(root / "recipes/toy.yaml"),
            f"run.workdir={tmp / 'w'}", f"ingest.manifest={manifest}", *overrides]
    return subprocess.run(argv, cwd=root, env=env, capture_output=True, text=True, timeout=300)


def test_push_sends_the_draft_and_card(root, run_dir, hub):
    url, requests = hub
    tmp, draft, _ = run_dir
    before = {p.name: p.read_bytes() for p in draft.iterdir()}
    r = _cli(root, run_dir, "serve.hub_repo_id=me/tiny-draft", "serve.hub_revision=exp-1",
             env_extra={"HF_TOKEN": TOKEN, "HF_ENDPOINT": url})
    assert r.returncode == 0, r.stderr
    assert "me/tiny-draft@exp-1" in r.stdout
    assert TOKEN not in r.stdout + r.stderr  # never printed nor logged
    paths = [q["path"] for q in requests]
    assert paths == ["/api/repos/create", "/api/models/me/tiny-draft/branch/exp-1", "/api/validate-yaml",
                     "/api/models/me/tiny-draft/preupload/exp-1", "/api/models/me/tiny-draft/commit/exp-1"]
    assert all(q["auth"] == f"Bearer {TOKEN}" for q in requests)
    create = json.loads(requests[0]["body"])
    assert (create["name"], create["organization"], create["visibility"]) == ("tiny-draft", "me", "private")
    lines = [json.loads(x) for x in requests[-1]["body"].splitlines()]
    assert lines[0]["key"] == "header" and lines[0]["value"]["summary"].startswith("eaglenest EAGLE-3 draft (vllm")
    sent = {x["value"]["path"]: base64.b64decode(x["value"]["content"]) for x in lines[1:]}
    assert [x["key"] for x in lines[1:]] == ["file"] * 4
    assert list(sent) == ["config.json", "model.safetensors", "provenance.json", "README.md"]
    for name in ("config.json", "model.safetensors", "provenance.json"):
        assert sent[name] == before[name], name
    card = sent["README.md"].decode()
    assert card.startswith("---\nlicense: cc0-1.0\n") and "- eagle3\n" in card and "base_model" not in card
    assert before["README.md"].decode().rstrip() in card  # the export's card, whole
    for line in ("| features table | `features` version 7 |", "| feature set | `fs-1234` |",
                 "| draft checkpoint | step 42 |", "| manifest | `pushtest` |",
                 f"- `arithmetic: {tmp / 'a.jsonl'}`: CC0-1.0", "| **overall** | 3 | 2.500 | 2.400 | 0.800 |",
                 "Lossless check: 3/3"):
        assert line in card, line
    # Nothing local changed, and the token was written nowhere under the run.
    assert {p.name: p.read_bytes() for p in draft.iterdir()} == before
    assert not any(TOKEN.encode() in p.read_bytes() for p in tmp.rglob("*") if p.is_file())


def test_push_without_token_exits_2(root, run_dir, tmp_path, hub):
    url, requests = hub
    r = _cli(root, run_dir, "serve.hub_repo_id=me/ok", env_extra={"HF_ENDPOINT": url}, home=tmp_path)
    assert r.returncode == 2 and "no Hugging Face token" in r.stderr and "Traceback" not in r.stderr
    assert requests == []  # nothing sent without a token


def test_push_error_messages(root, run_dir, tmp_path, capsys):
    tmp, _, manifest = run_dir
    base = ["push", "--recipe", str(root / "recipes/toy.yaml"), f"ingest.manifest={manifest}"]
    cases = (([f"run.workdir={tmp / 'w'}", "serve.hub_repo_id=me/bad--id"], "serve.hub_repo_id:"),
             ([f"run.workdir={tmp / 'w'}", "serve.hub_repo_id=nonamespace"], "'namespace/name'"),
             ([f"run.workdir={tmp / 'w'}"], "serve.hub_repo_id: set the Hub repo"),
             ([f"run.workdir={tmp_path / 'empty'}", "serve.hub_repo_id=me/ok"], "no exported draft at"))
    for overrides, message in cases:
        assert main(base + overrides) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("serve: error:") and message in err[0], err


def test_card_mixed_licences_and_foreign_report(run_dir):
    from eaglenest.serve.push import plan_push

    _, draft, _ = run_dir
    plan = plan_push(draft, repo_id="me/x", visibility="public", licences={"a": "CC0-1.0", "b": "CC-BY-4.0"},
                     report={"draft": "/elsewhere/draft", "domains": {}, "overall": {}})
    assert not plan.private and "license: other\nlicense_name: cc-by-4.0-cc0-1.0\n" in plan.card
    assert "## Acceptance length" not in plan.card  # the report measured another draft


def test_push_refused_by_the_hub(run_dir, hub):
    from eaglenest.errors import EaglenestError
    from eaglenest.serve.push import plan_push, push_draft

    url, requests = hub
    _, draft, _ = run_dir
    plan = plan_push(draft, repo_id="me/x", licences={"a": "CC0-1.0"})
    with pytest.raises(EaglenestError, match="the Hub refused") as err:
        push_draft(plan, token="hf_wrong_token_0123456789", endpoint=url)
    assert "hf_wrong_token" not in str(err.value) and "\n" not in str(err.value)
    assert requests and not any(q["path"].endswith("/commit/main") for q in requests)
