"""Build vLLM engines the same way in every stage (regeneration, capture, evaluation).

vLLM is imported lazily: importing eaglenest never pulls it in. On CPU, ``gpu_memory_utilization``
is the share of the NUMA node's RAM reserved for the KV cache, so the default is small; on CUDA it
is the share of device memory.

Where vLLM logs is settled here too, and only when an engine is about to start: the CLI names the
run's log folder (:func:`defer_quiet_vllm`, which writes nothing), and :func:`quiet_vllm` writes
vLLM's logging config there the moment :func:`make_llm` or a server starts one, so a command that
refuses its input leaves the user's workdir untouched. Code that starts child processes which start
engines (the stream producer, Dask workers) calls :func:`quiet_vllm` first: the children inherit
vLLM's own ``VLLM_LOGGING_CONFIG_PATH`` and log to the same file. The folder itself is not passed
through the environment.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import logging
import math
import os
import random
import signal
from multiprocessing import resource_tracker
from pathlib import Path
from typing import Any, Literal, get_args

from eaglenest.config import short
from eaglenest.engine_errors import TOO_LONG, TOO_MANY_SEQS, kv_cache_problem, one_line, shown, weights_mismatch
from eaglenest.errors import ConfigError, require
from eaglenest.hf import is_refusal, refusal, revision_kwargs
from eaglenest.paths import read_json_object
from eaglenest.provenance import write_text_atomic
from eaglenest.precheck import check_engine_target

log = logging.getLogger(__name__)

#: Bounds vLLM enforces only once an engine runs, checked at config time: ``SamplingParams``'
#: temperature, the engine seed (vLLM seeds numpy with it, which takes [0, 2**32 - 1]) and the draft
#: tokens a round its rejection sampler verifies (``MAX_SPEC_LEN``: past it the first decode fails).
MAX_TEMPERATURE = 2.0
MAX_SEED = 2**32 - 1
MAX_NUM_SPECULATIVE_TOKENS = 128


#: The engine dtypes a recipe may name: "auto" (the checkpoint's own), else vLLM's names.
EngineDtype = Literal["auto", "half", "float16", "bfloat16", "float", "float32"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    #: Longest sequence (prompt + output) the engine accepts.
    max_model_len: int = 4096
    #: KV-cache share of RAM (CPU) or device memory (CUDA). An in-process CPU engine gets exactly this
    #: share for its KV cache (``cpu_kv_cache_bytes``); vLLM's own worker process takes its RSS out of it.
    memory_fraction: float = 0.15
    max_num_seqs: int = 64
    #: "auto" runs the target in its own checkpoint dtype (config.json), unlike vLLM's "auto", which
    #: would downcast an fp32 checkpoint to bf16. Regeneration, capture and serving then agree.
    #: The other values are vLLM's own names (it refuses any other only once its engine starts).
    dtype: EngineDtype = "auto"
    #: Skip CUDA graphs / torch.compile: faster start, slower steps. On by default for small runs.
    enforce_eager: bool = True
    seed: int = 0
    #: Devices one engine spans (vLLM tensor parallelism), e.g. 8 for a large MoE target.
    tensor_parallel_size: int = 1
    #: CPU only: vLLM's CPU worker runs on every usable core, the frontend sharing one. vLLM's default
    #: (False) leaves one core to the frontend: 1 worker thread on a 2-core machine. Long prefills
    #: scale with the threads (a 16K-token prefill 1.93x faster with 2 than with 1 on 2 cores, the
    #: same tokens: ``bench/cpu_threads.py``). Split-KV attention is turned off with it (unless
    #: VLLM_CPU_ATTN_SPLIT_KV is set), so outputs under speculation stay identical to the target's
    #: alone. A user's own VLLM_CPU_OMP_THREADS_BIND or VLLM_CPU_NUM_OF_RESERVED_CPU wins. Leave it
    #: off where engines or processes share the cores. It binds vLLM's worker *process*: an engine
    #: in this process (``in_process``) runs on this process's torch threads (every core by default,
    #: split-KV off) either way.
    cpu_all_cores: bool = False
    #: Run the engine inside this process (vLLM's in-process engine core, its worker in the same
    #: thread) rather than in the EngineCore and worker processes vLLM starts by default. null: in
    #: process on CPU with one rank, vLLM's processes on CUDA or with tensor parallelism. On CPU an
    #: engine then starts ~4x sooner (no two spawned interpreters importing torch and vLLM:
    #: ``bench/engine_start.py``) and runs on this process's threads (``cpu_all_cores`` binds the
    #: threads of vLLM's worker process only). With its own processes the engine computes while
    #: this process encodes and writes what it returned (CUDA, large targets).
    in_process: bool | None = None

    def uses_own_process(self, *, cuda: bool) -> bool:
        """Whether the engine runs in vLLM's own processes (see ``in_process``)."""
        if self.in_process is None:
            return cuda or self.tensor_parallel_size > 1
        return not self.in_process

    def check(self, where: str) -> None:
        """Refuse values vLLM would reject only once its engine starts (a traceback, a log written),
        naming the key under ``where`` (e.g. ``ingest.engine``); called by the sections that hold one, and by
        :func:`make_llm` (``engine``) for one built in code."""
        for key in ("max_model_len", "max_num_seqs", "tensor_parallel_size", "seed"):
            if not is_int(getattr(self, key)):  # built in code, not from a recipe (whose walker checks types)
                raise ConfigError(f"{where}.{key}: must be a whole number, got {getattr(self, key)!r}")
        for key, low in (("max_model_len", 16), ("max_num_seqs", 1), ("tensor_parallel_size", 1)):
            if getattr(self, key) < low:
                raise ConfigError(f"{where}.{key}: must be >= {low}, got {getattr(self, key)}")
        if not 0 <= self.seed <= MAX_SEED:
            raise ConfigError(f"{where}.seed: must be in [0, {MAX_SEED}], got {self.seed}")
        if isinstance(self.memory_fraction, bool) or not isinstance(self.memory_fraction, (int, float)) \
                or not 0 < self.memory_fraction <= 1:
            raise ConfigError(f"{where}.memory_fraction: must be in (0, 1], got {self.memory_fraction}")
        if self.dtype not in get_args(EngineDtype):
            raise ConfigError(f"{where}.dtype: {short(self.dtype)} is not one of "
                              f"{', '.join(map(repr, get_args(EngineDtype)))}")
        if self.in_process and self.tensor_parallel_size > 1:
            raise ConfigError(f"{where}.in_process: an engine of {self.tensor_parallel_size} ranks needs its own "
                              "processes; set it to false or null")


#: Environment variables through which a user already chose how vLLM logs (then left alone).
VLLM_LOG_ENV = ("VLLM_LOGGING_CONFIG_PATH", "VLLM_LOGGING_LEVEL", "VLLM_CONFIGURE_LOGGING")
#: The run's log folder, once the CLI has chosen to keep vLLM's INFO lines off the console (this
#: process only: children get vLLM's own ``VLLM_LOGGING_CONFIG_PATH`` once :func:`quiet_vllm` ran).
_deferred_log_dir: Path | None = None
#: The variables of :data:`VLLM_LOG_ENV` this process set itself, with their values: an earlier
#: command's, not a user's choice, when a later command runs in the same process (a notebook, a
#: script calling several stages' ``main``).
_set_here: dict[str, str] = {}


def _set_env(key: str, value: str) -> None:
    os.environ[key] = value
    _set_here[key] = value


def _forget_set_here() -> None:
    """Unset what an earlier command in this process set (and nothing changed since)."""
    for key, value in _set_here.items():
        if os.environ.get(key) == value:
            del os.environ[key]
    _set_here.clear()


def defer_quiet_vllm(log_dir: Path, verbose: int) -> bool:
    """Without ``-v`` (and without a user's own ``VLLM_LOGGING_*``), route vLLM's INFO lines to
    ``<log_dir>/vllm.log`` once an engine starts (:func:`quiet_vllm`). Writes nothing now: the
    folder is only remembered, in this process. Returns whether it will be."""
    global _deferred_log_dir
    _deferred_log_dir = None
    _forget_set_here()  # an earlier command's run folder is not this one's
    if verbose or any(k in os.environ for k in VLLM_LOG_ENV):
        return False
    _deferred_log_dir = Path(log_dir)
    return True


def quiet_vllm() -> Path | None:
    """Called just before an engine or a vLLM server starts, or a child process that starts one (a
    stream producer, Dask workers): if the CLI deferred it, write the logging config vLLM reads
    (``VLLM_LOGGING_CONFIG_PATH``: INFO to ``vllm.log``, warnings to the console) and point this
    process and its children at it (through vLLM's own variable, which its engine processes read
    too); once per process tree. Also starts the
    multiprocessing resource tracker with its reports going to the same file (see below). Returns
    the log file (None: vLLM logs as it always does)."""
    log_dir = _deferred_log_dir
    if log_dir is None:  # not deferred here: -v, a user's own VLLM_LOGGING_*, or a child process of
        return None      # ours, which inherited vLLM's variables from its parent
    log_path = log_dir / "vllm.log"
    if os.environ.get("VLLM_LOGGING_CONFIG_PATH") == str(log_dir / "vllm-logging.json"):
        return log_path  # done already
    config = {
        "version": 1, "disable_existing_loggers": False,
        "formatters": {"vllm": {"format": "%(asctime)s %(levelname)s %(process)d %(name)s: %(message)s"}},
        "handlers": {
            "file": {"class": "logging.FileHandler", "filename": str(log_path), "formatter": "vllm",
                     "level": "INFO"},
            "console": {"class": "logging.StreamHandler", "stream": "ext://sys.stderr", "formatter": "vllm",
                        "level": "WARNING"}},
        "loggers": {"vllm": {"handlers": ["file", "console"], "level": "INFO", "propagate": False}},
    }
    path = Path(log_dir) / "vllm-logging.json"
    try:
        write_text_atomic(path, json.dumps(config, indent=1))  # engines in other processes may read it meanwhile
        _tracker_reports_to(log_path)
    except OSError:  # an unwritable run directory is reported by the stage itself
        _set_env("VLLM_LOGGING_LEVEL", "WARNING")
        return None
    _set_env("VLLM_CONFIGURE_LOGGING", "1")
    _set_env("VLLM_LOGGING_CONFIG_PATH", str(path))
    log.debug("vLLM's INFO log: %s (-v shows it on the console)", log_path)
    return log_path


def _tracker_reports_to(log_path: Path) -> None:
    """Start this process's multiprocessing resource tracker with its stderr on ``log_path``.

    vLLM stops an engine by giving its EngineCore process a grace (5 s by default, 1 s from
    :func:`close_llm`), then killing it; on CPU its worker alone takes ~3 s to exit, so the
    EngineCore is killed before it unlinks the shared memory of its message queue. The tracker
    (shared by the engine processes, started by the first process that needs it) unlinks what they
    left when this process exits, and reports each leak on its stderr: two lines per kind, printed
    after the command's own last line (a failed capture's one error line was no longer the last).
    Those reports are vLLM's bookkeeping, so they go where vLLM's INFO lines go. Letting the
    EngineCore finish instead (``shutdown(timeout=30)``) removes the leak but costs 3.5-8 s per
    engine on this project's 2-core machine. A tracker already running (started by something
    earlier) keeps its stderr."""
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    saved = os.dup(2)
    try:
        os.dup2(fd, 2)  # the tracker inherits fd 2 when it is spawned; a no-op if it runs already
        resource_tracker.ensure_running()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(fd)


def has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        return False


def checkpoint_dtype(model: str) -> str:
    """The dtype a local checkpoint declares in config.json ("auto" if unknown or remote)."""
    path = Path(model) / "config.json"
    if not path.is_file():
        return "auto"
    cfg = json.loads(path.read_text())
    dtype = str(cfg.get("dtype") or cfg.get("torch_dtype") or "auto").replace("torch.", "")
    return dtype if dtype in ("float32", "bfloat16", "float16") else "auto"


def speculative_config(draft: str, num_speculative_tokens: int) -> dict[str, Any]:
    """vLLM's ``speculative_config`` for an exported draft directory: EAGLE-3, with
    ``parallel_drafting`` when the draft's own config.json says it drafts in parallel (a P-EAGLE
    export's ``parallel_drafting: true``, or speculators' ``speculators_model_type: peagle``), so
    every caller serves a draft as it was trained without a second setting. A DFlash export
    (``dflash_config`` in its config.json, or speculators' ``speculators_model_type: dflash``;
    ``train.family=dflash``) gets ``method: dflash``."""
    spec: dict[str, Any] = {"method": "eagle3", "model": draft, "num_speculative_tokens": int(num_speculative_tokens)}
    cfg = _draft_config(draft)
    trained = trained_depth(cfg)
    if trained is not None and num_speculative_tokens > trained:
        log.warning("num_speculative_tokens %d is past the %d tokens a round the draft %s was trained to draft: "
                    "its proposals past %d come from positions it never learnt (acceptance falls; output stays "
                    "the target's)", num_speculative_tokens, trained, draft, trained)
    family = draft_family(cfg)
    if family == "dflash":
        spec["method"] = "dflash"
    elif family == "peagle":
        spec["parallel_drafting"] = True
    return spec


def draft_family(cfg: dict[str, Any]) -> str:
    """The family of an exported draft from its config.json ``cfg`` (either format): ``dflash``,
    ``peagle`` or ``eagle3``."""
    if _is_dflash(cfg):
        return "dflash"
    return "peagle" if cfg.get("parallel_drafting") is True or cfg.get("speculators_model_type") == "peagle" \
        else "eagle3"


def _draft_config(draft: str) -> dict[str, Any]:
    """The exported draft's config.json ({} when there is none yet)."""
    path = Path(draft) / "config.json"
    if not path.is_file():
        return {}
    return read_json_object(path, error=ConfigError, then="not an exported draft: run `serve export` again")


#: The key of an exported draft's config.json that holds the number of speculative tokens it is
#: served with by default (``serve export`` writes its family's measured best).
RECOMMENDED_K = "recommended_num_speculative_tokens"
#: The key of an exported draft's config.json that holds the tokens a round it was trained to draft
#: (eaglenest.train.config.trained_num_speculative_tokens).
TRAINED_K = "trained_num_speculative_tokens"


def trained_depth(cfg: dict[str, Any]) -> int | None:
    """The tokens a round the draft whose config.json is ``cfg`` was trained to draft: its
    ``trained_num_speculative_tokens``, else a DFlash draft's ``block_size`` - 1; None when unknown
    (an EAGLE-3 or P-EAGLE export made before the key, a draft from elsewhere)."""
    for value in (cfg.get(TRAINED_K), (cfg.get("block_size") - 1) if _is_dflash(cfg)
                  and isinstance(cfg.get("block_size"), int) else None):
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return value
    return None


def _is_dflash(cfg: dict[str, Any]) -> bool:
    return isinstance(cfg.get("dflash_config"), dict) or cfg.get("speculators_model_type") == "dflash"


def draft_num_speculative_tokens(draft: str, default: int) -> int:
    """The number of speculative tokens to serve ``draft`` with when the recipe sets none: its
    config.json's ``recommended_num_speculative_tokens``, else (a speculators checkpoint) its first
    proposal method's ``speculative_tokens``, else ``default`` (no draft there yet, or an older export)."""
    cfg = _draft_config(draft)
    k = cfg.get(RECOMMENDED_K)
    if is_count(k):
        return k
    spec = cfg.get("speculators_config")  # damaged (not an object, no list): the default, and serving's
    methods = spec.get("proposal_methods") if isinstance(spec, dict) else None  # draft check names it
    first = methods[0] if isinstance(methods, list) and methods else None
    k = first.get("speculative_tokens") if isinstance(first, dict) else None
    return k if is_count(k) else int(default)


def is_count(value: Any) -> bool:
    """A whole number >= 1 (not a bool: ``true`` is no count of tokens)."""
    return is_int(value) and value >= 1


def is_int(value: Any) -> bool:
    """A whole number (not a bool, which JSON and YAML give for ``true``)."""
    return isinstance(value, int) and not isinstance(value, bool)


def engine_kwargs(cfg: EngineConfig, model: str = "", *, trust_remote_code: bool = False) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments; ``trust_remote_code`` is ``run.trust_remote_code``."""
    dtype = checkpoint_dtype(model) if cfg.dtype == "auto" else cfg.dtype
    kwargs = {
        "max_model_len": cfg.max_model_len,
        "gpu_memory_utilization": cfg.memory_fraction,
        "max_num_seqs": cfg.max_num_seqs,
        "dtype": dtype,
        "enforce_eager": cfg.enforce_eager,
        "seed": cfg.seed,
        "tensor_parallel_size": cfg.tensor_parallel_size,
        "trust_remote_code": trust_remote_code,
        **revision_kwargs(model),  # run.target_revision: a hub id's revision and tokenizer_revision
    }
    if dtype == "float32" and is_mla_checkpoint(model) and not has_cuda():
        # On a CPU with AMX, vLLM picks its AMX MLA backend, whose weight packing takes bf16 / fp16
        # only: a float32 MLA target fails at engine start. The reference CPU MLA backend runs it.
        kwargs["attention_backend"] = "CPU_MLA"
    return kwargs


def is_mla_checkpoint(model: str) -> bool:
    """Whether a local checkpoint's config.json declares multi-head latent attention (DeepSeek's
    ``kv_lora_rank``, at the top or in its ``text_config``)."""
    path = Path(model) / "config.json" if model else None
    if path is None or not path.is_file():
        return False
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError):
        return False  # the engine reports a broken config itself
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    return cfg.get("kv_lora_rank") is not None or text.get("kv_lora_rank") is not None


def make_llm(model: str, cfg: EngineConfig, *, trust_remote_code: bool = False, key: str = "run.target",
             where: str = "engine", **extra: Any):
    """A ``vllm.LLM`` for ``model``; ``extra`` adds e.g. ``speculative_config``. What the engine would
    refuse only once started is refused first (:func:`check_engine_target`), in one line naming ``key``
    (how the user gave ``model``: ``run.target``, a command's ``--model``) or a setting of ``where`` (the
    engine's section, ``ingest.engine``: ``ingest.engine.max_model_len``); so are vLLM's own refusals of
    its settings and weights of other shapes than config.json says that vLLM itself finds (an engine in
    this process)."""
    cfg.check(where)  # a section's engine was checked under its own name; one built in code is checked here
    check_engine_target(model, cfg.max_model_len, trust_remote_code=trust_remote_code, key=key, where=where)
    require("vllm", "cpu" if not has_cuda() else "cuda")
    quiet_vllm()  # the run's vLLM log, written now that an engine starts (not when the command did)
    if "VLLM_CONFIGURE_LOGGING" not in os.environ:
        _set_env("VLLM_CONFIGURE_LOGGING", "1")
    from vllm import LLM

    kwargs = {**engine_kwargs(cfg, model, trust_remote_code=trust_remote_code), **extra}
    log.info("starting vLLM engine for %s", model)
    cuda = has_cuda()
    try:
        if cfg.uses_own_process(cuda=cuda):
            with cpu_all_cores(cfg.cpu_all_cores and not cuda):
                return _start(LLM, model, kwargs)
        if not cuda and "kv_cache_memory_bytes" not in kwargs and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            kwargs["kv_cache_memory_bytes"] = cpu_kv_cache_bytes(cfg.memory_fraction)
        with in_process_engine(cpu=not cuda):
            return _start(LLM, model, kwargs)
    except ValueError as exc:  # a hub checkpoint with its own code: vLLM reads its config in process
        too_long = TOO_LONG.search(str(exc))
        if too_long:  # found by vLLM's config check, before any weight is loaded
            raise ConfigError(f"{where}.max_model_len: {too_long[1]} is more than {model} has positions for "
                              f"({too_long[2]}); lower {where}.max_model_len") from None
        too_many = TOO_MANY_SEQS.search(str(exc))
        if too_many:  # vLLM's scheduler config check, before any weight is loaded
            raise ConfigError(f"{where}.max_num_seqs: {too_many[2]} is more than the {too_many[1]} tokens vLLM "
                              f"schedules a step (its max_num_batched_tokens); set {where}.max_num_seqs="
                              f"{too_many[1]} or less") from None
        if short_kv := kv_cache_problem(str(exc)):  # an engine in this process (vLLM's own: a RuntimeError)
            raise ConfigError(f"{where}.memory_fraction: {cfg.memory_fraction} leaves {short_kv} for one sequence "
                              f"of {where}.max_model_len {cfg.max_model_len} tokens; raise {where}.memory_fraction "
                              f"or lower {where}.max_model_len") from None
        if trust_remote_code or not is_refusal(exc):
            raise
        raise refusal(model) from None
    except (RuntimeError, AssertionError) as exc:  # engine-core start failures are RuntimeErrors too: kept
        if not weights_mismatch(exc):
            raise
        log.debug("vLLM could not load the weights of %s", model, exc_info=True)
        problem = one_line(exc) or "a tensor of another shape"
    # Raised here, past the except block, so vLLM's frames (its progress bar) are gone before the line is printed.
    raise ConfigError(f"{key}: {shown(model, extra)}: weights do not match config.json ({problem}); restore "
                      "the checkpoint's own config.json, or download the checkpoint again")


#: Signals whose Python handler raises an exception to interrupt the command (Ctrl-C, and the two
#: ``eaglenest.launch`` unwinds like it).
INTERRUPTS = ("SIGINT", "SIGTERM", "SIGHUP")


class Interrupts:
    """The interrupting signals whose handler ran inside :func:`interrupts_kept`."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, Any]] = []

    def deliver(self) -> None:
        """Run the first one's handler again: its exception (KeyboardInterrupt, ``Terminated``) is raised now."""
        if self.seen:
            signum, handler = self.seen[0]
            handler(signum, None)


class StartInterrupted(BaseException):
    """The interruption (``args[0]``: the ``KeyboardInterrupt`` or ``Terminated`` its handler raised) of
    the block of :func:`interrupts_kept`, carried through the code in it: not a ``KeyboardInterrupt``,
    so vLLM's engine start cannot swallow it, and not an ``Exception``, so no ``except Exception`` stops it."""


@contextlib.contextmanager
def interrupts_kept():
    """Record each interrupting signal (:data:`INTERRUPTS`) whose Python handler runs inside the
    block, in the :class:`Interrupts` it yields, and raise the ``KeyboardInterrupt`` its handler
    raises as a :class:`StartInterrupted`, which the block's ``except KeyboardInterrupt`` does not
    catch (:func:`_start` turns it back). In the main thread only (signals are handled nowhere else)."""
    interrupts = Interrupts()
    wrapped: dict[int, tuple[Any, Any]] = {}
    for name in INTERRUPTS:
        sig = getattr(signal, name, None)
        handler = signal.getsignal(sig) if sig is not None else None
        if not callable(handler):
            continue

        def record(signum, frame, handler=handler):
            interrupts.seen.append((signum, handler))
            try:
                handler(signum, frame)
            except KeyboardInterrupt as exc:
                raise StartInterrupted(exc) from None

        try:
            signal.signal(sig, record)
        except ValueError:  # not the main thread
            break
        wrapped[sig] = (handler, record)
    try:
        yield interrupts
    finally:
        for sig, (handler, record) in wrapped.items():
            if signal.getsignal(sig) is record:
                signal.signal(sig, handler)


def _start(LLM, model: str, kwargs: dict[str, Any]):
    """``LLM(model, **kwargs)``, interruptible at once. While an engine starts in its own processes,
    vLLM waits for their handshake inside ``vllm.utils.network_utils.zmq_socket_ctx``, which catches
    ``KeyboardInterrupt`` and only logs it: a Ctrl-C, or a SIGTERM/SIGHUP the CLI unwinds like one
    (``eaglenest.launch``), was dropped and the command went on (a whole ``ingest build`` after
    ``kill``). Inside the start it travels as a :class:`StartInterrupted`, which vLLM does not catch:
    its failed start ends the engine's processes (``MPClient``'s finalizer), and the interruption is
    raised here, without waiting for the engine to load its weights. One that something still
    swallowed is raised once the start returns, its engine closed first."""
    with interrupts_kept() as interrupts:
        try:
            llm = LLM(model=model, **kwargs)
        except StartInterrupted as exc:
            raise exc.args[0] from None
    if interrupts.seen:
        close_llm(llm)  # now, with this module's short grace, not by vLLM's finalizer at its own pace
        interrupts.deliver()
    return llm


#: How a user pins vLLM's CPU worker threads themselves (``engine.cpu_all_cores`` then does nothing).
CPU_THREAD_ENV = ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU")


@contextlib.contextmanager
def cpu_all_cores(on: bool):
    """While ``on``, vLLM's automatic CPU binding reserves no core for the frontend, so the CPU
    worker of the engine started inside this block gets every usable core. The engine-core process
    reads the setting when it is spawned; it is undone once the block ends."""
    if not on or any(k in os.environ for k in CPU_THREAD_ENV):
        yield
        return
    # Split-KV attention divides one sequence's keys among the threads: a decode step (one query)
    # and a verification step (k + 1 queries) then sum in different orders, and a greedy near-tie
    # can flip between the target alone and the target under speculation (1 of 111 outputs at 32K).
    # Unsplit, each query's sum has one order whatever the thread count: outputs identical again.
    added = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    if "VLLM_CPU_ATTN_SPLIT_KV" not in os.environ:
        added["VLLM_CPU_ATTN_SPLIT_KV"] = "0"
    os.environ.update(added)
    log.info("vLLM CPU worker on every usable core (engine.cpu_all_cores)")
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


def cpu_kv_cache_bytes(memory_fraction: float) -> int:
    """The KV cache of an in-process CPU engine: ``memory_fraction`` of the memory of the NUMA node
    vLLM's worker would run on. vLLM's CPU worker sizes its cache as that share minus its process's
    RSS, which in its own process is the worker (~0.6 GB on the tiny target) but in process would be
    everything the stage holds (a 1.2 GB share went negative beside a long-context ingest's 1.4 GB)."""
    from vllm.utils.cpu_resource_utils import get_allowed_cpu_list, get_memory_node_info

    node = get_allowed_cpu_list()[0].numa_node
    return math.ceil(get_memory_node_info(node).total_memory * memory_fraction)


#: vLLM's warnings at an in-process start that only say the engine shares this process (its kernels
#: registered again by a second engine, its own calls to the thread setter it has just disabled,
#: the global seed, whose state :func:`in_process_engine` puts back): dropped at those loggers.
NOISY_LOGGERS = ("triton_utils.dispatcher", "v1.worker.cpu_worker", "engine.arg_utils")
IN_PROCESS_NOISE = ("is already registered. Overwriting", "doesn't allow to use `torch.set_num_threads`",
                    "Since VLLM_ENABLE_V1_MULTIPROCESSING is set to False")


def _not_noise(record: logging.LogRecord) -> bool:
    msg = record.getMessage()
    return not any(n in msg for n in IN_PROCESS_NOISE)


@contextlib.contextmanager
def in_process_engine(*, cpu: bool):
    """Start the vLLM engine made inside this block in this process, and undo what its start does
    to the process beyond the engine: vLLM's CPU worker replaces ``torch.set_num_threads`` with a
    no-op (meant for its own bound worker process), the engine core seeds the global random
    generators, freezes the garbage collector's heap and caches vLLM's environment variables
    (later engines in the process would see today's values). On CPU, split-KV attention is turned
    off for the process (a user's own VLLM_CPU_ATTN_SPLIT_KV wins): with several threads it sums a
    decode step and a verification step in different orders, and a greedy near-tie could flip
    between the target alone and under speculation (see :func:`cpu_all_cores`). vLLM reads it at
    every step, so it stays set."""
    import numpy as np
    import torch
    from vllm import envs

    if cpu:
        os.environ.setdefault("VLLM_CPU_ATTN_SPLIT_KV", "0")
    saved_env = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    saved = (torch.set_num_threads, torch.get_rng_state(), np.random.get_state(), random.getstate())
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    envs.disable_envs_cache()
    loggers = [logging.getLogger(f"vllm.{name}") for name in NOISY_LOGGERS]
    for lg in loggers:
        lg.addFilter(_not_noise)
    try:
        yield
    finally:
        for lg in loggers:
            lg.removeFilter(_not_noise)
        if saved_env is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = saved_env
        torch.set_num_threads = saved[0]
        torch.set_rng_state(saved[1])
        np.random.set_state(saved[2])
        random.setstate(saved[3])
        gc.unfreeze()
        envs.disable_envs_cache()


#: Seconds :func:`close_llm` gives a stopping engine before vLLM kills its processes. vLLM's own
#: grace is 5 s, and on CPU an engine always used all of it (its worker takes ~3 s to leave, its
#: EngineCore longer), so every stage, evaluation pass and test engine waited 5 s for nothing: by
#: the time an engine is closed, everything it produced has been returned (a capture is flushed
#: first: ``featurestore.stream.producer``). vLLM kills the EngineCore and its worker with it, and
#: the resource tracker unlinks the shared memory they held (:func:`_tracker_reports_to`).
#: ``bench/engine_close.py`` measures both graces side by side.
ENGINE_STOP_GRACE_S = 1.0


def close_llm(llm, *, grace_s: float | None = ENGINE_STOP_GRACE_S) -> None:
    """Stop an engine's background processes now rather than at interpreter exit, giving them
    ``grace_s`` seconds (None: vLLM's default) before they are killed."""
    if llm is None:
        return
    try:
        llm.llm_engine.engine_core.shutdown(timeout=grace_s)
    except Exception:  # noqa: BLE001 - best effort; process exit cleans up as well
        log.debug("engine shutdown raised", exc_info=True)
