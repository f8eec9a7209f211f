"""The capture stream's producer process: a vLLM capture engine whose connector publishes to a socket.

Started by :class:`eaglenest.featurestore.stream.local.CaptureStream` as
``python -m eaglenest.featurestore.stream.producer`` in a process group of its own. It reads one
JSON spec line from stdin (target, layers, engine settings, socket, sequences) and then keeps
stdin open as the control channel: EOF there means the consumer closed the stream or died, and the
producer shuts the engine down and exits (its engine children are ended by pid). Sequences go to
the engine in windows of at most ``window`` requests, each tagged with its position, so the
consumer can hand captures out in order within its credit bound. After the last window, one
untagged flush request makes sure every capture has been published before the engine is closed
(see :func:`_flush`). An engine that dies under it ends the producer with exit code
:data:`ENGINE_DIED` (:func:`_watch_engine`). vLLM is imported only here.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time

from eaglenest.engine import EngineConfig, close_llm
from eaglenest.featurestore.capture.engine import capture_llm
from eaglenest.featurestore.capture.publish import PUBLISH_KEY, TAG_KEY

log = logging.getLogger("eaglenest.featurestore.stream.producer")

#: The producer's exit code when its engine died under it (the consumer names the code and the log).
ENGINE_DIED = 3


def _end_children(timeout_s: float = 10.0) -> None:
    """Terminate, then kill, this process's descendants (the engine core and its workers)."""
    import psutil

    kids = psutil.Process().children(recursive=True)
    for p in kids:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(kids, timeout=timeout_s)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def _watch_consumer(state: dict) -> None:
    """Blocks until the consumer closes our stdin (or dies), then stops everything and exits.

    Reads the file descriptor, not ``sys.stdin.buffer``: this daemon thread, blocked inside the
    buffered reader, holds its lock, and an interpreter exiting meanwhile (the captures done, or an
    error) aborted on it at shutdown (SIGABRT, "could not acquire lock for <stdin>"), so the
    consumer said the producer was killed by signal 6 instead of quoting its exit."""
    try:
        while os.read(sys.stdin.fileno(), 65536):
            pass
    except OSError:
        pass
    with state["lock"]:  # one of us (this thread, or the main one when done) closes the engine
        if state.get("finished"):
            return
        state["stopping"] = True
    log.info("capture stream: consumer gone, shutting the engine down")
    try:
        close_llm(state.get("llm"))
    finally:
        _end_children()
        os._exit(0)


def _watch_engine(state: dict, poll_s: float = 0.5) -> None:
    """Ends the producer with :data:`ENGINE_DIED` once its EngineCore process is dead.

    vLLM's synchronous client marks itself dead when its EngineCore exits (the OOM killer, a crash)
    but never wakes a ``generate()`` waiting for output (vLLM 0.32). Once a capture has been sent,
    the connection's EOF tells the consumer; an EngineCore killed before its first frame left the
    producer, and the trainer waiting on it (the unix stream has no timeout), blocked for ever.
    Reads vLLM internals (the client's dead flag); where a version lacks them it watches nothing."""
    resources = getattr(getattr(state["llm"].llm_engine, "engine_core", None), "resources", None)
    if not hasattr(resources, "engine_dead"):
        return
    while not resources.engine_dead:
        time.sleep(poll_s)
    with state["lock"]:
        if state.get("finished") or state.get("stopping"):  # done, or the control thread is ending us
            return
        state["stopping"] = True
    log.error("capture stream: the capture engine died (its EngineCore exited: out of memory?); vLLM's log "
              "above says why")
    _end_children()
    os._exit(ENGINE_DIED)


def _flush(llm, token_ids: list[int]) -> None:
    """Returns once the connector has published every request that has finished so far.

    vLLM's hidden-states connector receives a finished request's save in the *next* engine step
    (the scheduler hands pending saves to the worker with the following step's metadata), so when
    ``generate()`` returns, the last requests' captures may not be sent yet, and closing the engine
    then would drop them. One more untagged one-token request cannot be scheduled before that
    step, and its output comes back only after the step ran (the publish is synchronous in it), so
    its return means every tagged capture is out. Untagged requests are never published.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm.generate([TokensPrompt(prompt_token_ids=list(token_ids))], [SamplingParams(max_tokens=1, temperature=0.0)],
                 use_tqdm=False)


def run(spec: dict) -> int:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    state: dict = {"lock": threading.Lock()}
    threading.Thread(target=_watch_consumer, args=(state,), name="eaglenest-stream-control", daemon=True).start()
    state["llm"] = llm = capture_llm(spec["target"], [*spec["layer_ids"], spec["num_layers"]],
                                     EngineConfig(**spec["engine"]), spool=spec["storage_dir"],
                                     extra={PUBLISH_KEY: spec["socket"]},
                                     trust_remote_code=bool(spec.get("trust_remote_code", False)))
    threading.Thread(target=_watch_engine, args=(state,), name="eaglenest-stream-engine", daemon=True).start()
    seqs, window = spec["sequences"], int(spec["window"])
    try:
        for start in range(0, len(seqs), window):
            if state.get("stopping"):
                break
            idx = range(start, min(start + window, len(seqs)))
            prompts = [TokensPrompt(prompt_token_ids=seqs[i]) for i in idx]
            params = [SamplingParams(max_tokens=1, temperature=0.0,
                                     extra_args={"kv_transfer_params": {TAG_KEY: i}}) for i in idx]
            llm.generate(prompts, params, use_tqdm=False)
        if seqs and not state.get("stopping"):
            _flush(llm, seqs[0][:1])
        log.info("capture stream: %d sequences captured", len(seqs))
    finally:
        with state["lock"]:
            state["finished"] = True
            stopping = state.get("stopping")
        if stopping:  # the control thread is closing the engine and ends the process with 0
            threading.Event().wait(60)
        else:
            close_llm(llm)
    return 0


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    line = sys.stdin.buffer.readline()
    if not line:
        return 0  # the consumer went away before sending the spec
    return run(json.loads(line))


if __name__ == "__main__":
    raise SystemExit(main())
