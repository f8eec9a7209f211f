"""QA repros for ``serve up``'s server wrapper and ``serve push`` (fourth pass). The server's
process is a stand-in script where only its process handling is under test (named so below)."""

from __future__ import annotations

import os
import shutil
import signal
import sys
import textwrap
import time
import types

import pytest

from eaglenest.errors import ConfigError, EaglenestError
from eaglenest.serve.push import plan_push, push_draft, resolve_token
from eaglenest.serve.server import Server

#: Stand-in for vLLM's API server: ignores SIGTERM (as a server busy loading weights may for a
#: while), starts a child that ignores it too (vLLM's engine process), never answers /health.
STUBBORN_SERVER = textwrap.dedent("""
    import signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                      "time.sleep(600)"])
    time.sleep(600)
""")


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_second_ctrl_c_while_stopping_leaves_no_server_behind(tmp_path, tiny_target):
    """Ctrl-C during start-up stops the server (SIGTERM, up to 30 s before SIGKILL); a second Ctrl-C
    while it waited escaped ``stop()`` and left the server and its engine process running."""
    server = Server(str(tiny_target), log_dir=tmp_path, startup_timeout_s=60)
    server.argv = [sys.executable, "-c", STUBBORN_SERVER]
    interrupts = []

    def ctrl_c(signum, frame):
        if len(interrupts) < 2:
            interrupts.append(time.monotonic())
            raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, ctrl_c)
    signal.setitimer(signal.ITIMER_REAL, 2.0, 1.0)  # the first once the child started, then each second
    try:
        with pytest.raises(KeyboardInterrupt):
            server.start()
        signal.setitimer(signal.ITIMER_REAL, 0)
        assert len(interrupts) == 2  # both reached start-up or stop(), not this test's code
        deadline = time.monotonic() + 15
        while _group_alive(server.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _group_alive(server.proc.pid), "the server's process group outlived Ctrl-C"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        if server.proc is not None and _group_alive(server.proc.pid):
            os.killpg(server.proc.pid, signal.SIGKILL)


class HubStub:
    """Stand-in for ``huggingface_hub.HfApi`` (no network here): the repo exists, public; records calls."""

    calls: list = []

    def __init__(self, endpoint=None, token=None):
        self.endpoint = endpoint or "https://huggingface.co"

    def create_repo(self, repo_id, *, private, repo_type, exist_ok=False):
        from huggingface_hub.errors import HfHubHTTPError

        self.calls.append(("create_repo", repo_id, private, exist_ok))
        if not exist_ok:
            raise HfHubHTTPError("409 Conflict: You already created this model repo", response=_Response(409))

    def repo_info(self, repo_id, *, repo_type):
        self.calls.append(("repo_info", repo_id))
        return types.SimpleNamespace(private=False)

    def create_branch(self, *args, **kwargs):
        self.calls.append(("create_branch",))

    def create_commit(self, repo_id, ops, **kwargs):
        self.calls.append(("create_commit", repo_id))
        return types.SimpleNamespace(commit_url=f"https://huggingface.co/{repo_id}/commit/{'a' * 40}")


class _Response:
    def __init__(self, status_code):
        self.status_code, self.headers, self.request, self.text = status_code, {}, None, ""

    def json(self):
        return {}


@pytest.fixture
def public_repo(monkeypatch):
    import huggingface_hub

    HubStub.calls = []
    monkeypatch.setattr(huggingface_hub, "HfApi", HubStub)
    return HubStub.calls


def test_a_private_push_to_an_existing_public_repo_is_refused(toy_export, public_repo):
    """``create_repo(private=True, exist_ok=True)`` leaves an existing public repo public: the draft,
    meant to be private, was published."""
    plan = plan_push(toy_export, repo_id="me/draft", visibility="private", licences={"a": "CC0-1.0"})
    with pytest.raises(EaglenestError) as err:
        push_draft(plan, token="hf_x")
    assert str(err.value) == ("serve.hub_visibility: private, but me/draft exists and is public: nothing pushed; "
                              "make the repo private on the Hub or set serve.hub_visibility=public")
    assert not [c for c in public_repo if c[0] == "create_commit"]


def test_a_public_push_to_an_existing_public_repo_commits(toy_export, public_repo):
    plan = plan_push(toy_export, repo_id="me/draft", visibility="public", licences={"a": "CC0-1.0"})
    assert push_draft(plan, token="hf_x").startswith("https://huggingface.co/me/draft/commit/")
    assert ("create_commit", "me/draft") in public_repo


def test_a_draft_without_provenance_is_refused_before_the_hub(tmp_path, toy_export, public_repo):
    """A draft folder without provenance.json was pushed with a card whose lineage read `None`."""
    draft = tmp_path / "draft"
    shutil.copytree(toy_export, draft)
    (draft / "provenance.json").unlink()
    with pytest.raises(EaglenestError) as err:
        plan_push(draft, repo_id="me/draft", licences={"a": "CC0-1.0"})
    assert str(err.value).startswith("serve push: ") and str(err.value).endswith(
        "draft/provenance.json is missing: the model card's lineage comes from it; export the draft again "
        "(`serve export`)"), str(err.value)
    assert public_repo == []


@pytest.mark.parametrize("port", [65536, 70000, -1])
def test_a_port_outside_the_range_is_refused_by_the_server_wrapper(tmp_path, tiny_target, port):
    """The recipe refuses it, the wrapper (``evaluate throughput``, scripts) did not: 70000 was checked
    as port 4464 (getaddrinfo wraps it) and handed to vLLM, which failed after its start-up."""
    with pytest.raises(ConfigError) as err:
        Server(str(tiny_target), log_dir=tmp_path, port=port)
    assert str(err.value) == f"serve.port: 0..65535, got {port}"


@pytest.fixture
def no_saved_login(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("value", ["", "   ", "\n"])
def test_a_blank_hf_token_is_no_token(monkeypatch, no_saved_login, value):
    """HF_TOKEN of blanks was taken as the token (sent to the Hub as is) instead of "no token"."""
    monkeypatch.setenv("HF_TOKEN", value)
    with pytest.raises(EaglenestError) as err:
        resolve_token()
    assert str(err.value) == "serve push: no Hugging Face token: set HF_TOKEN or log in with `hf auth login`"


def test_an_hf_token_read_from_a_file_loses_its_newline(monkeypatch, no_saved_login):
    """``HF_TOKEN`` from an env file keeps its newline, which no HTTP header may carry."""
    monkeypatch.setenv("HF_TOKEN", "hf_abc123\r\n")
    assert resolve_token() == "hf_abc123"
