"""The ``ingest`` section of a recipe."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

from eaglenest.config import short
from eaglenest.engine import EngineConfig
from eaglenest.errors import ConfigError
from eaglenest.ingest.backends import check_endpoints


#: Longest wait for one endpoint request, and for one retry's backoff (a day). Past about 9.2e9 s the
#: OS's timers overflow: every request raised OverflowError (a traceback), and a backoff that long
#: never ends either way.
MAX_WAIT_S = 86400.0

#: Upper bounds of the counts that become processes or threads on this machine: ``dask_workers`` starts
#: that many LocalCluster worker processes (each with its own engine), ``in_flight_per_endpoint`` that many
#: HTTP threads per server. Past them a typo (an extra zero or three) forks the machine to a halt.
MAX_DASK_WORKERS = 256
MAX_IN_FLIGHT_PER_ENDPOINT = 1024

#: transformers' own ``apply_chat_template`` arguments. Given as chat template variables they clash with
#: the ones every render passes (``tokenize``, ``add_generation_prompt``: a TypeError from ingest's and
#: evaluate's own renders, after the engine started) or change what is rendered rather than the template's
#: variables (``chat_template``, ``tools``). Kept in step with transformers by tests/common/test_targets_qa6.py.
TEMPLATE_CALL_ARGS = ("conversation", "tools", "documents", "chat_template", "add_generation_prompt",
                      "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
                      "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs")


def check_template_kwargs(kwargs: dict[str, Any], key: str) -> None:
    """Refuse (naming ``key``) chat template variables that are no variable names: a key that is not text,
    or one of transformers' own ``apply_chat_template`` arguments (:data:`TEMPLATE_CALL_ARGS`)."""
    for name in kwargs:
        if not isinstance(name, str):
            raise ConfigError(f"{key}: variable names are text, got {short(name)}")
        if name in TEMPLATE_CALL_ARGS:
            raise ConfigError(f"{key}: {name} is an argument of transformers' apply_chat_template, not a chat "
                              "template variable; remove it (eaglenest sets it for each render)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class IngestConfig:
    #: The domain manifest (YAML); `ingest build --manifest PATH` overrides it.
    manifest: str = "recipes/manifests/toy.yaml"
    #: Prompts per shard; each shard is one atomic commit, so a killed run resumes after the last one.
    #: In-process it does not limit the engine's batch (prompts stream across shards); under Dask a
    #: shard is one task, so make it several times the engine's ``max_num_seqs`` there.
    commit_every: int = 64
    #: Requests kept queued in the backend while streaming (0: 4 x ``engine.max_num_seqs`` for the
    #: in-process engine, 2 x the concurrent HTTP requests for endpoints).
    max_in_flight: int = 0
    engine: EngineConfig = EngineConfig()
    #: "vllm": an in-process engine; "endpoints": running OpenAI-compatible vLLM servers.
    backend: Literal["vllm", "endpoints"] = "vllm"
    #: Server base URLs (``http://127.0.0.1:8000``), data parallel; loopback unless allowed below.
    endpoints: list[str] = dataclasses.field(default_factory=list)
    allow_remote_endpoints: bool = False
    #: Name of the environment variable holding the servers' API key ("" = none). Never the key.
    api_key_env: str = ""
    #: Send the API key over plain http:// to a non-loopback endpoint (anyone on the path can read
    #: it); off: such a recipe is refused. Redirects are never followed with the key.
    allow_plaintext_api_key: bool = False
    request_timeout_s: float = 120.0
    max_retries: int = 3
    retry_backoff_s: float = 0.5
    in_flight_per_endpoint: int = 8
    #: "inprocess", or "dask": shards run as Dask tasks (retried elsewhere if a worker dies).
    executor: Literal["inprocess", "dask"] = "inprocess"
    #: Dask scheduler address (``tcp://host:8786``); "" starts a LocalCluster of ``dask_workers``.
    dask_scheduler: str = ""
    dask_workers: int = 2
    #: Extra variables for the target's chat template, e.g. ``{enable_thinking: true}``: sent with
    #: every chat request (local engine and endpoints) and used by ``evaluate``; part of the
    #: responses' ``gen_params_id``. The manifest's ``generation.reasoning`` on/off sets
    #: ``enable_thinking`` on top (a contradiction is refused). See ``ingest/reasoning.py``.
    chat_template_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: ``[open, close]`` think tags of a reasoning target; empty: a known pair found in the target's
    #: chat template or added tokens, else ``<think>`` / ``</think>``. Answers cut off by max_tokens
    #: inside an open think block are dropped and counted per domain.
    think_tags: list[str] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        """Validate at config time, naming the key, so a bad value fails before any engine starts."""
        self.engine.check("ingest.engine")
        for key, low in (("commit_every", 1), ("max_in_flight", 0), ("max_retries", 0),
                         ("in_flight_per_endpoint", 1), ("dask_workers", 1)):
            if getattr(self, key) < low:
                raise ConfigError(f"ingest.{key}: {getattr(self, key)} must be at least {low}")
        for key, high, unit in (("dask_workers", MAX_DASK_WORKERS, "worker process"),
                                ("in_flight_per_endpoint", MAX_IN_FLIGHT_PER_ENDPOINT, "thread")):
            if getattr(self, key) > high:
                raise ConfigError(f"ingest.{key}: {getattr(self, key)} is more than {high} (each is a {unit} "
                                  "on this machine)")
        if not (math.isfinite(self.request_timeout_s) and 0 < self.request_timeout_s <= MAX_WAIT_S):
            raise ConfigError(f"ingest.request_timeout_s: {self.request_timeout_s} must be a number in "
                              f"(0, {MAX_WAIT_S:g}]")
        if not (math.isfinite(self.retry_backoff_s) and self.retry_backoff_s >= 0):
            raise ConfigError(f"ingest.retry_backoff_s: {self.retry_backoff_s} must be a finite number >= 0")
        longest = self.retry_backoff_s * 2.0 ** min(max(self.max_retries - 1, 0), 1000)  # the last retry's wait
        if longest > MAX_WAIT_S:
            raise ConfigError(f"ingest.retry_backoff_s: the last of {self.max_retries} retries would wait "
                              f"{longest:.3g} s (retry_backoff_s * 2**(max_retries - 1)), more than {MAX_WAIT_S:g} s; "
                              "lower ingest.retry_backoff_s or ingest.max_retries")
        check_template_kwargs(self.chat_template_kwargs, "ingest.chat_template_kwargs")
        if self.think_tags and (len(self.think_tags) != 2 or not all(self.think_tags)
                                or self.think_tags[0] == self.think_tags[1]):
            raise ConfigError(f"ingest.think_tags: two different, non-empty tags [open, close], "
                              f"got {short(self.think_tags)}")
        if self.backend == "endpoints":
            if not self.endpoints:
                raise ConfigError("ingest.endpoints: at least one URL is required for backend 'endpoints'")

            check_endpoints(self.endpoints, allow_remote=self.allow_remote_endpoints,
                            key_sent=bool(self.api_key_env), allow_plaintext=self.allow_plaintext_api_key)
