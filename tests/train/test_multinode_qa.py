"""``train launch`` across nodes with a rendezvous that cannot happen: a node that never comes (the
rendezvous times out), an endpoint torch cannot parse or resolve. Each must be one line and exit 2
like the other launch errors (test_multinode.py), not torchrun's traceback or minutes of retries."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from eaglenest.errors import ConfigError
from eaglenest.pipeline import train_cli

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_node_that_never_joins_is_one_line_exit_2(tmp_path):
    """Node 0 of two hosts the rendezvous; node 1 never starts. torchrun's RendezvousTimeoutError
    (after its join timeout, 600 s by default: 3 s here) came out as a traceback, exit 1."""
    script = tmp_path / "noop.py"
    script.write_text("pass\n")
    endpoint = f"127.0.0.1:{_free_port()}"
    opts = train_cli.torchrun_argv(nnodes=2, nproc_per_node=1, node_rank=0, rdzv_endpoint=endpoint,
                                   rdzv_id="qa-never-joins", max_restarts=0, rdzv_timeout_s=3)
    proc = subprocess.run([sys.executable, "-c", train_cli._TORCHRUN, *opts, str(script)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    errors = [x for x in proc.stderr.splitlines() if x.startswith("train: error:")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(errors) == 1 and f"--rdzv-endpoint {endpoint}: not all 2 nodes joined" in errors[0]
    assert "'qa-never-joins'" in errors[0] and "within --rdzv-timeout 3 s" in errors[0]


@pytest.mark.parametrize("endpoint", ["[::1:29400", "::1:29400", "node0:29400:1", "[]:29400"])
def test_endpoint_torch_cannot_parse_is_refused_before_launch(endpoint):
    """torch raised ValueError (a traceback) for '[::1:29400' and retried 'node0:29400' as a host for
    minutes for 'node0:29400:1'."""
    with pytest.raises(ConfigError) as info:
        train_cli.torchrun_argv(nnodes=2, nproc_per_node=1, node_rank=0, rdzv_endpoint=endpoint, rdzv_id="r",
                                max_restarts=0)
    assert str(info.value).startswith("--rdzv-endpoint must be HOST:PORT") and repr(endpoint) in str(info.value)


def test_bracketed_ipv6_endpoint_is_accepted():
    opts = train_cli.torchrun_argv(nnodes=2, nproc_per_node=1, node_rank=0, rdzv_endpoint="[::1]:29400",
                                   rdzv_id="r", max_restarts=0)
    assert "--rdzv-endpoint=[::1]:29400" in opts


def test_unresolvable_rendezvous_host_is_one_line():
    """torch retried a host name that does not resolve for minutes, printing only warnings."""
    with pytest.raises(ConfigError) as info:
        train_cli.check_resolves("nohost.invalid:29400")
    assert str(info.value).startswith("--rdzv-endpoint nohost.invalid:29400: cannot resolve host 'nohost.invalid'")
    train_cli.check_resolves("127.0.0.1:29400")
    train_cli.check_resolves(None)


@pytest.mark.parametrize("seconds", [0, -1, float("nan"), float("inf")])
def test_rdzv_timeout_that_is_no_wait_is_refused(seconds):
    """The rendezvous wait is bounded by --rdzv-timeout (torchrun's join_timeout); it must be a finite
    number of seconds > 0."""
    with pytest.raises(ConfigError) as info:
        train_cli.torchrun_argv(nnodes=2, nproc_per_node=1, node_rank=0, rdzv_endpoint="127.0.0.1:29400",
                                rdzv_id="r", max_restarts=0, rdzv_timeout_s=seconds)
    assert str(info.value) == f"--rdzv-timeout: a number of seconds > 0, got {seconds}"


def test_rdzv_timeout_reaches_torchrun_as_join_and_read_timeouts():
    opts = train_cli.torchrun_argv(nnodes=2, nproc_per_node=1, node_rank=None, rdzv_endpoint="127.0.0.1:29400",
                                   rdzv_id="r", max_restarts=0, rdzv_timeout_s=12.5)
    assert "--rdzv-conf=join_timeout=13,read_timeout=13" in opts
    opts = train_cli.torchrun_argv(nnodes=2, nproc_per_node=1, node_rank=1, rdzv_endpoint="127.0.0.1:29400",
                                   rdzv_id="r", max_restarts=0, rdzv_timeout_s=300)
    assert "--rdzv-conf=is_host=0,join_timeout=300,read_timeout=60" in opts


def test_more_ranks_than_cpus_is_refused_before_torchrun(tmp_path):
    """`train launch --nproc N` with N above the CPUs this node may use started N ranks that fought
    for the cores (and each loaded the target and the data): one line, exit 2, before torchrun."""
    cpus = len(os.sched_getaffinity(0))
    proc = subprocess.run([sys.executable, "-m", "eaglenest.pipeline.train_cli", "launch", "--nproc",
                           str(cpus + 1), f"run.workdir={tmp_path / 'w'}"], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).resolve().parents[2])  # the default recipe
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        f"train: error: --nproc-per-node {cpus + 1}: more ranks than the {cpus} CPU(s) this node may use; "
        f"at most --nproc-per-node {cpus}"]
    assert not (tmp_path / "w").exists()
