"""QA pass 5 on the bench scripts: ``--help`` stays fast. Every script's ``--help`` runs without importing
a heavy library (torch, vLLM, Lance, pyarrow, transformers, Dask, DuckDB, pandas): those belong inside
the function that measures with them, as in the stages (docs/design.md), so a reader asking a bench
what it does waits for argparse, not for torch.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import pytest
from bench_helpers import load_bench  # tests/bench on sys.path via conftest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
HELPERS = {"arms.py", "ingest_common.py"}  # loaded by the benches, not run
SCRIPTS = sorted(p.name for p in BENCH.glob("*.py") if p.name not in HELPERS)
HEAVY = ("torch", "vllm", "lance", "lancedb", "pyarrow", "transformers", "dask", "duckdb", "pandas")

#: Runs each script's ``--help`` in one fresh interpreter, one after the other, and prints, per script, the
#: heavy modules loaded by then that no earlier script had loaded (one interpreter: a second's worth, not 24).
PROBE = """
import contextlib, io, json, runpy, sys
heavy, seen, out = {heavy!r}, set(), {{}}
sys.path.insert(0, {bench!r})
for name in {scripts!r}:
    sys.argv = [name, "--help"]
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            runpy.run_path({bench!r} + "/" + name, run_name="__main__")
    except SystemExit as exc:
        code = exc.code
    else:
        code = None
    loaded = {{m for m in heavy if m in sys.modules}} - seen
    seen |= loaded
    out[name] = {{"code": code, "heavy": sorted(loaded)}}
print(json.dumps(out))
"""


def _help_imports(scripts: list[str]) -> dict[str, dict]:
    code = PROBE.format(heavy=HEAVY, bench=str(BENCH), scripts=scripts)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_bench_help_imports_no_heavy_library():
    assert len(SCRIPTS) >= 20 and "featurestore_write.py" in SCRIPTS
    found = _help_imports(SCRIPTS)
    assert sorted(found) == SCRIPTS
    assert all(r["code"] == 0 for r in found.values()), {n: r["code"] for n, r in found.items() if r["code"] != 0}
    heavy = {name: r["heavy"] for name, r in found.items() if r["heavy"]}
    assert not heavy, f"--help imports heavy libraries (import them inside the function that uses them): {heavy}"


def test_the_probe_sees_a_heavy_import_at_module_top(tmp_path, monkeypatch):
    """The check above can fail: a script that imports pyarrow at its top is named with it."""
    script = tmp_path / "heavy_bench.py"
    script.write_text("import argparse\nimport pyarrow\n\nargparse.ArgumentParser().parse_args()\n")
    monkeypatch.setattr(sys.modules[__name__], "BENCH", tmp_path)
    assert _help_imports(["heavy_bench.py"]) == {"heavy_bench.py": {"code": 0, "heavy": ["pyarrow"]}}


# --- the ingest benches remove their scratch stores however they end ---------------------------------

def load(name: str):
    return load_bench(name, "_bench_qa5")


def _scratch(folder: Path) -> list[str]:
    """The benches' scratch folders in ``folder`` (torch may put its compile cache there too)."""
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("bench-ingest-"))


class FakeEngine:
    """Stands in for the vLLM engine: the Ctrl-C comes before anything would reach it."""

    llm_engine = types.SimpleNamespace(vllm_config=types.SimpleNamespace(
        scheduler_config=types.SimpleNamespace(max_num_seqs=4)))

    def reset_prefix_cache(self):
        pass


@pytest.fixture
def interrupted_ingest(monkeypatch, tmp_path):
    """Ctrl-C during the benches' warm-up ``ingest.build`` (a minute into a run, on a real engine); the
    scratch stores are made under ``tmp_path``; returns the engines closed."""
    import eaglenest.engine as engine
    import eaglenest.ingest.build as ingest_build

    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt

    closed: list = []
    monkeypatch.setattr(engine, "make_llm", lambda *a, **k: FakeEngine())
    monkeypatch.setattr(engine, "close_llm", closed.append)
    monkeypatch.setattr(ingest_build, "build", ctrl_c)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["bench"])
    gen = types.SimpleNamespace(temperature=0.0, max_tokens=8, seed=0)
    return closed, (types.SimpleNamespace(generation=gen), [])


def test_ingest_regen_removes_its_scratch_stores_on_ctrl_c(interrupted_ingest, monkeypatch, tmp_path):
    # The scratch stores were removed only after the last round: Ctrl-C, SIGTERM or a failed round left them.
    closed, prompts = interrupted_ingest
    bench = load("ingest_regen.py")
    monkeypatch.setattr(bench.C, "load_prompts", lambda a: prompts)
    with pytest.raises(KeyboardInterrupt):
        bench.main()
    assert _scratch(tmp_path) == [] and len(closed) == 1


def test_ingest_capture_removes_its_scratch_stores_on_ctrl_c(interrupted_ingest, monkeypatch, tmp_path):
    import eaglenest.featurestore.capture.build as fbuild
    import eaglenest.featurestore.capture.engine as capture_engine

    closed, prompts = interrupted_ingest
    capturers: list = []

    class FakeCapturer:
        def __init__(self, *args, **kwargs):
            self.llm, self.closed = FakeEngine(), False
            capturers.append(self)

        def close(self):
            self.closed = True

    bench = load("ingest_capture.py")
    monkeypatch.setattr(bench.C, "load_prompts", lambda a: prompts)
    monkeypatch.setattr(fbuild, "target_facts", lambda target: {"num_layers": 8})
    monkeypatch.setattr(fbuild, "Capturer", fbuild.Capturer)  # the bench replaces it: put back after
    monkeypatch.setattr(capture_engine, "Capturer", FakeCapturer)
    with pytest.raises(KeyboardInterrupt):
        bench.main()
    assert _scratch(tmp_path) == [] and len(closed) == 1
    assert [c.closed for c in capturers] == [True]


def test_ingest_dask_removes_its_scratch_stores_on_ctrl_c(interrupted_ingest, monkeypatch, tmp_path):
    import eaglenest.ingest.shard as shard

    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt

    _closed, prompts = interrupted_ingest
    bench = load("ingest_dask.py")
    monkeypatch.setattr(bench.C, "load_prompts", lambda a: prompts)
    monkeypatch.setattr(shard, "make_backend", ctrl_c)  # while the in-process engine starts
    with pytest.raises(KeyboardInterrupt):
        bench.main()
    assert _scratch(tmp_path) == []


# --- stream_transport: arms alternated as it says, no socket folder left per round ------------------

def test_stream_transport_alternates_its_arms_over_rounds(monkeypatch, capsys):
    # It said "alternate, so drift in the machine's load hits both alike" and ran unix first every round.
    bench = load("stream_transport.py")
    calls: list[str] = []

    def arm(name: str, seconds: float):
        def run(args) -> float:
            calls.append(name)
            return seconds
        return run

    monkeypatch.setattr(bench, "run_unix", arm("unix", 1.0))
    monkeypatch.setattr(bench, "run_gloo", arm("gloo", 2.0))
    bench.main(["--frames", "2", "--tokens", "1", "--layers", "1", "--hidden", "1", "--rounds", "3"])
    assert calls == ["unix", "gloo", "gloo", "unix", "unix", "gloo"]
    assert "gloo / unix: median 0.50 [0.50, 0.50]" in capsys.readouterr().out  # gloo took twice as long


def test_stream_transport_removes_the_socket_folder_of_each_round(monkeypatch, tmp_path):
    # Every unix round left an eaglenest-bench-* folder in /tmp (mkdtemp, never removed).
    import eaglenest.featurestore.stream.local as local

    bench = load("stream_transport.py")
    paths: list[str] = []

    class FakeChannel:
        def __init__(self, path, **kwargs):
            paths.append(path)

        def next(self):
            return None

        def close(self):
            pass

    class FakeProcess:
        def __init__(self, **kwargs):
            pass

        def start(self):
            pass

        def join(self, timeout):
            pass

    monkeypatch.setattr(local, "Channel", FakeChannel)
    monkeypatch.setattr(bench.mp, "get_context", lambda kind: types.SimpleNamespace(Process=FakeProcess))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    bench.run_unix(types.SimpleNamespace(frames=2, depth=1))
    assert len(paths) == 1 and Path(paths[0]).parent.parent == tmp_path
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("eaglenest-bench-")) == []


# --- featurestore_query_memory: a SIGTERM removes its scratch tables ----------------------------------

def test_query_memory_sigterm_removes_its_scratch_tables(tmp_path):
    # A SIGTERM (kill, a job's time limit) ended it before the TemporaryDirectory's cleanup: the tables stayed.
    import os
    import signal
    import time

    argv = [sys.executable, str(BENCH / "featurestore_query_memory.py"), "--sizes", "4,8", "--row-mib", "1",
            "--rounds", "1000"]
    proc = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, "TMPDIR": str(tmp_path)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob("eaglenest-bench-query-*/store*")):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-2000:]
            time.sleep(0.2)
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert sorted(p.name for p in tmp_path.glob("eaglenest-bench-query-*")) == [], "the scratch tables were left"
    assert proc.returncode == -signal.SIGTERM, err[-2000:]
    assert err.strip().splitlines()[-1:] == ["featurestore_query_memory.py: terminated"]
