"""Signals a CLI meets besides SIGKILL: each one that ends it runs the command's cleanup first.

A CLI-shaped process (a real ``eaglenest.cli.run`` command, no vLLM) whose body holds a ``finally``
that stands for a stage's cleanup (an import's uncommitted new table removed, engines closed).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from eaglenest import launch
from eaglenest.engine import EngineConfig, make_llm

BODY = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from eaglenest.cli import Command, run

    out = Path(sys.argv[1])

    def body(recipe, args):
        (out / "started").write_text("")
        try:
            time.sleep(120)
        finally:
            (out / "cleaned").write_text("")
        return 0

    sys.exit(run("qa", "signals", {"x": Command(body, "sleep", needs_recipe=False)}, ["x"]))
""")


#: What ``nohup`` does: SIGHUP ignored, then the command exec'd (an ignored signal stays ignored across exec).
NOHUP = ["-c", "import os, signal, sys; signal.signal(signal.SIGHUP, signal.SIG_IGN); "
               "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"]


def _started(tmp_path, *, nohup: bool = False) -> subprocess.Popen:
    script = tmp_path / "cli.py"
    script.write_text(BODY)
    # SIGINT as a terminal gives it: a suite started in the background (`.ci/run &` from a script) has it
    # ignored, and an ignored signal stays ignored in every child, so Ctrl-C would never reach the command.
    proc = subprocess.Popen([sys.executable, *(NOHUP if nohup else []), str(script), str(tmp_path)],
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while not (tmp_path / "started").exists():
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, "the command never started"
        time.sleep(0.05)
    return proc


@pytest.mark.parametrize("sig, says", [(signal.SIGHUP, "qa: terminated (SIGHUP)"), (signal.SIGTERM, "qa: terminated")])
def test_a_hangup_unwinds_like_sigterm(tmp_path, sig, says):
    # Before: a closed terminal or ssh session (SIGHUP) ended the CLI at once, its cleanup skipped
    # (an import's half-made table left in the store); SIGTERM already unwound.
    proc = _started(tmp_path)
    proc.send_signal(sig)
    err = proc.communicate(timeout=60)[1]
    assert proc.returncode == -sig  # the parent still sees it ended by that signal
    assert (tmp_path / "cleaned").exists(), err
    assert err.strip().splitlines()[-1] == says and "Traceback" not in err


def test_an_ignored_hangup_stays_ignored(tmp_path):
    """Under ``nohup`` (SIGHUP ignored) the CLI goes on: the guard never takes a signal a caller set."""
    proc = _started(tmp_path, nohup=True)
    proc.send_signal(signal.SIGHUP)
    time.sleep(0.5)
    assert proc.poll() is None and not (tmp_path / "cleaned").exists()
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGTERM and (tmp_path / "cleaned").exists()


PRINTER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from eaglenest.cli import Command, run

    out = Path(sys.argv[1])

    def body(recipe, args):
        if sys.argv[2] == "socket":  # a broken connection of the command's own, not its output
            raise BrokenPipeError(32, "Broken pipe")
        try:
            for i in range(200_000):
                print(f"row {i} " + "x" * 50)
        finally:
            (out / "cleaned").write_text("")
        return 0

    sys.exit(run("qa", "pipe", {"x": Command(body, "print", needs_recipe=False)}, ["x"]))
""")


def test_output_piped_into_head_ends_quietly(tmp_path):
    # Before: `featurestore query ... | head` ended in a BrokenPipeError traceback (exit 1).
    script = tmp_path / "cli.py"
    script.write_text(PRINTER)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path), "print"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    assert proc.stdout.readline().startswith(b"row 0 ")
    proc.stdout.close()  # what `head -1` does once it has its line
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 128 + signal.SIGPIPE  # what a shell reports for `yes | head -1`
    assert err == "" and (tmp_path / "cleaned").exists()


def test_a_broken_pipe_that_is_not_the_output_keeps_its_traceback(tmp_path):
    script = tmp_path / "cli.py"
    script.write_text(PRINTER)
    out = subprocess.run([sys.executable, str(script), str(tmp_path), "socket"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 1 and "Traceback" in out.stderr and "BrokenPipeError" in out.stderr


class SwallowingLLM:
    """A stub of ``vllm.LLM`` (the real one needs 30-60 s here; the slow test below uses it): its start
    is interrupted by ``sig`` where vLLM's own start waits for its engine processes, inside
    ``vllm.utils.network_utils.zmq_socket_ctx``, which catches ``KeyboardInterrupt`` and logs it."""

    sig = signal.SIGINT

    def __init__(self, model, **kwargs):
        try:
            os.kill(os.getpid(), self.sig)
            time.sleep(5)  # the handler runs here
        except KeyboardInterrupt:
            pass  # what vLLM does


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupt_during_an_engine_start_is_not_lost(monkeypatch, tiny_target, sig):
    # Before: make_llm returned an engine as if nothing had happened, and the command went on.
    import vllm

    monkeypatch.setattr(vllm, "LLM", SwallowingLLM)
    monkeypatch.setattr(SwallowingLLM, "sig", sig)
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for s in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(s, signal.SIG_DFL)
        assert launch.unwind_on_sigterm() == [signal.SIGTERM, signal.SIGHUP]
        t0 = time.monotonic()
        with pytest.raises(launch.Terminated if sig == signal.SIGTERM else KeyboardInterrupt) as err:
            make_llm(str(tiny_target), EngineConfig(in_process=False))
        assert time.monotonic() - t0 < 4  # interrupted, not slept through
        assert getattr(err.value, "signum", signal.SIGINT) == sig
        # the handlers are the command's again (a second SIGTERM then ends the process at once)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


def _descendants(root: int) -> set[int]:
    parents = {}
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                parents[int(name)] = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError):
            continue
    out, todo = set(), [root]
    while todo:
        parent = todo.pop()
        kids = {pid for pid, ppid in parents.items() if ppid == parent} - out
        out |= kids
        todo += kids
    return out


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@pytest.mark.slow
@pytest.mark.serial  # the signal lands once vLLM's own start ends: under a loaded suite that took over 120 s
def test_sigterm_while_ingest_starts_its_engine_ends_it(tmp_path, root, tiny_target):
    """The real vLLM of the stub above: SIGTERM once the engine's own processes are starting."""
    # Before: exit 0 after a complete build, the SIGTERM dropped inside vLLM's engine handshake.
    manifest = tmp_path / "m.yaml"
    manifest.write_text(textwrap.dedent(f"""
        name: term
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
    argv = [str(Path(sys.executable).parent / "ingest"), "build", "--manifest", str(manifest),
            f"run.workdir={tmp_path / 'w'}", f"run.target={tiny_target}", "ingest.engine.max_model_len=512",
            "ingest.engine.in_process=false"]
    proc = subprocess.Popen(argv, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    kids: set[int] = set()
    try:
        deadline = time.monotonic() + 300
        while "EngineCore" not in " ".join(map(_cmdline, kids)):
            assert proc.poll() is None and time.monotonic() < deadline, "no engine started"
            time.sleep(0.1)
            kids = _descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)
        err = proc.communicate(timeout=300)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGTERM, err[-2000:]
    # The process guard may add a line after it: it ends what vLLM's own shutdown left (common/reaper.py).
    assert "ingest: terminated" in err.strip().splitlines() and "Traceback" not in err
    assert not (tmp_path / "w" / "ingest" / "stats.json").exists()  # the build did not go on to the end
    deadline = time.monotonic() + 15
    while any(_cmdline(p) for p in kids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not {p: _cmdline(p) for p in kids if _cmdline(p)}


class SlowSwallowingLLM:
    """:class:`SwallowingLLM`, then what vLLM does after its handshake swallowed the interrupt: it waits
    for the engine to load its weights (here 8 s) before ``LLM()`` returns. ``stopped`` stands for
    vLLM's own cleanup of a failed start (``MPClient``'s finalizer ends the engine's processes)."""

    sig = signal.SIGINT
    stopped = False

    def __init__(self, model, **kwargs):
        try:
            try:
                os.kill(os.getpid(), self.sig)
                time.sleep(5)
            except KeyboardInterrupt:
                pass  # vllm.utils.network_utils.zmq_socket_ctx
            time.sleep(8)  # the engine loads its weights
        finally:
            type(self).stopped = True


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupt_during_an_engine_start_ends_the_start_at_once(monkeypatch, tiny_target, sig):
    # Before: the interrupt was raised again only once vLLM's whole start returned (the engine had
    # loaded its weights: minutes for a large target), then the engine was closed.
    import vllm

    monkeypatch.setattr(vllm, "LLM", SlowSwallowingLLM)
    monkeypatch.setattr(SlowSwallowingLLM, "sig", sig)
    monkeypatch.setattr(SlowSwallowingLLM, "stopped", False)
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for s in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(s, signal.SIG_DFL)
        launch.unwind_on_sigterm()
        t0 = time.monotonic()
        with pytest.raises(launch.Terminated if sig == signal.SIGTERM else KeyboardInterrupt) as err:
            make_llm(str(tiny_target), EngineConfig(in_process=False))
        assert time.monotonic() - t0 < 4, "the start went on to its end"
        assert getattr(err.value, "signum", signal.SIGINT) == sig
        assert SlowSwallowingLLM.stopped  # vLLM's own cleanup of the half-started engine ran
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


def test_ctrl_c_ends_the_cli_by_sigint_after_its_cleanup(tmp_path):
    # Before: exit 130 after the cleanup. A shell running the command in a script or a loop (`for k in
    # 2 3 4; do evaluate al ...; done`) takes an exit, unlike a death by SIGINT, as "the command
    # handled Ctrl-C itself" and goes on: every later command of the loop ran in full.
    proc = _started(tmp_path)
    proc.send_signal(signal.SIGINT)
    err = proc.communicate(timeout=60)[1]
    assert proc.returncode == -signal.SIGINT, err[-2000:]
    assert (tmp_path / "cleaned").exists()
    assert err.strip().splitlines()[-1] == "qa: interrupted" and "Traceback" not in err
    # What a user sees: Ctrl-C (SIGINT to the terminal's whole process group) stops the loop.
    (tmp_path / "cli.py").write_text(BODY)
    loop = f'for i in 1 2; do "{sys.executable}" "{tmp_path / "cli.py"}" "{tmp_path}"; echo "went on $i"; done'
    (tmp_path / "started").unlink()
    shell = subprocess.Popen(["bash", "-c", loop], start_new_session=True, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "started").exists():
            assert shell.poll() is None and time.monotonic() < deadline, shell.communicate()[1]
            time.sleep(0.05)
        os.killpg(shell.pid, signal.SIGINT)
        out, err = shell.communicate(timeout=60)
    finally:
        if shell.poll() is None:  # the loop went on: end it and the command it started
            os.killpg(shell.pid, signal.SIGKILL)
            shell.wait()
    assert "went on" not in out and shell.returncode == -signal.SIGINT, (out, err[-2000:])
