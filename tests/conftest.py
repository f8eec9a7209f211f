"""Shared fixtures: the repo root, the committed tiny target, and GPU auto-skip."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from eaglenest import reaper

ROOT = Path(__file__).resolve().parent.parent
TINY_TARGET = ROOT / "assets" / "tiny-target"

# vLLM on CPU: keep engine logs quiet in test output.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


#: Test files whose engine starts make them the longest (seconds on a quiet 2-core machine, measured
#: with ``--durations``). Under ``make test`` (pytest-xdist, whole files per worker) they are handed
#: out first, so no worker starts a long file when the others are nearly done. Only an ordering
#: hint: a file missing here still runs, in its usual place.
HEAVY_FIRST = (
    "tests/archs/test_served.py",            # ~400: four architectures, capture + train + serve each
    "tests/test_pipeline.py",                # ~380: the five stage CLIs end to end
    "tests/ingest/test_dask_cluster.py",     # ~145: a scheduler and two workers, engines in each
    "tests/featurestore/test_object_store.py",  # ~140: the demo's stages against S3 (moto)
    "tests/serve/test_speculators_vllm.py",  # ~110: one export served three ways
    "tests/ingest/test_kill.py",             # ~105: SIGKILL mid-run, then the rerun
    "tests/archs/test_deepseek_v3.py",       # ~85
    "tests/train/test_select.py",            # ~65
    "tests/evaluate/test_vllm.py",           # ~65
)


def pytest_sessionstart(session):
    """Every process the tests start ends with this one, however it ends (common/reaper.py's guard, as a CLI
    arms it): a vLLM server that ``openai_server`` or a `serve up` test starts leads a session of its own, so
    a test that fails before stopping it, or a session pytest-timeout ends at once (no fixture cleanup runs),
    left it running, holding its memory (once until the machine ran out). Under pytest-xdist each worker and
    the controller guard their own children."""
    reaper.guard()


def _heavy_rank(item) -> int:
    path = item.nodeid.split("::", 1)[0]  # relative to the project root (where pyproject.toml is)
    return HEAVY_FIRST.index(path) if path in HEAVY_FIRST else len(HEAVY_FIRST)


def pytest_collection_modifyitems(config, items):
    items.sort(key=_heavy_rank)  # stable: everything else keeps its collection order
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def root() -> Path:
    return ROOT


@pytest.fixture(scope="session")
def tiny_target() -> Path:
    assert (TINY_TARGET / "model.safetensors").is_file(), "the tiny-target fixture is missing"
    return TINY_TARGET


#: A Qwen3-style generation prompt: ``enable_thinking`` true opens a think block, false renders an
#: empty one, unset renders neither (the tiny target's own template otherwise).
THINKING_PROMPT = ("{% if add_generation_prompt %}<|assistant|>\n{% if enable_thinking is defined %}"
                   "{% if enable_thinking %}<think>\n{% else %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
                   "{% endif %}")


@pytest.fixture(scope="session")
def thinking_target(tmp_path_factory) -> Path:
    """A copy of the tiny target whose chat template renders ``enable_thinking`` (reasoning tests)."""
    import json
    import shutil

    dst = tmp_path_factory.mktemp("thinking") / "target"
    shutil.copytree(TINY_TARGET, dst)
    path = dst / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    plain = "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    assert plain in cfg["chat_template"]
    cfg["chat_template"] = cfg["chat_template"].replace(plain, THINKING_PROMPT)
    path.write_text(json.dumps(cfg, indent=2))
    return dst


@pytest.fixture(scope="session")
def edited_target(tmp_path_factory) -> Path:
    """A copy of the tiny target (same weights, same vocabulary) whose chat template a user edited:
    a system line added in front (lineage tests: the stored token ids no longer match it)."""
    import json
    import shutil

    dst = tmp_path_factory.mktemp("template") / "edited"
    shutil.copytree(TINY_TARGET, dst)
    path = dst / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg["chat_template"] = "{{ '<|system|>\\nYou are helpful.\\n' }}" + cfg["chat_template"]
    path.write_text(json.dumps(cfg, indent=2))
    return dst


@pytest.fixture
def config_target(tmp_path):
    """A factory: ``config_target(**changes)`` is a copy of the tiny target whose config.json has
    ``changes`` (its weights untouched), in a folder named with a space and a non-ASCII letter;
    ``folder=`` names another folder (a second copy in one test)."""
    import json
    import shutil

    def make(folder: str = "edited tärget", **changes) -> Path:
        dst = tmp_path / folder
        shutil.copytree(TINY_TARGET, dst)
        cfg = json.loads((dst / "config.json").read_text())
        cfg.update(changes)
        (dst / "config.json").write_text(json.dumps(cfg))
        return dst

    return make


@pytest.fixture
def no_vllm(monkeypatch):
    """``make_llm`` as far as importing vLLM: reaching it fails the test (the refusal must come first)."""
    import eaglenest.engine

    def reached(*args, **kwargs):
        raise AssertionError("vLLM was reached")

    monkeypatch.setattr(eaglenest.engine, "require", reached)


@pytest.fixture(scope="session")
def openai_server():
    """A context manager: ``with openai_server(model, log_path, *extra_args) as url`` runs vLLM's
    OpenAI-compatible server for ``model`` on a free local port (float32, 512 positions, eager), waits
    up to 240 s for ``/v1/models``, and stops its process group on the way out."""
    import contextlib
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    @contextlib.contextmanager
    def start(model, log_path, *extra: str):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        log = open(log_path, "w")
        proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
             "--port", str(port), "--dtype", "float32", "--max-model-len", "512", "--gpu-memory-utilization", "0.15",
             "--enforce-eager", "--disable-log-stats", *extra],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"})
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.time() + 240
            while True:
                assert proc.poll() is None, open(log_path).read()[-3000:]
                assert time.time() < deadline, "vLLM server did not start in 240 s"
                try:
                    urllib.request.urlopen(url + "/v1/models", timeout=2).read()
                    break
                except OSError:
                    time.sleep(0.5)
            yield url
        finally:
            os.killpg(proc.pid, 15)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()
            log.close()

    return start


@pytest.fixture(scope="session")
def toy_checkpoint(tmp_path_factory, tiny_target) -> Path:
    """A draft checkpoint folder (``checkpoint.json`` + ``draft.safetensors``) for the tiny target:
    untrained (seeded), draft vocab 1024, aux layers (2, 4, 5). Copy it before damaging it."""
    import torch

    from eaglenest.train.checkpoint import save_checkpoint
    from eaglenest.train.config import TrainConfig
    from eaglenest.train.loop import build_draft
    from eaglenest.train.target import load_target_tensors
    from eaglenest.train.vocab import select_vocab

    out = tmp_path_factory.mktemp("toy_checkpoint") / "train"
    vocab = select_vocab(torch.arange(2048, 0, -1).numpy(), 1024)
    model = build_draft(TrainConfig(draft_vocab_size=1024), load_target_tensors(tiny_target), layer_ids=(2, 4, 5),
                        vocab=vocab, seed=0)
    save_checkpoint(out, model, info={"layer_ids": [2, 4, 5], "step": 1, "table_version": 1, "store_uri": "s",
                                      "train_config": {}})
    return out


@pytest.fixture(scope="session")
def toy_export(tmp_path_factory, toy_checkpoint, tiny_target) -> Path:
    """:func:`toy_checkpoint` exported (vLLM format). Copy it before damaging it."""
    from eaglenest.serve.export import export_draft

    return export_draft(toy_checkpoint, tmp_path_factory.mktemp("toy_export") / "draft", target_dir=tiny_target)
