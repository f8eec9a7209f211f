"""The ``train`` recipe section: one flat, frozen, keyword-only dataclass.

Defaults make the toy recipe (tiny target, hidden 128, vocab 2048) train in a few CPU minutes.
Every check names the key to change.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from eaglenest.config import short
from eaglenest.errors import ConfigError
from eaglenest.runconfig import SEED_RANGE


@dataclasses.dataclass(frozen=True, kw_only=True)
class DraftShapeConfig:
    """``train.draft``: explicit draft layer sizes (0 = the rule, see eaglenest.train.model.draft_shape)."""

    intermediate_size: int = 0
    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    head_dim: int = 0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ConfigError(f"train.draft.{f.name}: an integer >= 0 (0 = the sizing rule), got {short(v)}")

    def shape(self):
        from eaglenest.train.model import DraftShape

        return DraftShape(**dataclasses.asdict(self))


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    #: Rows of the draft lm_head: the most frequent target ids among loss tokens.
    draft_vocab_size: int = 1024
    #: Unrolled TTT steps per position (vLLM drafts this many tokens well at most).
    ttt_steps: int = 7
    #: Weight of step k's loss is step_decay ** k.
    step_decay: float = 0.8
    #: Peak AdamW learning rate, reached after warmup_steps, then cosine to lr * min_lr_ratio.
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.0
    #: Clip the global gradient norm to this value (0 = no clipping).
    grad_clip: float = 1.0
    #: Passes over the training rows; num_steps > 0 stops earlier.
    num_epochs: int = 4
    num_steps: int = 0
    #: Samples are packed into rows of at most pack_tokens tokens (longer samples are truncated);
    #: batch_rows rows make one optimizer step.
    pack_tokens: int = 512
    batch_rows: int = 4
    #: None: use run.seed. Seeds the init, the sample order and packing.
    seed: int | None = None
    #: EAGLE-3.1 options (vLLM reads them from the exported config.json).
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_before_residual: bool = False
    norm_output: bool = False
    #: Features table version (number or tag) to train on; None = latest, pinned in provenance.
    table_version: int | str | None = None
    #: Rows of the features table with this split value are trained on.
    split: str = "train"
    #: Outputs go to <run.workdir>/<output_subdir>/.
    output_subdir: str = "train"
    log_every_steps: int = 10
    #: torch intra-op threads per rank (the machines running the toy have 2 cores).
    num_threads: int = 2
    #: "auto": continue from <output_subdir>/state/ if it holds a state of the same recipe and
    #: table version (refused, naming the difference, otherwise); "never": start over.
    resume: Literal["auto", "never"] = "auto"
    #: Write the full training state every this many steps (0 = only at the end); keep the last N.
    state_every_steps: int = 25
    keep_states: int = 2
    #: Served-AL checkpoint selection: every N steps (0 = off) export the draft, serve it with vLLM
    #: on select_prompts_per_domain prompts per domain of select_split, keep the best by served AL.
    select_every_steps: int = 0
    select_prompts_per_domain: int = 4
    select_split: str = "heldout"
    #: Batches read ahead by the loader thread (per rank).
    prefetch_batches: int = 2
    #: "table": the features table; "stream": hidden states from a live capture engine (recipe's
    #: featurestore section), no table (docs/featurestore.md, "Streaming bypass"). One rank only.
    source: Literal["table", "stream"] = "table"
    #: train.source=stream: most captures in flight between the engine and the trainer.
    stream_depth: int = 8
    #: train.source=stream: CUDA_VISIBLE_DEVICES of the capture engine ("" = inherit the trainer's).
    stream_devices: str = ""
    #: train.source=stream: "unix": one engine child of a single-rank trainer, same host; "gloo":
    #: every torchrun rank fed by stream_engines engines started with `featurestore stream-serve`
    #: on any host, over a gloo group of their own (docs/featurestore.md, "Across hosts").
    stream_transport: Literal["unix", "gloo"] = "unix"
    stream_engines: int = 1
    #: stream_transport=gloo: host:port of the stream's TCPStore, hosted by trainer rank 0. It has
    #: no authentication: use an address on a private interface.
    stream_addr: str = ""
    #: stream_transport=gloo: longest wait for a peer (engine start, a paused trainer) before the
    #: job fails; a dead peer fails it at once (its connection closes).
    stream_timeout_s: float = 1800.0
    #: FSDP2 mixed precision on CUDA (parameters; gradients reduce in fp32). CPU runs stay fp32.
    param_dtype: Literal["float32", "bfloat16"] = "bfloat16"
    #: Attention is computed in query chunks of this many tokens (with recomputation in backward)
    #: for rows longer than it, so activation memory grows ~linearly with sequence length.
    attn_chunk_tokens: int = 2048
    #: The draft's attention sees only the last N positions (0 = all; "auto" = the longest training
    #: sample, capped at pack_tokens). Exported as a sliding-window layer that vLLM honours, so a
    #: draft trained on short samples never meets, at long context, an attention span it was not
    #: trained on (docs/training.md; measured in BENCHMARKS.md).
    sliding_window: int | Literal["auto"] = 0
    #: Start the draft's lm_head from the target's lm_head rows of the draft vocabulary ("target")
    #: instead of at random ("random"), and its final norm from the target's final norm instead of
    #: ones: served AL 2.37 instead of 1.42 after 2 epochs of the demo (BENCHMARKS.md, "Learning curves").
    init_lm_head: Literal["random", "target"] = "target"
    #: Tokens whose target top-1 is outside the draft vocabulary: "keep" trains on the target's
    #: distribution restricted to the draft vocabulary and renormalised; "drop" leaves them out of
    #: the loss (SpecForge's rule). Measured side by side in BENCHMARKS.md, "Learning curves".
    oov_positions: Literal["keep", "drop"] = "keep"
    init_norm: Literal["ones", "target"] = "target"
    #: Draft attention/MLP sizes; 0 keeps the rule for the target's architecture (dense: the
    #: target's own; MLA: v_head_dim heads, at most 64; MoE: MLP 1.75 x hidden). docs/targets.md.
    draft: DraftShapeConfig = dataclasses.field(default_factory=DraftShapeConfig)
    #: Batches with more positions (rows x tokens) than this compute the target's next-token
    #: distribution and the draft's loss over its vocabulary in chunks of this many positions, so
    #: full-vocabulary logits never exist for the whole batch (152K-200K target vocabularies;
    #: docs/training.md, "Large vocabularies"). 0 = never chunk.
    target_chunk_tokens: int = 2048

    def __post_init__(self) -> None:
        if self.target_chunk_tokens < 0:
            raise ConfigError(f"train.target_chunk_tokens: must be >= 0 (0 = off), got {short(self.target_chunk_tokens)}")
        positive = ("draft_vocab_size", "ttt_steps", "pack_tokens", "batch_rows", "num_epochs",
                    "log_every_steps", "num_threads", "keep_states", "select_prompts_per_domain",
                    "prefetch_batches", "attn_chunk_tokens", "stream_depth", "stream_engines")
        for name in ("step_decay", "lr", "min_lr_ratio", "weight_decay", "grad_clip"):
            if not math.isfinite(getattr(self, name)):  # NaN would pass every comparison below
                raise ConfigError(f"train.{name}: must be a finite number")
        if self.sliding_window != "auto" and self.sliding_window < 0:
            raise ConfigError(f"train.sliding_window: must be >= 0 or 'auto', got {short(self.sliding_window)}")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"train.{name}: must be >= 1, got {short(getattr(self, name))}")
        for name in ("warmup_steps", "num_steps", "weight_decay", "grad_clip", "state_every_steps",
                     "select_every_steps"):
            if getattr(self, name) < 0:
                raise ConfigError(f"train.{name}: must be >= 0, got {short(getattr(self, name))}")
        if not self.lr > 0:
            raise ConfigError(f"train.lr: must be > 0, got {self.lr}")
        if not 0 < self.step_decay <= 1:
            raise ConfigError(f"train.step_decay: must be in (0, 1], got {self.step_decay}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"train.min_lr_ratio: must be in [0, 1], got {self.min_lr_ratio}")
        # Both would fail only once training starts: numpy's generator refuses a negative seed, and
        # Lance versions are unsigned 64-bit numbers.
        if self.seed is not None and self.seed not in SEED_RANGE:
            raise ConfigError(f"train.seed: must be in [0, 2**63) or null, got {short(self.seed)}")
        if isinstance(self.table_version, int) and not 0 <= self.table_version < 2**63:
            raise ConfigError("train.table_version: a version number >= 0 or a tag, "
                              f"got {short(self.table_version)}")
        if self.init_lm_head not in ("random", "target"):
            raise ConfigError(f"train.init_lm_head: 'random' or 'target', got {short(self.init_lm_head)}")
        if self.oov_positions not in ("keep", "drop"):
            raise ConfigError(f"train.oov_positions: 'keep' or 'drop', got {short(self.oov_positions)}")
        if self.init_norm not in ("ones", "target"):
            raise ConfigError(f"train.init_norm: 'ones' or 'target', got {short(self.init_norm)}")
        if self.source not in ("table", "stream"):
            raise ConfigError(f"train.source: 'table' or 'stream', got {short(self.source)}")
        if self.stream_transport not in ("unix", "gloo"):
            raise ConfigError(f"train.stream_transport: 'unix' or 'gloo', got {short(self.stream_transport)}")
        if not (math.isfinite(self.stream_timeout_s) and self.stream_timeout_s > 0):
            raise ConfigError(f"train.stream_timeout_s: a number of seconds > 0, got {short(self.stream_timeout_s)}")
        if self.source == "stream" and self.stream_transport == "gloo":
            from eaglenest.featurestore.stream_xhost import parse_addr

            parse_addr(self.stream_addr)  # names train.stream_addr
        if not self.output_subdir or "/" in self.output_subdir or self.output_subdir.startswith("."):
            raise ConfigError(f"train.output_subdir: a plain directory name, got {short(self.output_subdir)}")

    def flags(self):
        from eaglenest.train.model import DraftFlags

        return DraftFlags(norm_before_fc=self.norm_before_fc, fc_norm=self.fc_norm,
                          norm_before_residual=self.norm_before_residual, norm_output=self.norm_output)
