"""SIGKILL of a CLI leaves no engine or helper process behind (issue #10, item 8).

The guard (common/reaper.py) is started by ``eaglenest.launch.execute``. A fast part without vLLM: a
CLI-like process (a real ``run`` command) with fork children, a fork grandchild made from a thread,
spawned children and their children, SIGKILLed or exiting normally. A slow part with real vLLM:
``ingest build`` SIGKILLed once its engine core has started its worker (CLI -> EngineCore ->
Worker, all spawned), ``featurestore capture`` as soon as its engine core is spawned (both with
``engine.in_process=false``: vLLM's own processes, as on CUDA; an engine in the CLI's process dies
with it), and ``serve
up``, whose vLLM server leads a session of its own (only the watchdog's tree snapshots find it),
once the server has spawned its engine core. One engine start per CLI, each killed while it starts.
Only the CLI's pid is signalled, never its group: everything else must go by itself.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pyarrow as pa
import pytest

BIN = Path(sys.executable).parent
#: The watchdog records descendants every reaper.POLL_S (0.25 s); this is several snapshots.
SETTLE_S = 1.5


def _stat(pid: int):
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    return int(fields[1]), int(fields[19]), fields[0]


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _descendants(root: int) -> dict[int, int]:
    """pid -> start time of every live process below ``root``."""
    table = {int(n): st for n in os.listdir("/proc") if n.isdigit() and (st := _stat(int(n))) and st[2] != b"Z"}
    out, todo = {}, [root]
    while todo:
        parent = todo.pop()
        for pid, (ppid, start, _) in table.items():
            if ppid == parent and pid not in out:
                out[pid] = start
                todo.append(pid)
    return out


def _alive(pid: int, start: int) -> bool:
    st = _stat(pid)
    return st is not None and st[1] == start and st[2] != b"Z"


def _watchdogs(procs: dict[int, int]) -> dict[int, int]:
    return {p: s for p, s in procs.items() if "reaper" in _cmdline(p)}


def _wait_gone(procs: dict[int, int], timeout_s: float = 15.0) -> dict[int, str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        left = {p: _cmdline(p) for p, s in procs.items() if _alive(p, s)}
        if not left:
            return {}
        time.sleep(0.1)
    return left


def _sweep(procs: dict[int, int]) -> None:
    """Test hygiene after a failure: SIGKILL what is left of the recorded processes and their children."""
    live = {p: s for p, s in procs.items() if _alive(p, s)}
    for root in list(live):
        live.update(_descendants(root))
    for pid, start in live.items():
        if _alive(pid, start):
            os.kill(pid, signal.SIGKILL)


def _kill_cli(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGKILL)  # the CLI only: not its process group, not its session
    proc.wait(timeout=30)


# -- without vLLM ---------------------------------------------------------------------------------

FAKE_CLI = textwrap.dedent("""
    import os, subprocess, sys, threading, time
    from eaglenest.cli import Command, run

    SLEEP = [sys.executable, "-c", "import time; time.sleep(600)"]

    def go(recipe, args):
        if os.fork() == 0:  # a fork child, which forks a grandchild from a thread that then ends
            def fork_in_thread():
                if os.fork() == 0:
                    time.sleep(600)
                    os._exit(0)
            t = threading.Thread(target=fork_in_thread)
            t.start()
            t.join()
            time.sleep(600)
            os._exit(0)
        # a spawned child with a spawned child of its own, and a spawned child in its own session
        subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                          "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
                          "time.sleep(600)"])
        subprocess.Popen(SLEEP, start_new_session=True)
        print("ready", flush=True)
        if args.mode == "exit":
            time.sleep(float(os.environ["FAKE_CLI_SETTLE_S"]))
            return 0
        time.sleep(600)

    run("fake", "a CLI with children", {"go": Command(go, "start children", needs_recipe=False,
                                                     args=[(("--mode",), dict(default="kill"))])})
""")


def _start_fake(tmp_path, mode: str) -> tuple[subprocess.Popen, dict[int, int]]:
    script = tmp_path / "fake_cli.py"
    script.write_text(FAKE_CLI)
    # Not a session leader (as under a shell): only the watchdog's tree snapshots can find orphans.
    proc = subprocess.Popen([sys.executable, str(script), "go", "--mode", mode], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "FAKE_CLI_SETTLE_S": "3"})
    assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # fork child + grandchild, 2 spawned + 1 grandchild (+ the watchdog)
        kids = _descendants(proc.pid)
        if len(kids) - len(_watchdogs(kids)) >= 5:
            break
        time.sleep(0.05)
    assert len(kids) - len(_watchdogs(kids)) >= 5, {p: _cmdline(p) for p in kids}
    return proc, kids


def test_sigkill_of_a_cli_ends_fork_spawn_and_grandchildren(tmp_path):
    proc, kids = _start_fake(tmp_path, "kill")
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # same group
    try:
        time.sleep(SETTLE_S)
        assert all(_alive(p, s) for p, s in kids.items()), "a thread's exit must not end its fork child"
        _kill_cli(proc)
        left = _wait_gone(kids)
        assert not left, f"left behind after SIGKILL of the CLI: {left}"
        assert "process(es) behind" in proc.stderr.read()
        assert bystander.poll() is None, "the watchdog ended a process that is not the CLI's descendant"
    finally:
        if proc.poll() is None:
            proc.kill()
        _sweep(kids)
        bystander.kill()
        bystander.wait()


def test_normal_exit_ends_leftovers_and_the_watchdog(tmp_path):
    proc, kids = _start_fake(tmp_path, "exit")
    try:
        assert proc.wait(timeout=30) == 0
        left = _wait_gone(kids)
        assert not left, f"left behind after the CLI exited: {left}"
    finally:
        _sweep(kids)


# -- with vLLM: one engine start per CLI, each killed while it starts ----------------------------


#: The command line of a multiprocessing-spawned process (vLLM's EngineCore before it renames itself).
SPAWNED = "multiprocessing.spawn import spawn_main"


def _kill_when_engine_up(argv, *, cwd, needles=(SPAWNED,), timeout_s: float = 300.0):
    """Start a CLI in its own session, SIGKILL it once processes matching ``needles`` exist below it,
    return its descendants as they were just before the kill."""
    proc = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    kids = {}
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            kids = _descendants(proc.pid)
            names = " ".join(_cmdline(p) for p in kids)
            if all(n in names for n in needles):
                break
            assert proc.poll() is None, f"exited with {proc.returncode}: {proc.stderr.read()[-3000:]}"
            time.sleep(0.1)
        else:
            raise AssertionError(f"no {needles} below the CLI in {timeout_s:.0f} s")
        time.sleep(SETTLE_S)
        kids = _descendants(proc.pid)
        sids = {p: os.getsid(p) for p in kids if _alive(p, kids[p])}
        assert proc.poll() is None, "the CLI ended before the kill"
    finally:
        if proc.poll() is None:
            _kill_cli(proc)
        if sys.exc_info()[0] is not None:
            _sweep(kids)
    return proc, kids, sids


def _engine_args(tiny_target, work):
    return [f"run.workdir={work}", f"run.target={tiny_target}"]


@pytest.mark.slow
def test_sigkill_of_ingest_build_leaves_no_engine(tmp_path, root, tiny_target):
    manifest = tmp_path / "m.yaml"
    manifest.write_text(textwrap.dedent(f"""
        name: kill
        licence: CC0-1.0
        generation:
          max_tokens: 8
        domains:
          arithmetic:
            cap_prompts: 8
            held_out_count: 2
            sources:
              - path: {root}/recipes/data/arithmetic.jsonl
                system_field: system
                provenance: generated by eaglenest.tinytarget
    """))
    argv = [str(BIN / "ingest"), "build", "--manifest", str(manifest), *_engine_args(tiny_target, tmp_path / "w"),
            "ingest.engine.max_model_len=512", "ingest.engine.in_process=false"]
    proc, kids, _ = _kill_when_engine_up(argv, cwd=root, needles=("VLLM::EngineCore", "VLLM::Worker"))
    left = _wait_gone(kids)
    _sweep(kids)
    assert not left, f"left behind after SIGKILL of `ingest build`: {left}"


@pytest.mark.slow
def test_sigkill_of_featurestore_capture_leaves_no_engine(tmp_path, root, tiny_target):
    from eaglenest.featurestore import schema as S
    from eaglenest.featurestore.table import store

    work = tmp_path / "w"
    rows = [{"sample_id": f"s-{i:03d}", "domain": "d", "source": "synthetic", "split": "train", "mode": "raw",
             "messages_json": "[]", "prompt_token_ids": list(range(3, 20 + i)),
             "response_token_ids": list(range(30, 40)), "finish_reason": "length", "gen_params_id": "g0"}
            for i in range(4)]
    store.append(str(work / "store"), store.PROMPTS, pa.Table.from_pylist(rows, schema=S.PROMPTS_SCHEMA))
    argv = [str(BIN / "featurestore"), "capture", *_engine_args(tiny_target, work),
            "featurestore.engine.max_model_len=512", "featurestore.engine.in_process=false"]
    proc, kids, _ = _kill_when_engine_up(argv, cwd=root)
    left = _wait_gone(kids)
    _sweep(kids)
    assert not left, f"left behind after SIGKILL of `featurestore capture`: {left}"


@pytest.mark.slow
def test_sigkill_of_serve_up_leaves_no_server(tmp_path, root, tiny_target):
    """The vLLM server leads its own session (Server.start): only the tree snapshots reach it."""
    argv = [str(BIN / "serve"), "up", "--no-spec", *_engine_args(tiny_target, tmp_path / "w"),
            "serve.max_model_len=512", "serve.port=0"]
    proc, kids, sids = _kill_when_engine_up(argv, cwd=root, needles=("vllm.entrypoints.openai.api_server", SPAWNED))
    assert any(sid != proc.pid for sid in sids.values()), "the server should lead a session of its own"
    left = _wait_gone(kids)
    _sweep(kids)
    assert not left, f"left behind after SIGKILL of `serve up`: {left}"
