"""Fifth QA pass of ``ingest``: counts that become processes or threads, distributed's IO loop that does not
start on a loaded machine, a target whose weights are not the store's. Recipes, pure functions and
``ingest build`` through its CLI; no vLLM engine, no network beyond loopback."""

from __future__ import annotations

import json
import shutil
import socket
import threading
import types

import pyarrow as pa
import pytest

from eaglenest.errors import ConfigError, EaglenestError
from eaglenest.featurestore import schema as S
from eaglenest.featurestore.capture import policy
from eaglenest.featurestore.table import store
from eaglenest.ingest import commands, dask_executor
from eaglenest.ingest.cli import main
from eaglenest.ingest.config import IngestConfig


def _build(tmp_path, capsys, *overrides) -> tuple[int, list[str]]:
    rc = main(["build", "--recipe", "recipes/toy.yaml", f"run.workdir={tmp_path / 'work'}", *overrides])
    return rc, capsys.readouterr().err.strip().splitlines()


# -- counts that become processes or threads: bounded, naming the key ---------------------------------------
@pytest.mark.parametrize("key, value", [("dask_workers", 10**9), ("dask_workers", 257),
                                        ("in_flight_per_endpoint", 99999999999), ("in_flight_per_endpoint", 1025)])
def test_a_huge_process_or_thread_count_is_refused_naming_the_key(key, value):
    # Both passed: dask_workers=1e9 started a LocalCluster of a billion worker processes, and
    # in_flight_per_endpoint=1e11 a thread per queued request (2 x that many were queued).
    with pytest.raises(ConfigError, match=rf"^ingest\.{key}: {value} is more than \d+ "):
        IngestConfig(**{key: value})


@pytest.mark.parametrize("key, value", [("dask_workers", 0), ("dask_workers", -3), ("in_flight_per_endpoint", 0)])
def test_a_zero_or_negative_count_is_refused_naming_the_key(key, value):
    with pytest.raises(ConfigError, match=rf"^ingest\.{key}: {value} must be at least 1$"):
        IngestConfig(**{key: value})


def test_the_bounds_themselves_are_accepted():
    cfg = IngestConfig(dask_workers=256, in_flight_per_endpoint=1024)
    assert (cfg.dask_workers, cfg.in_flight_per_endpoint) == (256, 1024)


def test_a_huge_worker_count_on_the_command_line_is_one_line_and_exit_2(tmp_path, capsys):
    rc, err = _build(tmp_path, capsys, "ingest.executor=dask", "ingest.dask_workers=1000000", "--dry-run")
    assert rc == 2
    assert err == ["ingest: error: ingest.dask_workers: 1000000 is more than 256 (each is a worker process on "
                   "this machine)"]


# -- distributed's IO loop that does not start in its 10 s (a loaded machine) --------------------------------
@pytest.fixture
def loop_never_starts(monkeypatch):
    """distributed's LoopRunner as on a machine too loaded to start its IO-loop thread in time: the thread
    never runs the loop, and the wait for it (10 s there) is cut to a blink. The real LoopRunner code runs."""
    import distributed.utils

    class Blink(threading.Event):
        def wait(self, timeout=None):
            return super().wait(0.01)

    monkeypatch.setattr(distributed.utils, "threading", types.SimpleNamespace(**{**vars(threading), "Event": Blink}))
    monkeypatch.setattr(distributed.utils, "asyncio_run", lambda main, loop_factory=None: main.close())


@pytest.fixture
def fake_scheduler_port():
    """A loopback port that answers like a scheduler's first byte (connect's handshake check passes)."""
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve():
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            with conn:
                conn.sendall(b"\0")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join()
    server.close()


def test_an_io_loop_that_does_not_start_is_one_line_naming_the_scheduler(tmp_path, capsys, tiny_target,
                                                                         loop_never_starts, fake_scheduler_port):
    # distributed's `assert loop is not None` reached the user as an AssertionError traceback.
    addr = f"tcp://127.0.0.1:{fake_scheduler_port}"
    rc, err = _build(tmp_path, capsys, f"run.target={tiny_target}", "ingest.executor=dask",
                     f"ingest.dask_scheduler={addr}")
    assert rc == 2
    assert len(err) == 1 and "Traceback" not in err[0]
    assert err[0].startswith(f"ingest: error: ingest.dask_scheduler: cannot join the Dask scheduler at {addr}: "
                             "distributed's IO loop did not start within 10 s")
    assert not (tmp_path / "work").exists()


def test_an_io_loop_that_does_not_start_a_local_cluster_is_one_line(loop_never_starts):
    with pytest.raises(EaglenestError, match=r"^ingest\.executor: cannot start a Dask LocalCluster: distributed's "
                                             r"IO loop did not start within 10 s"):
        dask_executor.client_for(IngestConfig(executor="dask", dask_workers=1))


def test_another_assertion_inside_distributed_keeps_its_traceback(monkeypatch, fake_scheduler_port):
    # Only the loop-start timeout is a user-facing line: any other assert is a bug and stays one.
    import distributed

    def broken(*args, **kwargs):
        raise AssertionError("an internal invariant")

    monkeypatch.setattr(distributed, "Client", broken)
    with pytest.raises(AssertionError, match="an internal invariant"):
        dask_executor.connect(f"tcp://127.0.0.1:{fake_scheduler_port}")


# -- a target whose weights are not those that generated the stored responses: refused before any work ------
def _reweighted(src, dst):
    """A copy of ``src`` whose weights differ (one norm scaled): another model under the same config."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    state = load_file(str(dst / "model.safetensors"))
    state["model.norm.weight"] = state["model.norm.weight"] * 1.5
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _stored_responses(uri: str, target) -> None:
    rows = [{"sample_id": f"p{i}", "domain": "d", "source": "s", "split": "train", "mode": "chat",
             "messages_json": json.dumps([{"role": "user", "content": "hi"}]), "prompt_token_ids": [5, 6, 7],
             "response_token_ids": [8, 9, 2], "finish_reason": "stop", "gen_params_id": "g"} for i in range(3)]
    store.append(uri, store.PROMPTS, pa.Table.from_pylist(rows, schema=S.PROMPTS_SCHEMA),
                 lineage={"stage": "ingest", "shard": 0, **policy.lineage_record(str(target))})


def test_another_targets_weights_are_refused_before_the_pool_is_read(tmp_path, capsys, monkeypatch, tiny_target):
    # The refusal came from build(), after every source was read and tokenised, the contamination
    # check had run and <workdir>/ingest had been created.
    other = _reweighted(tiny_target, tmp_path / "other target")
    work = tmp_path / "work"
    _stored_responses(str(work / "store"), tiny_target)
    pools = []
    real = commands.load_pool
    monkeypatch.setattr(commands, "load_pool", lambda *a, **k: pools.append(1) or real(*a, **k))
    rc, err = _build(tmp_path, capsys, f"run.target={other}")
    assert rc == 2
    assert len(err) == 1 and err[0].startswith(f"ingest: error: ingest build: responses in {work / 'store'} were "
                                               f"generated by {tiny_target} (weights ")
    assert f"but run.target is {other} (weights {policy.target_id(str(other))[:12]})" in err[0]
    assert pools == []
    assert not (work / "ingest").exists()
    assert store.read(str(work / "store"), store.PROMPTS).num_rows == 3


def test_the_same_weights_under_another_folder_name_are_not_refused_early(tmp_path, monkeypatch, tiny_target):
    # Renamed, the same weights are the same target: the early check lets it through to the pool.
    same = tmp_path / "renamed target"
    shutil.copytree(tiny_target, same)
    work = tmp_path / "work"
    _stored_responses(str(work / "store"), tiny_target)

    class Reached(Exception):
        pass

    def stop(*args, **kwargs):
        raise Reached

    monkeypatch.setattr(commands, "load_pool", stop)
    with pytest.raises(Reached):
        main(["build", "--recipe", "recipes/toy.yaml", f"run.workdir={work}", f"run.target={same}"])


def test_weights_larger_than_config_json_are_refused_before_the_pool_is_read(tmp_path, capsys, monkeypatch,
                                                                           tiny_target):
    # intermediate_size lowered in config.json: vLLM cut every MLP tensor to fit and generated the whole
    # prompts table from that other model, without a word.
    target = tmp_path / "edited target"
    shutil.copytree(tiny_target, target)
    cfg = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 256}))
    pools = []
    real = commands.load_pool
    monkeypatch.setattr(commands, "load_pool", lambda *a, **k: pools.append(1) or real(*a, **k))
    rc, err = _build(tmp_path, capsys, f"run.target={target}")
    assert rc == 2
    assert err == [f"ingest: error: run.target: {target}: weights do not match config.json "
                   "(model.layers.0.mlp.down_proj.weight is [128, 384] in model.safetensors, config.json makes it "
                   "[128, 256]; and 23 more tensors); restore the checkpoint's own config.json, or download the "
                   "checkpoint again"]
    assert pools == [] and not (tmp_path / "work").exists()


@pytest.mark.parametrize("command", ["build", "validate"])
def test_an_empty_manifest_path_is_one_line_naming_the_key(tmp_path, capsys, command):
    # `ingest.manifest=` (a wrapper's empty default) was read as Path(""), the current directory:
    # "ingest: error: .: is a directory, not a YAML file".
    rc = main([command, "--recipe", "recipes/toy.yaml", f"run.workdir={tmp_path / 'work'}", "ingest.manifest="])
    assert rc == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "ingest: error: ingest.manifest: no path given (it is empty); set it, or pass --manifest PATH"]
    assert not (tmp_path / "work").exists()
