"""Capture a target's hidden states with vLLM's ``extract_hidden_states`` method.

The engine runs the target over fixed token sequences (prompt + on-policy response, generation of a
single throw-away token) and our connector (:mod:`eaglenest.featurestore.capture.connector`) spools each
request's ``[num_tokens, num_layers, hidden]`` tensor to a private directory; this module reads it
back, checks the token ids, and deletes the spool file. Layers captured are the EAGLE-3 aux layers
followed by the last layer (vLLM ids; id L is the last block's output before the final norm), so
one pass yields both the draft's inputs and the target's own logits basis.

:meth:`Capturer.stream` keeps the engine busy: sequences go in as a window that is refilled as
requests finish, and captures are handed out in order, so the engine process computes while the
caller encodes and writes. Fixed batches (the earlier design) left it idle during every batch's read-back, encode
and commit, and each batch ended with a lone tail step. The trade-off: results come one at a time,
and the window, not a batch, is what bounds memory (``max_in_flight`` sequences and a byte budget).
"""

from __future__ import annotations

import dataclasses
import logging
import numbers
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from eaglenest.config import short
from eaglenest.engine import EngineConfig, close_llm, make_llm
from eaglenest.errors import ConfigError, StoreError
from eaglenest.featurestore import schema as S
from eaglenest.paths import orphans, pid_prefix

log = logging.getLogger(__name__)

#: The connector vLLM loads into the engine, by module path and class name (it imports vLLM and
#: torch, so this module names it instead of importing it).
CONNECTOR_MODULE = "eaglenest.featurestore.capture.connector"
CONNECTOR_NAME = "EaglenestHiddenStatesConnector"
#: The spool folder (in the temp dir) where the connector writes each capture's hidden states, named
#: with the capturing process's pid; one a SIGKILLed capture left (its pid gone, untouched for
#: SPOOL_STALE_S) is removed by the next capture on the machine.
SPOOL_PREFIX = "eaglenest-capture-"
SPOOL_STALE_S = 600.0


def default_layer_ids(num_layers: int) -> tuple[int, ...]:
    """vLLM's default EAGLE-3 aux layers, (2, L//2, L-3), in vLLM's convention, ascending (as vLLM
    hands them over: a 3-layer target's (2, 1, 0) is (0, 1, 2))."""
    ids = (2, num_layers // 2, num_layers - 3)
    if len(set(ids)) != 3 or not all(0 <= i < num_layers for i in ids):
        raise ConfigError(f"featurestore.layer_ids: the default rule gives {ids} for a {num_layers}-layer "
                          f"target; set three distinct ids in 0..{num_layers - 1} explicitly")
    return tuple(sorted(ids))


def resolve_layer_ids(layer_ids: list[int] | tuple[int, ...], num_layers: int) -> tuple[int, ...]:
    """The aux layer ids, in the order given (the stored order, part of the feature set's identity; a
    capture takes them ascending, as vLLM hands them over: ``build.feature_meta``; an import ascending
    too, interop/sink.import_meta). Each id at most once, and never ``num_layers``: the last layer is
    always captured as ``last_hidden`` already, so as an aux layer it would be stored twice."""
    ids = tuple(map(_layer_id, layer_ids)) or default_layer_ids(num_layers)
    bad = [i for i in ids if not 0 <= i <= num_layers]
    if bad:  # the same range as the last-layer refusal below names
        raise ConfigError(f"featurestore.layer_ids: {short(bad)} outside 0..{num_layers - 1} (vLLM convention; "
                          f"{num_layers}, the last layer, is captured separately as last_hidden)")
    if num_layers in ids:
        raise ConfigError(f"featurestore.layer_ids: {num_layers} is the last layer, captured separately "
                          f"(last_hidden); use ids 0..{num_layers - 1}")
    dups = sorted(i for i, n in Counter(ids).items() if n > 1)
    if dups:
        raise ConfigError(f"featurestore.layer_ids: duplicate ids {short(dups)}; give each aux layer once")
    return ids


def _layer_id(value) -> int:
    """One layer id as a plain int (numpy's integers included: the identity is JSON, and vLLM's config
    takes ints); a float, a string or a bool is one line naming the key (the recipe's walker refuses
    them too, a config built in code reaches here)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(f"featurestore.layer_ids: {short(value)} is not a whole number (a vLLM layer id)")
    return int(value)


def capture_llm(target: str, capture_ids: list[int], engine: EngineConfig, *, spool: str, extra: dict | None = None,
                trust_remote_code: bool = False):
    """A vLLM engine whose ``extract_hidden_states`` proposer hands ``capture_ids`` (aux layers +
    the last) to the eaglenest connector, which spools them under ``spool`` (``extra``: more
    connector settings, e.g. the stream's publish socket). The engine runs in vLLM's own processes
    whatever ``engine.in_process`` says by default: the connector writes a request's states in the
    engine step after the one that finished it, which an engine stepped by its caller (in process)
    would not take while the caller waits for them; and with its own processes the engine computes
    the next captures while the caller encodes and writes this one."""
    if engine.in_process:
        raise ConfigError("featurestore.engine.in_process: a capture engine runs in vLLM's own processes "
                          "(its connector hands states over in the engine's next step); set it to null or false")
    return make_llm(
        target, dataclasses.replace(engine, in_process=False), trust_remote_code=trust_remote_code,
        where="featurestore.engine",
        speculative_config={
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(capture_ids)}},
        },
        kv_transfer_config={
            "kv_connector": CONNECTOR_NAME,
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": spool, **(extra or {})},
        },
    )


class Capturer:
    """A live vLLM engine that returns hidden states for token sequences. Use as a context manager."""

    def __init__(self, target: str, layer_ids: tuple[int, ...], num_layers: int, engine: EngineConfig, *,
                 trust_remote_code: bool = False):
        self.layer_ids = tuple(layer_ids)
        self.capture_ids = [*self.layer_ids, num_layers]
        for stale in orphans(tempfile.gettempdir(), SPOOL_PREFIX, min_age_s=SPOOL_STALE_S):  # a killed capture's
            shutil.rmtree(stale, ignore_errors=True)
        self._spool = Path(tempfile.mkdtemp(prefix=pid_prefix(SPOOL_PREFIX)))
        self.num_forward_passes = 0
        #: Largest window :meth:`stream` held: sequences in the engine, sequences sent and not yet
        #: handed out, and their hidden-state bytes (what tests check the bounds against).
        self.peak_window = {"in_engine": 0, "sequences": 0, "bytes": 0}
        try:
            self.llm = capture_llm(target, self.capture_ids, engine, spool=str(self._spool),
                                   trust_remote_code=trust_remote_code)
        except BaseException:  # no engine: close() will not run, so the spool goes here
            shutil.rmtree(self._spool, ignore_errors=True)
            raise

    def __enter__(self) -> "Capturer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        shutil.rmtree(self._spool, ignore_errors=True)
        llm, self.llm = getattr(self, "llm", None), None
        close_llm(llm)

    def capture(self, sequences: list[list[int]]) -> list[tuple[np.ndarray, np.ndarray]]:
        """For each token sequence, ``(aux [T, n_aux, H], last [T, H])`` as numpy (torch dtype kept),
        all sent to the engine at once."""
        n = len(sequences)
        return list(self.stream(sequences, max_in_flight=max(n, 1), budget_bytes=float("inf"), bytes_per_token=0))

    def stream(self, sequences: list[list[int]], *, max_in_flight: int, budget_bytes: float,
               bytes_per_token: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """:meth:`capture`'s results one by one, in the order of ``sequences``, while the engine
        keeps going. At most ``max_in_flight`` sequences are in the engine, refilled as soon as
        requests finish, and the window of sequences sent and not yet handed out (in the engine, or
        finished and spooled) holds at most ``2 * max_in_flight`` sequences and ``budget_bytes`` of
        hidden states (``bytes_per_token`` each; one sequence alone may exceed it). The engine (its
        own process) thus computes the next captures while the caller encodes and writes this one.
        Refilling on finish, not on hand-out, matters: vLLM's connector extracts a request's states
        only in the engine step after the one that finished it, so a window refilled on hand-out
        would leave that step empty. Leaving early (an error, ``close()``) aborts what is still
        queued, so the engine can be reused."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.v1.engine.exceptions import EngineDeadError

        params = SamplingParams(max_tokens=1, temperature=0.0)
        engine = self.llm.llm_engine
        sizes = [len(s) * bytes_per_token for s in sequences]
        queued: dict[str, int] = {}  # vLLM request id -> index, not finished yet
        finished: dict[int, object] = {}  # index -> RequestOutput, finished, not handed out yet
        state = {"sent": 0, "handed": 0, "held": 0}  # held: bytes of the window (sent, not handed out)

        def fill() -> None:
            batch, sent, handed = [], state["sent"], state["handed"]
            while sent < len(sequences) and (sent == handed or (
                    len(queued) + len(batch) < max_in_flight and sent - handed < 2 * max_in_flight
                    and state["held"] + sizes[sent] <= budget_bytes)):
                batch.append(sent)
                state["held"] += sizes[sent]
                sent += 1
            state["sent"] = sent
            for key, value in (("in_engine", len(queued) + len(batch)), ("sequences", sent - handed),
                               ("bytes", state["held"])):
                self.peak_window[key] = max(self.peak_window[key], value)
            if batch:
                prompts = [TokensPrompt(prompt_token_ids=list(map(int, sequences[i]))) for i in batch]
                ids = self.llm.enqueue(prompts, params, use_tqdm=False)
                # vLLM appends "-<random>" internally; outputs carry the id before it.
                queued.update((rid.split("-", 1)[0], i) for rid, i in zip(ids, batch))
                self.num_forward_passes += len(batch)

        try:
            while state["handed"] < len(sequences):
                fill()
                while state["handed"] not in finished:
                    _wait_for_output(engine)
                    for out in engine.step():
                        if out.finished and out.request_id in queued:
                            finished[queued.pop(out.request_id)] = out
                    fill()
                i = state["handed"]
                result = self._read(sequences[i], finished.pop(i))
                state["held"] -= sizes[i]
                state["handed"] = i + 1
                yield result
        except EngineDeadError:  # killed (out of memory?) or crashed: nothing left to abort
            queued.clear()
            raise StoreError(f"the capture engine died after {state['handed']} of {len(sequences)} captures; "
                             "vLLM's log says why (out of memory?). What was committed is kept: a re-run "
                             "resumes after it") from None
        finally:
            if queued:
                engine.abort_request(list(queued))
            for out in finished.values():  # read by no one: their spool files go now
                path = (out.kv_transfer_params or {}).get("hidden_states_path")
                if path:
                    _cleanup(path)

    def _read(self, seq: list[int], out) -> tuple[np.ndarray, np.ndarray]:
        """The spooled capture of one finished request, checked against ``seq``; the file is removed."""
        from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
            load_hidden_states,
        )

        path = (out.kv_transfer_params or {}).get("hidden_states_path")
        if path is None:
            raise StoreError("vLLM returned no hidden states: is the capture connector loaded?")
        from safetensors import SafetensorError

        try:
            data = load_hidden_states(path)  # waits on the file's lock until the writer is done
        except (OSError, SafetensorError) as exc:  # vLLM only logs a failed write (a full temp folder)
            if _engine_died(self.llm):  # its file never written: the engine's death, said as such
                from vllm.v1.engine.exceptions import EngineDeadError

                raise EngineDeadError() from None
            first = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
            raise StoreError(f"cannot read the hidden states the capture engine spooled to {Path(path).parent} "
                             f"({first}): vLLM's log says why; a full temp folder? set TMPDIR to a disk with "
                             "room for featurestore.batch_size captures. What was committed is kept: a re-run "
                             "resumes") from None
        finally:
            _cleanup(path)
        hs, ids = data["hidden_states"], data["token_ids"]
        if ids.tolist() != list(map(int, seq)):
            raise StoreError("captured token ids differ from the sequence sent")
        if hs.shape[0] != len(seq) or hs.shape[1] != len(self.capture_ids):
            raise StoreError(f"captured shape {tuple(hs.shape)} for {len(seq)} tokens, "
                             f"{len(self.capture_ids)} layers")
        arr = S.to_numpy(hs)
        # numpy copies (single-threaded): a torch .contiguous() here runs on OpenMP threads that
        # compete with the engine's for the same cores.
        return np.ascontiguousarray(arr[:, :-1]), np.ascontiguousarray(arr[:, -1])


def _wait_for_output(engine, poll_s: float = 0.5) -> None:
    """Return once ``engine.step()`` has an output to take; raise vLLM's ``EngineDeadError`` once
    its EngineCore process is dead.

    vLLM's synchronous client waits for the next output without a timeout, and when the EngineCore
    dies (the OOM killer, a crash) its monitor thread marks the client dead and shuts it down
    without waking that wait: ``step()`` then blocks forever (vLLM 0.32). So wait here on the
    client's output queue, checking the dead flag every ``poll_s``; both are vLLM internals, and
    where a version lacks them this returns at once (the plain blocking step)."""
    from vllm.v1.engine.exceptions import EngineDeadError

    core = getattr(engine, "engine_core", None)
    outputs, resources = getattr(core, "outputs_queue", None), getattr(core, "resources", None)
    ready = getattr(outputs, "not_empty", None)  # queue.Queue's condition, notified on every put
    if ready is None or not hasattr(resources, "engine_dead"):
        return
    with ready:
        while not len(outputs.queue):
            if resources.engine_dead:
                raise EngineDeadError()
            ready.wait(poll_s)


def _engine_died(llm, wait_s: float = 2.0, poll_s: float = 0.1) -> bool:
    """Whether ``llm``'s EngineCore is dead, allowing ``wait_s`` for vLLM's monitor thread to mark it
    (a spool file missing because the engine was killed before writing it, seen before the mark).
    False where vLLM's internals lack the mark (or there is no engine)."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    resources = getattr(core, "resources", None)
    if not hasattr(resources, "engine_dead"):
        return False
    deadline = time.monotonic() + wait_s
    while not resources.engine_dead and time.monotonic() < deadline:
        time.sleep(poll_s)
    return bool(resources.engine_dead)


def _cleanup(path: str) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        cleanup_hidden_states,
    )

    cleanup_hidden_states(path)
