"""Multi-node FSDP2 on loopback: two ``train launch --nnodes 2`` agents (torchrun, c10d rendezvous).

Two agents as separate process trees, as on two hosts (only the filesystem is shared, which the
multi-node setup requires anyway): their 2-rank run matches one plain process; SIGKILL of a whole
node makes the other exit non-zero within seconds instead of hanging; restarting both agents with
``train.state.resume=auto`` continues bit for bit. The launch options' errors are one line, exit 2.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eaglenest.pipeline.train_cli import main, rdzv_id, torchrun_argv
from eaglenest.train.config import StateConfig, TrainConfig
from eaglenest.train.loop import train

RECIPE = str(Path(__file__).resolve().parents[2] / "recipes" / "toy.yaml")
# As test_distributed.TRAJ (uneven shards: global batches of 3, 3, 2 rows), with a state every 3 steps;
# train.state.every_steps does not change the trajectory, so one config serves the match and the resume.
CFG = dict(draft_vocab_size=512, ttt_steps=3, pack_tokens=96, batch_rows=3, warmup_steps=5, lr=0.002,
           num_epochs=7, num_steps=20, log_every_steps=1, num_threads=1, sliding_window="auto")
STATE_EVERY_STEPS = 3
#: Seconds the surviving node may take to notice a dead peer and exit (measured: 1-3 s).
FAIL_WITHIN_S = 90


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metrics(workdir: Path) -> list[dict]:
    return [json.loads(x) for x in (workdir / "train" / "metrics.jsonl").read_text().splitlines()]


def start_nodes(workdir: Path, port: int, store, target, *extra: str) -> list[subprocess.Popen]:
    """Node 0 and node 1: one ``train launch`` agent each, in its own session (its process group
    is the node: the CLI and torchrun; torchrun's worker and the reaper have their own sessions)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "eaglenest.pipeline.train_cli", "launch", "--nnodes", "2",
               "--nproc-per-node", "1", "--node-rank", str(node), "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--recipe", RECIPE, f"run.workdir={workdir}", f"run.target={target}", f"run.store={store[0]}",
               *(f"train.{k}={v}" for k, v in CFG.items()),
               f"train.state.every_steps={STATE_EVERY_STEPS}", *extra]
        log = open(f"{workdir}.node{node}.log", "a")
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        log.close()
    return procs


def tail(workdir: Path) -> str:
    return "\n".join(Path(f"{workdir}.node{n}.log").read_text()[-3000:] for n in (0, 1))


def wait_all(procs, workdir: Path, timeout: float = 300) -> None:
    try:
        for p in procs:
            assert p.wait(timeout=timeout) == 0, tail(workdir)
    finally:
        for p in procs:
            p.kill()
            p.wait()


def descendants(pid: int) -> set[tuple[int, str]]:
    """``pid`` and its descendants as (pid, start time) pairs, from /proc."""
    table = {}
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError, ValueError):
            continue
        table[int(name)] = (int(fields[1]), fields[19])
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        if p in table:
            out.add((p, table[p][1]))
            todo += [c for c, (ppid, _) in table.items() if ppid == p]
    return out


def alive(procs: set[tuple[int, str]]) -> set[tuple[int, str]]:
    out = set()
    for pid, start in procs:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[19] == start and fields[0] != "Z":
            out.add((pid, start))
    return out


def kill_node_after(procs, victim: int, latest: Path, *, after_step: int, workdir: Path) -> int:
    """SIGKILL node ``victim``'s process group once a state past ``after_step`` is saved; the other
    node must then exit non-zero within FAIL_WITHIN_S and the victim's whole tree must be gone."""
    deadline, polls, tree = time.monotonic() + 300, 0, set()
    while time.monotonic() < deadline:
        if latest.is_file() and json.loads(latest.read_text())["step"] > after_step:
            break
        assert all(p.poll() is None for p in procs), "a node ended before the kill:\n" + tail(workdir)
        if polls % 20 == 0:  # the victim's tree, taken ahead: scanning /proc takes longer than a step
            tree = descendants(procs[victim].pid)
        polls += 1
        time.sleep(0.01)
    assert len(tree) >= 3, tree  # the CLI, torchrun's agent, the rank (and their helpers)
    os.killpg(procs[victim].pid, signal.SIGKILL)
    t0 = time.monotonic()
    try:
        rc = procs[1 - victim].wait(timeout=FAIL_WITHIN_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"node {1 - victim} still runs {FAIL_WITHIN_S} s after node {victim} died:\n" + tail(workdir))
    failed_after = time.monotonic() - t0
    assert rc != 0, tail(workdir)
    while alive(tree) and time.monotonic() < t0 + 30:  # the rank and helpers of the killed node end too
        time.sleep(0.1)
    assert not alive(tree), alive(tree)
    for p in procs:
        p.kill()
        p.wait()
    step = json.loads(latest.read_text())["step"]
    print(f"node {victim} killed after step {step}; node {1 - victim} exited rc={rc} after {failed_after:.1f} s")
    return step


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, feature_store, tiny_target):
    work = tmp_path_factory.mktemp("one")
    train(TrainConfig(**CFG, state=StateConfig(every_steps=STATE_EVERY_STEPS)), store_uri=feature_store[0], workdir=str(work), target_dir=str(tiny_target), seed=0)
    return work


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory, feature_store, tiny_target):
    work = tmp_path_factory.mktemp("two") / "run"
    wait_all(start_nodes(work, free_port(), feature_store, tiny_target), work)
    return work


@pytest.mark.slow
def test_two_nodes_match_one_process(one_process, two_nodes):
    a, b = metrics(one_process), metrics(two_nodes)
    assert [m["step"] for m in a] == [m["step"] for m in b] == list(range(1, 21))
    assert a[-1]["loss"] < 0.8 * a[0]["loss"]  # it trains
    for x, y in zip(a, b, strict=True):
        # fp32 sums split over ranks differ in rounding only: relative 1e-4 over 20 steps.
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-4, abs=1e-6), (x["step"], x["loss"], y["loss"])
        assert y["step_count"] == x["step_count"] and y["tokens"] == x["tokens"]
    prov = json.loads((two_nodes / "train" / "provenance.json").read_text())
    assert prov["world_size"] == 2 and prov["num_nodes"] == 2


@pytest.mark.slow
def test_node_killed_then_restart_resumes_exactly(tmp_path, two_nodes, feature_store, tiny_target):
    work, port = tmp_path / "run", free_port()
    latest = work / "train" / "state" / "latest.json"
    # Node 1 dies: node 0's rank sees its gloo peer close the connection.
    first = kill_node_after(start_nodes(work, port, feature_store, tiny_target), 1, latest,
                            after_step=0, workdir=work)
    # Restarted on the same endpoint, it resumes; then node 0 dies, with the rendezvous store it hosts.
    second = kill_node_after(start_nodes(work, port, feature_store, tiny_target, "train.state.resume=auto"), 0,
                             latest, after_step=first, workdir=work)
    assert 3 <= first < second < 20
    wait_all(start_nodes(work, port, feature_store, tiny_target, "train.state.resume=auto"), work)
    log = Path(f"{work}.node0.log").read_text() + Path(f"{work}.node1.log").read_text()
    assert sorted(int(n) for n in re.findall(r"resumed from \S+ at step (\d+)", log)) == [first, second]
    a, b = metrics(work), metrics(two_nodes)
    assert [m["step"] for m in a] == list(range(1, 21))
    assert [m["loss"] for m in a] == [m["loss"] for m in b]  # bit for bit
    assert [m["step_acc"] for m in a] == [m["step_acc"] for m in b]
    from safetensors.torch import load_file

    wa, wb = load_file(work / "train" / "draft.safetensors"), load_file(two_nodes / "train" / "draft.safetensors")
    assert wa.keys() == wb.keys() and all((wa[k] == wb[k]).all() for k in wa)


def test_launch_builds_torchrun_rendezvous_options():
    one = torchrun_argv(nnodes=1, nproc_per_node=2, node_rank=None, rdzv_endpoint=None, rdzv_id="x",
                        max_restarts=0)
    assert one == ["--standalone", "--nproc-per-node=2", "--max-restarts=0"]
    two = torchrun_argv(nnodes=2, nproc_per_node=1, node_rank=1, rdzv_endpoint="10.0.0.1:29400",
                        rdzv_id="run-a", max_restarts=3)
    assert "--rdzv-backend=c10d" in two and "--rdzv-endpoint=10.0.0.1:29400" in two and "--nnodes=2" in two
    assert "--rdzv-id=run-a" in two and "--max-restarts=3" in two and "--rdzv-conf=is_host=0,join_timeout=600,read_timeout=60" in two
    assert "--standalone" not in two
    # Without --node-rank torchrun decides who hosts the store; the default id is the run's.
    assert not any("is_host" in x for x in torchrun_argv(nnodes=2, nproc_per_node=1, node_rank=None,
                                                          rdzv_endpoint="h:1", rdzv_id="r", max_restarts=0))
    assert rdzv_id("runs/a") == rdzv_id("runs/a/") != rdzv_id("runs/b")


@pytest.mark.parametrize("options, says", [
    (["--nnodes", "2"], "--rdzv-endpoint"),
    (["--nnodes", "2", "--rdzv-endpoint", "node0"], "HOST:PORT"),
    (["--nnodes", "2", "--rdzv-endpoint", "node0:http"], "HOST:PORT"),
    (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "node0:29400"], "--node-rank"),
    (["--nnodes", "0"], "--nnodes (0)"),  # the line names both options: the value says which was bad
    (["--nproc-per-node", "0"], "--nproc-per-node (0)"),
    (["--max-restarts", "-1"], "--max-restarts"),
])
def test_launch_option_errors_exit_2(capsys, options, says):
    assert main(["launch", *options, "--recipe", RECIPE]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1, err


SHARED_CHECK = """
import sys
from eaglenest.errors import ConfigError
from eaglenest.train.dist import DistState

d = DistState.from_env()
d.check_shared_dir(sys.argv[1] + "/shared")  # one directory for both ranks: passes
try:
    d.check_shared_dir(sys.argv[1] + f"/rank{d.rank}")  # as if each node had its own disk
except ConfigError as exc:
    print(f"rank {d.rank}: {exc}")
d.close()
"""


@pytest.mark.slow
def test_a_workdir_not_shared_by_all_ranks_is_refused(tmp_path):
    script = tmp_path / "check.py"
    script.write_text(SHARED_CHECK)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(script), str(tmp_path)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):  # every rank raises the same one-line error, none waits for the others
        assert f"rank {rank}: {tmp_path}/rank{rank} is not shared by all nodes: 1 of 2 ranks" in proc.stdout
    assert not list(tmp_path.glob("*/.shared-probe-*"))  # the probes are removed
