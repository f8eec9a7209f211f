"""The ``evaluate`` section of a recipe: what to decode, how long, and the throughput sweep."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from eaglenest.config import short
from eaglenest.engine import MAX_NUM_SPECULATIVE_TOKENS, MAX_TEMPERATURE, EngineConfig
from eaglenest.errors import ConfigError
from eaglenest.ingest.config import check_template_kwargs
from eaglenest.runconfig import home_expanded

#: Context buckets of the issue: prompt lengths in tokens (1K .. 32K).
DEFAULT_BUCKETS = (1024, 2048, 4096, 8192, 16384, 32768)
#: Kinds of context-bucket material (``evaluate.buckets``, ``evaluate.longctx``): answers that need
#: a record, a helper's name or the first turn thousands of tokens back, or (``chat``) unrelated
#: held-out chats concatenated.
Material = Literal["records", "code", "recall", "chat"]
#: A bucket with fewer prompts than this is reported as "not a measurement".
MIN_BUCKET_PROMPTS = 16


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvaluateConfig:
    #: Exported draft directory; empty means ``<workdir>/<serve.draft_subdir>``.
    draft: str = ""
    #: Draft tokens per round; null: the draft's ``recommended_num_speculative_tokens`` (its family's
    #: best on the demo, docs/families.md), resolved by ``evaluate.settings.evaluate_config``.
    num_speculative_tokens: int | None = None
    temperature: float = 0.0
    max_tokens: int = 160
    #: Which prompts: the store's own split, MT-Bench or SPEED-Bench (published formats).
    prompt_set: Literal["heldout", "mt_bench", "speed_bench"] = "heldout"
    #: For mt_bench / speed_bench: a local file or directory, or a hub dataset id.
    prompt_path: str = ""
    #: SPEED-Bench config (``qualitative`` or ``throughput_1k`` ...) and split.
    speed_bench_config: str = "qualitative"
    hub_split: str = "test"
    #: Drop evaluation prompts whose normalised content matches a training prompt (reported).
    exclude_overlap: bool = True
    #: Prompts drawn from the store's prompts table with this split (prompt_set=heldout).
    split: str = "heldout"
    #: At most this many prompts per domain / category (0 = all).
    max_prompts_per_domain: int = 0
    #: Context buckets (prompt tokens); empty disables them. ``bucket_prompts`` prompts each (the
    #: report flags a bucket with fewer than 16 as not a measurement; ``recipes/long_eval.yaml`` has
    #: 16), prompt i of kind ``bucket_material[i % len]``.
    context_buckets: tuple[int, ...] = DEFAULT_BUCKETS
    bucket_prompts: int = 1
    bucket_max_tokens: int = 64
    bucket_material: tuple[Material, ...] = ("records", "code", "recall", "chat")
    #: 95% intervals per bucket: percentile bootstrap over prompts, this many resamples (seeded by
    #: ``engine.seed``).
    bootstrap_resamples: int = 2000
    #: How much the target uses far context: its probability of its own first
    #: ``far_context_probe_tokens`` output tokens with only the last ``far_context_keep_tokens``
    #: prompt tokens kept vs the whole prompt (needs ``check_lossless``; 0 keeps turn it off).
    far_context_keep_tokens: int = 512
    far_context_probe_tokens: int = 8
    #: Also score the generated material's reference answers (records / code / recall) on their
    #: value tokens with the far part kept and removed (``farctx.answer_probes``): a short prefill and
    #: one request per answer token reading the prompt from the prefix cache, per such prompt.
    far_context_answers: bool = True
    #: Also decode without speculation and report whether outputs are token-for-token identical.
    check_lossless: bool = True
    #: Predictability from the drafter's side (``evaluate.ngram``): the AL an n-gram table fitted on
    #: the training split reaches on the same outputs; order 0 turns it off. The fit stops after
    #: ``ngram_fit_tokens`` loss tokens (0: all).
    ngram_order: int = 3
    ngram_fit_tokens: int = 2_000_000
    #: Throughput sweep (``evaluate throughput``): concurrency levels, seeds, prompts, output length.
    concurrency: tuple[int, ...] = (1, 4, 16)
    throughput_seeds: tuple[int, ...] = (0, 1)
    throughput_prompts: int = 16
    throughput_max_tokens: int = 48
    #: ``evaluate parity``: the first ``parity_prompts`` prompts of the prompt set (across its groups)
    #: decoded ``parity_max_tokens`` tokens each; the check passes when, at every draft position, at
    #: least ``parity_min_identical`` of vLLM's proposals equal the trained checkpoint's (fp near-ties
    #: may flip a few; a skewed export parts at most rounds).
    parity_prompts: int = 16
    parity_max_tokens: int = 64
    parity_min_identical: float = 0.99
    engine: EngineConfig = EngineConfig()
    #: Extra chat-template variables for every prompt decoded (``{enable_thinking: true}``). null: the
    #: ones ingest rendered the training prompts with (``ingest.chat_template_kwargs`` and the
    #: manifest's ``generation.reasoning``), so AL is measured in the mode the draft was trained on.
    chat_template_kwargs: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.engine.check("evaluate.engine")
        for key in ("draft", "prompt_path"):  # `~/drafts/d`: as run.workdir, no shell expands it in a recipe
            object.__setattr__(self, key, home_expanded(getattr(self, key)))
        if self.chat_template_kwargs is not None:
            check_template_kwargs(self.chat_template_kwargs, "evaluate.chat_template_kwargs")
        if self.num_speculative_tokens is not None and self.num_speculative_tokens < 1:
            raise ConfigError("evaluate.num_speculative_tokens: must be >= 1 or null, "
                              f"got {short(self.num_speculative_tokens)}")
        most = min(MAX_NUM_SPECULATIVE_TOKENS, self.engine.max_model_len - 1)
        if self.num_speculative_tokens is not None and self.num_speculative_tokens > most:
            raise ConfigError(f"evaluate.num_speculative_tokens: {short(self.num_speculative_tokens)} draft tokens a "
                              f"round; vLLM verifies at most {MAX_NUM_SPECULATIVE_TOKENS} a round, and they and the "
                              "target's own token must fit evaluate.engine.max_model_len "
                              f"({self.engine.max_model_len}); set at most {most}")
        if self.prompt_set != "heldout" and not self.prompt_path:
            raise ConfigError(f"evaluate.prompt_path: required for prompt_set={self.prompt_set} "
                              "(a local file/directory or a hub dataset id)")
        if any(b < 16 for b in self.context_buckets):
            raise ConfigError("evaluate.context_buckets: lengths must be >= 16 tokens, "
                              f"got {short(self.context_buckets)}")
        if any(c < 1 for c in self.concurrency) or not self.concurrency:
            raise ConfigError(f"evaluate.concurrency: positive integers, got {short(self.concurrency)}")
        if not self.throughput_seeds:
            raise ConfigError("evaluate.throughput_seeds: at least one seed (the sweep measures each point per seed)")
        for key in ("context_buckets", "concurrency"):  # a repeat would be built or measured again under one key
            values = getattr(self, key)
            if len(set(values)) != len(values):
                raise ConfigError(f"evaluate.{key}: {sorted({v for v in values if values.count(v) > 1})} "
                                  f"given more than once, got {short(values)}")
        if self.ngram_order < 0 or self.ngram_fit_tokens < 0:
            raise ConfigError("evaluate.ngram_order / evaluate.ngram_fit_tokens: must be >= 0")
        if not self.bucket_material or len(set(self.bucket_material)) != len(self.bucket_material):
            raise ConfigError("evaluate.bucket_material: one or more distinct kinds (records, code, recall, "
                              f"chat), got {short(self.bucket_material)}")
        if self.bootstrap_resamples < 100:
            raise ConfigError(f"evaluate.bootstrap_resamples: must be >= 100, got {short(self.bootstrap_resamples)}")
        if self.far_context_keep_tokens < 0 or self.far_context_probe_tokens < 1:
            raise ConfigError("evaluate.far_context_keep_tokens / evaluate.far_context_probe_tokens: must be "
                              f">= 0 / >= 1, got {self.far_context_keep_tokens} / {self.far_context_probe_tokens}")
        if self.parity_prompts < 1 or self.parity_max_tokens < 1:
            raise ConfigError("evaluate.parity_prompts / evaluate.parity_max_tokens: must be >= 1, "
                              f"got {short(self.parity_prompts)} / {short(self.parity_max_tokens)}")
        if not 0.0 < self.parity_min_identical <= 1.0:
            raise ConfigError("evaluate.parity_min_identical: a share in (0, 1], "
                              f"got {short(self.parity_min_identical)}")
        if self.bucket_prompts < 1 or self.throughput_prompts < 1:
            raise ConfigError("evaluate.bucket_prompts / evaluate.throughput_prompts: must be >= 1")
        # What vLLM's SamplingParams refuses only once an engine runs: max_tokens >= 1, temperature in [0, 2].
        for key in ("max_tokens", "bucket_max_tokens", "throughput_max_tokens"):
            if getattr(self, key) < 1:
                raise ConfigError(f"evaluate.{key}: must be >= 1, got {short(getattr(self, key))}")
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:  # NaN fails too
            raise ConfigError(f"evaluate.temperature: must be in [0, {MAX_TEMPERATURE:g}], "
                              f"got {short(self.temperature)}")
        if self.max_prompts_per_domain < 0:
            raise ConfigError(f"evaluate.max_prompts_per_domain: must be >= 0 (0: all), "
                              f"got {short(self.max_prompts_per_domain)}")
