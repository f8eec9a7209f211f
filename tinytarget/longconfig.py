"""The long-context tiny target's configuration: ``LongConfig``, its curriculum stages and phases, and
the recipe file (``recipes/tiny_target/long.yaml``) that sets them. The build is ``tinytarget.long``."""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from pathlib import Path

from eaglenest.config import load_yaml
from eaglenest.errors import ConfigError
from eaglenest.tinytarget import longdata, longeval, train

#: Held-out material of the build's own measurement (the tiny target's held-out seed).
EVAL_MATERIAL_SEED = 7919
#: Shortest stage rows (a ``repeat`` stage is cheap at 256 tokens; the long kinds need more).
MIN_STAGE_TOKENS = 128
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json")
#: Of TOKENIZER_FILES, the ones a --base must have (the others are copied where present).
REQUIRED_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True, kw_only=True)
class Stage:
    seq_len_tokens: int
    batch_size: int
    num_steps: int
    #: > 0: pack several prompts of this many tokens per row (``longdata.long_row``).
    sample_tokens: int = 0
    #: Row kinds of this stage, round-robin (empty: the build's ``row_kinds``).
    kinds: tuple[str, ...] = ()


#: The training settings a phase of a recipe may set (the rest belong to the whole build).
PHASE_KEYS = ("stages", "skip_fraction", "answer_weight", "token_weight", "raw_fraction", "peak_lr",
              "min_lr_ratio", "warmup_steps", "weight_decay", "adam_beta2", "row_kinds")


@dataclass(frozen=True, kw_only=True)
class Phase:
    """One training phase of a recipe: its name and the settings (``PHASE_KEYS``) it changes from
    the build's; each phase has its own optimizer and learning-rate schedule."""
    name: str
    settings: tuple[tuple[str, object], ...] = ()


@dataclass(frozen=True, kw_only=True)
class LongConfig:
    base: str = "assets/tiny-target"
    seed: int = 1
    rope_theta: float = 1e6
    max_positions: int = 32768
    #: The best recipe measured so far (docs/long_context.md, run D): not yet competent at length.
    stages: tuple[Stage, ...] = (Stage(seq_len_tokens=1024, batch_size=4, num_steps=150, sample_tokens=340),)
    #: Fraction of rows whose positions skip a gap (PoSE), reaching up to ``max_positions``.
    skip_fraction: float = 0.5
    answer_weight: float = 4.0
    #: Weight of the mean loss over all tokens (0: the answer tokens alone, as run M's copy stages).
    token_weight: float = 1.0
    raw_fraction: float = 0.25
    peak_lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.01
    #: AdamW's second-moment decay (run M, the first copy circuit, used 0.98).
    adam_beta2: float = 0.95
    num_threads: int = 1
    eval_prompts_per_bucket: int = 4
    #: Short held-out chats (corpus seed EVAL_MATERIAL_SEED) scored to show short quality is kept.
    num_held_out: int = 400
    eval_buckets: tuple[int, ...] = longeval.BUCKETS
    #: Kinds of training rows, round-robin (``longdata``; ``copy`` is opt in).
    row_kinds: tuple[str, ...] = longdata.ROW_KINDS
    #: Phases run one after another on the same model (empty: one phase of the settings above).
    phases: tuple[Phase, ...] = ()
    #: The recipe file the configuration came from (provenance and the card's rebuild line).
    recipe: str = ""
    #: Resume: train from this phase on, ``base`` being the output of the phases before it (the
    #: prompts' seeds and positions are those the whole build would give, so the result is the same).
    from_phase: str = ""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):  # a NaN passes every comparison below
            value = getattr(self, field.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{field.name}: must be a finite number, got {value}")
        if not 0 <= self.seed < train.MAX_SEED:
            raise ConfigError(f"seed: must be in [0, 2**63), got {self.seed}")
        if self.from_phase and self.from_phase not in [p.name for p in self.phases]:
            raise ConfigError(f"from_phase: {self.from_phase!r} is not a phase of the recipe "
                              f"({', '.join(p.name for p in self.phases) or 'it has none'})")
        for phase in self.phases:
            unknown = sorted(k for k, _ in phase.settings if k not in PHASE_KEYS)
            if unknown:
                raise ConfigError(f"phase {phase.name!r}: {', '.join(unknown)} cannot change within a build "
                                  f"(a phase may set {', '.join(PHASE_KEYS)})")
            try:
                self.phase_config(phase)
            except ConfigError as exc:
                raise ConfigError(f"phase {phase.name!r}: {exc}") from None
        for kinds in (self.row_kinds, *(s.kinds for s in self.stages if s.kinds)):
            if not kinds or not all(longdata.known_kind(k) for k in kinds):
                raise ConfigError(f"row_kinds: each of {', '.join(longdata.ALL_KINDS)} or repeatN (N >= 2 "
                                  f"tokens), got {', '.join(kinds)}")
        if not self.stages or any(s.num_steps < 1 or s.batch_size < 1 or s.seq_len_tokens < MIN_STAGE_TOKENS
                                  or s.seq_len_tokens > self.max_positions for s in self.stages):
            raise ConfigError("stages: each stage needs num_steps >= 1, batch_size >= 1 and "
                              f"{MIN_STAGE_TOKENS} <= seq_len_tokens <= {self.max_positions}")
        for s in self.stages:
            if s.sample_tokens and not (0 < s.sample_tokens < s.seq_len_tokens
                                        and s.seq_len_tokens // s.sample_tokens <= longdata.MAX_PACKED):
                raise ConfigError(f"stages: {format_stages((s,))}: packed prompt tokens must be under the row's "
                                  f"{s.seq_len_tokens} and leave at most {longdata.MAX_PACKED} prompts per row")
        self._check_evaluation()
        if not 0.0 <= self.skip_fraction <= 1.0:
            raise ConfigError(f"skip_fraction: must be in [0, 1], got {self.skip_fraction}")
        if self.token_weight < 0 or self.answer_weight < 0 or self.token_weight + self.answer_weight <= 0:
            raise ConfigError(f"token_weight / answer_weight: must be >= 0 and not both 0, got "
                              f"{self.token_weight} / {self.answer_weight}")
        if self.weight_decay < 0:
            raise ConfigError(f"weight_decay: must be >= 0, got {self.weight_decay}")
        if not 0.0 <= self.adam_beta2 < 1.0:
            raise ConfigError(f"adam_beta2: must be in [0, 1), got {self.adam_beta2}")
        if self.warmup_steps < 0:
            raise ConfigError(f"warmup_steps: must be >= 0, got {self.warmup_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"min_lr_ratio: must be in [0, 1], got {self.min_lr_ratio}")
        if self.rope_theta <= 0:
            raise ConfigError(f"rope_theta: must be > 0, got {self.rope_theta}")
        if self.peak_lr <= 0:
            raise ConfigError(f"peak_lr: must be > 0, got {self.peak_lr:g}")
        if not 0.0 <= self.raw_fraction <= 1.0:
            raise ConfigError(f"raw_fraction: must be in [0, 1], got {self.raw_fraction}")

    def _check_evaluation(self) -> None:
        for key in ("eval_prompts_per_bucket", "num_held_out"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key}: must be >= 1, got {getattr(self, key)}")
        if not self.eval_buckets or min(self.eval_buckets) < 1:
            raise ConfigError(f"eval_buckets: token counts >= 1, got {show_setting(self.eval_buckets) or 'none'}")
        twice = sorted({b for b in self.eval_buckets if self.eval_buckets.count(b) > 1})
        if twice:
            raise ConfigError(f"eval_buckets: {', '.join(map(str, twice))} twice")
        if max(self.eval_buckets) > self.max_positions:  # measured at max_positions, labelled as asked
            raise ConfigError(f"eval_buckets: {max(self.eval_buckets)} is over max_positions {self.max_positions}")

    @property
    def num_steps(self) -> int:
        return sum(s.num_steps for s in self.stages)

    def phase_config(self, phase: Phase) -> "LongConfig":
        """This build's configuration with ``phase``'s settings (one phase, no phases inside)."""
        return dataclasses.replace(self, phases=(), from_phase="", **dict(phase.settings))

    def training_phases(self) -> list[tuple[str, "LongConfig"]]:
        """``(name, configuration)`` of each phase to train, in order."""
        if not self.phases:
            return [("train", self)]
        return [(ph.name, self.phase_config(ph)) for ph in self.phases]


def parse_stages(text: str) -> tuple[Stage, ...]:
    """``"256x8x500:repeat,1024x4x600x340"``: tokens x rows x steps [x packed prompt tokens] per
    stage, optionally ``:KIND+KIND...`` (that stage's row kinds, round-robin)."""
    try:
        stages = []
        for part in text.split(","):
            dims, _, kinds = part.partition(":")
            a, b, c, *d = (int(x) for x in dims.split("x"))
            if len(d) > 1 or (_ and not kinds):
                raise ValueError(part)
            stages.append(Stage(seq_len_tokens=a, batch_size=b, num_steps=c, sample_tokens=d[0] if d else 0,
                                kinds=tuple(kinds.split("+")) if kinds else ()))
        return tuple(stages)
    except ValueError:
        raise ConfigError(f"--stages: expected TOKENSxROWSxSTEPS[xPACKED][:KIND+...][,...], got {text!r}") from None


def format_stages(stages) -> str:
    """The ``--stages`` text of ``stages`` (``parse_stages``' inverse)."""
    return ",".join(f"{s.seq_len_tokens}x{s.batch_size}x{s.num_steps}" + (f"x{s.sample_tokens}" if s.sample_tokens else "")
                    + (":" + "+".join(s.kinds) if s.kinds else "") for s in stages)


#: Keys of a recipe file besides PHASE_KEYS and ``phases``.
RECIPE_KEYS = ("base", "seed", "rope_theta", "max_positions", "eval_prompts_per_bucket", "eval_buckets",
               "num_held_out")


#: Recipe keys whose values are whole numbers.
INT_KEYS = ("seed", "max_positions", "eval_prompts_per_bucket", "num_held_out", "warmup_steps")


def _setting(key: str, value, where: str):
    """A recipe value as LongConfig holds it (stages parsed, lists as tuples)."""
    if key == "stages":
        if not isinstance(value, str):
            raise ConfigError(f"{where}stages: expected text like 128x32x500:repeat64,512x8x400, got {value!r}")
        return parse_stages(value)
    if key in ("row_kinds", "eval_buckets"):
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, list) or not items:
            raise ConfigError(f"{where}{key}: expected a list, got {value!r}")
        if key == "row_kinds":
            return tuple(str(x) for x in items)
        if not all(isinstance(x, int) and not isinstance(x, bool) or isinstance(x, str) and x.strip().isdigit()
                   for x in items):
            raise ConfigError(f"{where}eval_buckets: expected token counts, got {value!r}")
        return tuple(int(x) for x in items)
    if key == "base":
        if not isinstance(value, str):
            raise ConfigError(f"{where}base: expected a model folder, got {value!r}")
        return value
    wanted = int if key in INT_KEYS else (int, float)
    if isinstance(value, bool) or not isinstance(value, wanted):
        raise ConfigError(f"{where}{key}: expected {'a whole number' if key in INT_KEYS else 'a number'}, got {value!r}")
    return value


def load_recipe(path: str | Path) -> dict:
    """LongConfig's keyword arguments from a recipe YAML: build keys (``RECIPE_KEYS``), training
    settings shared by every phase (``PHASE_KEYS``) and ``phases``, a list of ``{name, ...settings}``."""
    data = load_yaml(path)  # refuses anything but a mapping at the top
    unknown = sorted(k for k in data if k not in (*RECIPE_KEYS, *PHASE_KEYS, "phases"))
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {', '.join(unknown)} (known: {', '.join((*RECIPE_KEYS, *PHASE_KEYS, 'phases'))})")
    kwargs = {k: _setting(k, v, f"{path}: ") for k, v in data.items() if k != "phases"}
    phases = data.get("phases") or []
    if not isinstance(phases, list):
        raise ConfigError(f"{path}: phases: expected a list of mappings")
    out = []
    for i, ph in enumerate(phases):
        if not isinstance(ph, dict):
            raise ConfigError(f"{path}: phases[{i}]: expected a mapping with a name and settings")
        name = str(ph.get("name", f"phase{i + 1}"))
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):  # --phase-dir saves it as DIR/NAME
            raise ConfigError(f"{path}: phases[{i}]: name {name!r}: letters, digits, '.', '_' and '-' only "
                              "(it names the phase's folder under --phase-dir)")
        settings = {k: v for k, v in ph.items() if k != "name"}
        bad = sorted(k for k in settings if k not in PHASE_KEYS)
        if "stages" not in settings:
            raise ConfigError(f"{path}: phase {name!r}: no stages (each phase names its own curriculum)")
        if bad:
            raise ConfigError(f"{path}: phase {name!r}: {', '.join(bad)} cannot change within a build "
                              f"(a phase may set {', '.join(PHASE_KEYS)})")
        out.append(Phase(name=name, settings=tuple((k, _setting(k, v, f"{path}: phase {name!r}: "))
                                                  for k, v in settings.items())))
    if len({p.name for p in out}) != len(out):
        raise ConfigError(f"{path}: phases: names must differ")
    return {**kwargs, "phases": tuple(out), "recipe": str(path)}


def show_setting(value) -> str:
    """A phase setting as the card prints it (stages in ``--stages`` form)."""
    if isinstance(value, tuple) and value and isinstance(value[0], Stage):
        return format_stages(value)
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return f"{value:g}" if isinstance(value, float) else str(value)
