"""The ``train`` recipe section: frozen, keyword-only dataclasses, flat for the core, nested by topic.

The optimiser, schedule, batching and draft options are flat (``train.lr``, ``train.pack_tokens``);
the keys that only matter together sit in their own section: ``train.draft`` (layer sizes),
``train.stream`` (the capture stream of ``train.source=stream``), ``train.select`` (served-AL
checkpoint selection), ``train.state`` (resume and the training state) and ``train.track`` (where
the training curves go: TensorBoard, W&B, trackio). A key of the earlier flat
layout (``train.stream_depth``) is refused with one line naming its new place (:data:`RENAMED`).
``train.family`` picks the draft trained from the table (EAGLE-3, P-EAGLE with ``train.peagle``, or
DFlash with ``train.dflash``).

Defaults make the toy recipe (tiny target, hidden 128, vocab 2048) train in a few CPU minutes.
Every check names the key to change.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import ClassVar, Literal

from eaglenest.config import short
from eaglenest.errors import ConfigError
from eaglenest.featurestore.stream.addr import MAX_DEPTH as STREAM_MAX_DEPTH  # stdlib only: cheap at recipe load
from eaglenest.featurestore.stream.addr import MAX_TIMEOUT_S as STREAM_MAX_TIMEOUT_S
from eaglenest.featurestore.stream.addr import parse_addr
from eaglenest.runconfig import SEED_RANGE
from eaglenest.train.spec import DraftFlags, DraftShape

#: Keys of the flat layout (before the nested sections) -> their dotted place under ``train``.
#: The recipe loader refuses the old name with one line naming the new one.
RENAMED = {
    "stream_depth": "stream.depth",
    "stream_devices": "stream.devices",
    "stream_transport": "stream.transport",
    "stream_engines": "stream.engines",
    "stream_addr": "stream.addr",
    "stream_timeout_s": "stream.timeout_s",
    "select_every_steps": "select.every_steps",
    "select_prompts_per_domain": "select.prompts_per_domain",
    "select_split": "select.split",
    "resume": "state.resume",
    "state_every_steps": "state.every_steps",
    "keep_states": "state.keep",
}


#: The largest ``train.draft.head_dim``: the largest head size of vLLM's attention backends (its CPU
#: backend's; FlashAttention stops at 256).
MAX_HEAD_DIM = 512

#: The largest ``train.sliding_window``: vLLM's attention kernels take the window as a 32-bit integer
#: (a larger one also overflowed the trainer's int64 mask arithmetic at 2**63).
MAX_WINDOW = 2**31 - 1

#: The largest float32 (torch.finfo(torch.float32).max): AdamW casts the step size into the weights'
#: type, and a train.lr past it raised torch's overflow RuntimeError at the first step.
FLOAT32_MAX = 3.4028234663852886e38


def _at_least(section: str, obj, names: tuple[str, ...], low: int) -> None:
    for name in names:
        if getattr(obj, name) < low:
            raise ConfigError(f"train.{section}{name}: must be >= {low}, got {short(getattr(obj, name))}")


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
        if self.head_dim % 2:  # rotary embeddings rotate pairs of dimensions
            raise ConfigError(f"train.draft.head_dim: an even number (rotary embeddings), or 0 for the sizing rule, "
                              f"got {self.head_dim}")
        if self.head_dim > MAX_HEAD_DIM:  # past it vLLM serves no such head, and the projections fill the memory
            raise ConfigError(f"train.draft.head_dim: at most {MAX_HEAD_DIM} (the largest attention head vLLM "
                              f"serves), or 0 for the sizing rule, got {self.head_dim}")

    def shape(self) -> DraftShape:
        return DraftShape(**dataclasses.asdict(self))




@dataclasses.dataclass(frozen=True, kw_only=True)
class StreamConfig:
    """``train.stream``: the live capture engine of ``train.source=stream`` (docs/featurestore.md,
    "Streaming bypass"); ignored by ``train.source=table``."""

    #: Most captures in flight between the engine and the trainer.
    depth: int = 8
    #: CUDA_VISIBLE_DEVICES of the capture engine ("" = inherit the trainer's).
    devices: str = ""
    #: "unix": one engine child of a single-rank trainer, same host; "gloo": every torchrun rank fed
    #: by ``engines`` engines started with `featurestore stream-serve` on any host, over a gloo group
    #: of their own (docs/featurestore.md, "Across hosts").
    transport: Literal["unix", "gloo"] = "unix"
    engines: int = 1
    #: transport=gloo: host:port of the stream's TCPStore, hosted by trainer rank 0. It has no
    #: authentication: use an address on a private interface.
    addr: str = ""
    #: transport=gloo: longest wait for a peer (engine start, a paused trainer) before the job
    #: fails; a dead peer fails it at once (its connection closes).
    timeout_s: float = 1800.0

    def __post_init__(self) -> None:
        _at_least("stream.", self, ("depth", "engines"), 1)
        if self.depth > STREAM_MAX_DEPTH:  # credits are bytes on a socket: a grant past its buffer deadlocked
            raise ConfigError(f"train.stream.depth: {self.depth} captures in flight is more than the "
                              f"{STREAM_MAX_DEPTH} the stream can grant: lower it")
        if self.transport not in ("unix", "gloo"):
            raise ConfigError(f"train.stream.transport: 'unix' or 'gloo', got {short(self.transport)}")
        # Past a year the stream's Group refused it, but only once the ranks had started (its timedelta holds it).
        if not (math.isfinite(self.timeout_s) and 0 < self.timeout_s <= STREAM_MAX_TIMEOUT_S):
            raise ConfigError(f"train.stream.timeout_s: a number of seconds > 0 and at most {STREAM_MAX_TIMEOUT_S:.0f} "
                              f"(a year), got {short(self.timeout_s)}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SelectConfig:
    """``train.select``: served-AL checkpoint selection. Every ``every_steps`` steps (0 = off) export
    the draft, serve it with vLLM on ``prompts_per_domain`` prompts per domain of ``split``, keep the
    best by served AL (docs/training.md, "Checkpoint selection by served AL")."""

    every_steps: int = 0
    prompts_per_domain: int = 4
    split: str = "heldout"

    def __post_init__(self) -> None:
        _at_least("select.", self, ("every_steps",), 0)
        _at_least("select.", self, ("prompts_per_domain",), 1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StateConfig:
    """``train.state``: the full training state in ``<output_subdir>/state/`` and resuming from it."""

    #: "auto": continue from the latest state if it holds a state of the same recipe and table
    #: version (refused, naming the difference, otherwise); "never": start over.
    resume: Literal["auto", "never"] = "auto"
    #: Write the state every this many steps (0 = only at the end); keep the last ``keep``.
    every_steps: int = 25
    keep: int = 2

    def __post_init__(self) -> None:
        if self.resume not in ("auto", "never"):
            raise ConfigError(f"train.state.resume: 'auto' or 'never', got {short(self.resume)}")
        _at_least("state.", self, ("every_steps",), 0)
        _at_least("state.", self, ("keep",), 1)


TRACKERS = ("none", "wandb", "trackio")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrackConfig:
    """``train.track``: where the training curves go (docs/trackers.md). Rank 0 reports each
    metrics.jsonl record (every ``train.log_every_steps`` steps) and each served AL at the global step.
    Whether a named tracker is installed is checked when ``train run`` starts (eaglenest.train.track)."""

    #: TensorBoard event files in ``dir``.
    tensorboard: bool = True
    #: Their folder: relative to the run's output folder (``<run.workdir>/<train.output_subdir>/``) or
    #: absolute. It belongs to the run: a fresh start empties it of event files, a resume cuts them
    #: back to the resumed step.
    dir: str = "tensorboard"
    #: Also report to Weights & Biases ("wandb") or trackio ("trackio"); each is an optional package.
    tracker: Literal["none", "wandb", "trackio"] = "none"
    #: The tracker's project; the run's name ("" = the name of run.workdir's folder).
    project: str = "eaglenest"
    run_name: str = ""
    #: wandb only: "online" syncs as it trains; "offline" keeps the run in ``<outdir>/wandb/``
    #: (``wandb sync`` uploads it later). trackio always writes its local store.
    mode: Literal["online", "offline"] = "online"

    def __post_init__(self) -> None:
        if self.tracker not in TRACKERS:
            raise ConfigError(f"train.track.tracker: {', '.join(map(repr, TRACKERS))}, got {short(self.tracker)}")
        if self.mode not in ("online", "offline"):
            raise ConfigError(f"train.track.mode: 'online' or 'offline', got {short(self.mode)}")
        if self.tensorboard and not self.dir:
            raise ConfigError("train.track.dir: a folder for the event files (or train.track.tensorboard=false)")
        if self.tensorboard and os.path.normpath(self.dir) in RUN_OUTPUTS:
            raise ConfigError(f"train.track.dir: {short(self.dir)} is where the run keeps its own "
                              f"{os.path.normpath(self.dir)} in its output folder; name another folder")
        if self.tracker != "none" and not self.project:
            raise ConfigError("train.track.project: the tracker's project name, got ''")


#: What a training run writes in its output folder besides the event files: ``train.track.dir`` naming one
#: put event files among the resume states (or where a file is) and a fresh start's sweep among them.
RUN_OUTPUTS = frozenset({"state", "select", "wandb", "metrics.jsonl", "checkpoint.json", "draft.safetensors",
                         "report.json", "report.png", "provenance.json"})


#: ``train.family`` values: the draft trained from the features table.
FAMILIES = ("eagle3", "peagle", "dflash")

#: The number of speculative tokens a draft of each family is served with when the recipe sets none
#: (``serve.num_speculative_tokens`` / ``evaluate.num_speculative_tokens`` null): the K of the
#: family's highest measured speed-up on the demo (EAGLE-3 1.34x at 3 vs 1.18x at 6; P-EAGLE 2.84x
#: at 3 vs 2.16x at 4; DFlash, block 8, 2.63x at 7, its best AL: bench/families.py, docs/families.md).
#: ``serve export`` writes it into the draft's config.json, capped at the depth it was trained for.
BEST_NUM_SPECULATIVE_TOKENS = {"eagle3": 3, "peagle": 3, "dflash": 7}


def trained_num_speculative_tokens(train: dict) -> int:
    """The tokens a round a draft trained with ``train`` (the ``train`` section as a dict, as a
    checkpoint's ``train_config`` records it) was trained to draft: EAGLE-3 ``ttt_steps``; P-EAGLE
    ``peagle.num_slots``; DFlash ``dflash.block_size`` - 1. Past it a draft proposes from positions it
    never learnt (``serve export`` records it; engine.speculative_config warns beyond it)."""
    family = train.get("family") or "eagle3"
    trained = {"eagle3": lambda: train.get("ttt_steps", TrainConfig.ttt_steps),
               "peagle": lambda: (train.get("peagle") or {}).get("num_slots", PEagleConfig.num_slots),
               "dflash": lambda: (train.get("dflash") or {}).get("block_size", DFlashConfig.block_size) - 1}
    if family not in trained:
        raise ConfigError(f"train.family: {', '.join(map(repr, FAMILIES))}, got {short(family)}")
    return max(1, int(trained[family]()))


def recommended_num_speculative_tokens(train: dict) -> int:
    """The K to serve a draft trained with ``train``: its family's measured best, at most
    :func:`trained_num_speculative_tokens`."""
    family = train.get("family") or "eagle3"
    return min(trained_num_speculative_tokens(train), BEST_NUM_SPECULATIVE_TOKENS[family])


@dataclasses.dataclass(frozen=True, kw_only=True)
class PEagleConfig:
    """``train.peagle``: the parallel-drafting objective of ``train.family=peagle`` (P-EAGLE: vLLM
    drafts every token of a round in one forward; eaglenest.train.peagle, docs/training.md "Draft
    families"). Ignored by the other families."""

    #: Tokens a round drafts, depth 0 included: the largest num_speculative_tokens it is trained for.
    num_slots: int = 4
    #: Positions per packed row that get the depth >= 1 slots (drawn per row and step; depth 0 is
    #: trained at every position, as EAGLE-3's first step). Memory grows with anchors x (num_slots - 1).
    anchors_per_row: int = 64
    #: The token id vLLM feeds at depth >= 1 (exported as ``mask_token_id``); null = the first of the
    #: target's pad_token_id and eos_token_id(s) inside its vocabulary. Any id of the target's vocabulary works: its
    #: embedding is the target's, frozen, and the learned ``mask_hidden`` carries the slot.
    mask_token_id: int | None = None

    def __post_init__(self) -> None:
        _at_least("peagle.", self, ("num_slots",), 2)
        _at_least("peagle.", self, ("anchors_per_row",), 1)
        if self.mask_token_id is not None and (isinstance(self.mask_token_id, bool) or self.mask_token_id < 0):
            raise ConfigError(f"train.peagle.mask_token_id: a token id >= 0 or null, got {short(self.mask_token_id)}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DFlashConfig:
    """``train.dflash``: the block drafter of ``train.family=dflash`` (Qwen3-style layers over the
    target's aux features, one forward per round; eaglenest.train.dflash, docs/training.md "Draft
    families"). Ignored by the other families."""

    #: Draft decoder layers (each a full Qwen3 layer with the target's attention/MLP shape, or
    #: ``train.draft.*``'s); the layers share one ``k_norm`` (vLLM 0.32 on CPU applies layer 0's
    #: to every layer's context keys: docs/serve.md). More than 1 trains in one process for now.
    num_layers: int = 2
    #: Slots per block: the real token plus block_size - 1 mask slots, the largest
    #: num_speculative_tokens the draft is trained for (vLLM's V1 ignores the exported block_size
    #: and drafts num_speculative_tokens mask slots). 8: served AL 4.10 at K=7 on the demo, vs 3.04
    #: (K=3) and 3.24 (K=4, one slot past training) with 4, for twice the training time
    #: (docs/families.md, "Figures").
    block_size: int = 8
    #: Anchors (blocks) per packed row, drawn per row and step. Memory grows with anchors x block_size.
    anchors_per_row: int = 32
    #: The token id of the mask slots (exported as ``dflash_config.mask_token_id``); null = the
    #: first of the target's pad_token_id and eos_token_id(s) inside its vocabulary. Its embedding is the target's, frozen.
    mask_token_id: int | None = None

    def __post_init__(self) -> None:
        _at_least("dflash.", self, ("num_layers", "anchors_per_row"), 1)
        _at_least("dflash.", self, ("block_size",), 2)
        if self.mask_token_id is not None and (isinstance(self.mask_token_id, bool) or self.mask_token_id < 0):
            raise ConfigError(f"train.dflash.mask_token_id: a token id >= 0 or null, got {short(self.mask_token_id)}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    #: Read by the recipe loader (eaglenest.config.build): old flat keys -> their new place.
    RENAMED_KEYS: ClassVar[dict[str, str]] = RENAMED

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
    #: Rows are filled to this many tokens (0: pack_tokens); a sample longer than it gets a row of its
    #: own, up to pack_tokens. With a few long samples among many short ones (the long recipe), short
    #: rows keep the optimizer steps an epoch of short samples needs while the long ones stay whole.
    row_tokens: int = 0
    #: None: use run.seed. Seeds the init, the sample order and packing.
    seed: int | None = None
    #: EAGLE-3.1 options (vLLM reads them from the exported config.json).
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_before_residual: bool = False
    norm_output: bool = False
    #: "table": the features table (local or on an object store); "stream": hidden states from a
    #: live capture engine (``train.stream``, the recipe's featurestore section), no table
    #: (docs/featurestore.md, "Streaming bypass").
    source: Literal["table", "stream"] = "table"
    #: Features table version (number or tag) to train on; None = latest, pinned in provenance.
    table_version: int | str | None = None
    #: Rows of the features table (or prompts, for the stream) with this split value are trained on.
    split: str = "train"
    #: Batches read ahead by the loader thread (per rank).
    prefetch_batches: int = 2
    #: Outputs go to <run.workdir>/<output_subdir>/.
    output_subdir: str = "train"
    log_every_steps: int = 10
    #: torch intra-op threads per rank (the machines running the toy have 2 cores); at most the CPUs
    #: the process may use, checked when training starts (2 always runs).
    num_threads: int = 2
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
    #: Batches with more positions (rows x tokens) than this compute the target's next-token
    #: distribution and the draft's loss over its vocabulary in chunks of this many positions, so
    #: full-vocabulary logits never exist for the whole batch (152K-200K target vocabularies;
    #: docs/training.md, "Large vocabularies"). 0 = never chunk.
    target_chunk_tokens: int = 2048
    #: Ranks each packed row's tokens are split over (context parallelism, eaglenest.train.context_parallel;
    #: docs/training.md, "Context parallelism"): 1 = off. The world size must be a multiple of it;
    #: ranks in groups of this many share rows, the groups split the batch's rows (data parallel).
    context_parallel: int = 1
    #: Draft attention/MLP sizes; 0 keeps the rule for the target's architecture (dense: the
    #: target's own; MLA: v_head_dim heads, at most 64; MoE: MLP 1.75 x hidden). docs/targets.md.
    draft: DraftShapeConfig = dataclasses.field(default_factory=DraftShapeConfig)
    stream: StreamConfig = dataclasses.field(default_factory=StreamConfig)
    select: SelectConfig = dataclasses.field(default_factory=SelectConfig)
    state: StateConfig = dataclasses.field(default_factory=StateConfig)
    #: The draft to train from the same features table: "eagle3" (TTT, one draft forward per
    #: token), "peagle" (parallel drafting: all tokens of a round in one forward, ``train.peagle``),
    #: "dflash" (a block drafter over the target's features, one forward, ``train.dflash``).
    #: docs/training.md, "Draft families".
    family: Literal["eagle3", "peagle", "dflash"] = "eagle3"
    peagle: PEagleConfig = dataclasses.field(default_factory=PEagleConfig)
    dflash: DFlashConfig = dataclasses.field(default_factory=DFlashConfig)
    track: TrackConfig = dataclasses.field(default_factory=TrackConfig)

    def __post_init__(self) -> None:
        for name in ("step_decay", "lr", "min_lr_ratio", "weight_decay", "grad_clip"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):  # "1e-3" from code: no recipe walker
                raise ConfigError(f"train.{name}: must be a number, got {short(value)}")
            if not math.isfinite(value):  # NaN would pass every comparison below
                raise ConfigError(f"train.{name}: must be a finite number")
        if self.sliding_window != "auto" and self.sliding_window < 0:
            raise ConfigError(f"train.sliding_window: must be >= 0 or 'auto', got {short(self.sliding_window)}")
        if self.sliding_window != "auto" and self.sliding_window > MAX_WINDOW:
            raise ConfigError(f"train.sliding_window: at most {MAX_WINDOW} positions (vLLM's attention takes a "
                              f"32-bit window), 0 for none or 'auto', got {short(self.sliding_window)}")
        if self.draft_vocab_size < 2:  # one token: its softmax is 1 whatever the draft computes, the loss 0
            raise ConfigError(f"train.draft_vocab_size: must be >= 2 (a draft vocabulary of one token has a loss "
                              f"of 0 and learns nothing), got {short(self.draft_vocab_size)}")
        _at_least("", self, ("ttt_steps", "pack_tokens", "batch_rows", "num_epochs",
                             "log_every_steps", "num_threads", "prefetch_batches", "attn_chunk_tokens"), 1)
        _at_least("", self, ("warmup_steps", "num_steps", "weight_decay", "grad_clip", "target_chunk_tokens"), 0)
        _at_least("", self, ("context_parallel",), 1)
        _at_least("", self, ("row_tokens",), 0)
        if self.pack_tokens < 3:  # every family's first prediction at t is x_{t+2}: 3 tokens of a row at least
            raise ConfigError("train.pack_tokens: must be >= 3 (the first prediction at position t is token t+2: "
                              f"shorter rows train nothing), got {self.pack_tokens}")
        if self.row_tokens > self.pack_tokens:
            raise ConfigError(f"train.row_tokens: {self.row_tokens} exceeds train.pack_tokens={self.pack_tokens} "
                              "(the longest row); lower it, or 0 to fill rows to pack_tokens")
        if self.context_parallel > 1 and (self.family != "eagle3" or self.source != "table"):
            raise ConfigError(f"train.context_parallel={self.context_parallel}: only train.family=eagle3 with "
                              f"train.source=table splits rows over ranks yet, got family={self.family}, "
                              f"source={self.source}: set train.context_parallel=1")
        if not self.lr > 0:
            raise ConfigError(f"train.lr: must be > 0, got {self.lr}")
        if self.lr > FLOAT32_MAX:
            raise ConfigError(f"train.lr: at most {FLOAT32_MAX:.2g} (the largest float32, the weights' type), "
                              f"got {self.lr:g}")
        if self.lr * self.weight_decay >= 1:  # AdamW scales each weight by 1 - lr x weight_decay a step
            raise ConfigError(f"train.weight_decay: {self.weight_decay:g} x train.lr={self.lr:g} is "
                              f"{self.lr * self.weight_decay:g}, >= 1: AdamW would zero or flip every weight "
                              "each step; lower it")
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
        for name, choices in (("init_lm_head", ("random", "target")), ("oov_positions", ("keep", "drop")),
                              ("init_norm", ("ones", "target")), ("source", ("table", "stream"))):
            if getattr(self, name) not in choices:
                raise ConfigError(f"train.{name}: {' or '.join(map(repr, choices))}, got {short(getattr(self, name))}")
        if self.family not in FAMILIES:
            raise ConfigError(f"train.family: {', '.join(map(repr, FAMILIES))}, got {short(self.family)}")
        if self.family == "dflash" and self.sliding_window not in (0, "auto"):
            # "auto" (the demo recipe's) means no window for DFlash: train.loop.attention_span.
            raise ConfigError(f"train.sliding_window: must be 0 or 'auto' for train.family=dflash (its layers attend "
                              f"to the whole context), got {short(self.sliding_window)}")
        if self.family == "dflash":
            self._refuse_eagle31_flags()
        if self.family == "peagle" and self.pack_tokens > self.attn_chunk_tokens:
            raise ConfigError(f"train.family=peagle: rows of pack_tokens={self.pack_tokens} exceed "
                              f"attn_chunk_tokens={self.attn_chunk_tokens}; the P-EAGLE objective has no "
                              "query chunking yet: lower train.pack_tokens")
        depth = {"eagle3": ("ttt_steps", self.ttt_steps), "peagle": ("peagle.num_slots", self.peagle.num_slots),
                 "dflash": ("dflash.block_size", self.dflash.block_size)}[self.family]
        if depth[1] > self.pack_tokens:  # slots past a packed row: no target, and A x depth mask rows
            raise ConfigError(f"train.{depth[0]}: {depth[1]} is more than a packed row holds "
                              f"(train.pack_tokens={self.pack_tokens}); its slots past the row never have a target")
        if self.source == "stream" and self.family != "eagle3":
            # Not yet shown to train P-EAGLE or DFlash from a live engine (no test): refused, not guessed.
            raise ConfigError(f"train.family={self.family}: the streaming bypass (train.source=stream) trains "
                              "train.family=eagle3 only for now; capture to the table (train.source=table)")
        if self.source == "stream" and self.stream.transport == "gloo":
            parse_addr(self.stream.addr)  # names train.stream.addr
        if not self.output_subdir or "/" in self.output_subdir or self.output_subdir.startswith("."):
            raise ConfigError(f"train.output_subdir: a plain directory name, got {short(self.output_subdir)}")

    def _refuse_eagle31_flags(self) -> None:
        """A DFlash draft is Qwen3-style layers with no EAGLE-3.1 norms: a flag set there was not trained
        (and checkpoint.json's draft_config would record it as if it were)."""
        for name, on in dataclasses.asdict(self.flags()).items():
            if on:
                raise ConfigError(f"train.{name}: an EAGLE-3.1 option of train.family=eagle3 or peagle; a DFlash "
                                  f"draft has no such norm: set train.{name}=false")

    def flags(self) -> DraftFlags:
        return DraftFlags(norm_before_fc=self.norm_before_fc, fc_norm=self.fc_norm,
                          norm_before_residual=self.norm_before_residual, norm_output=self.norm_output)
