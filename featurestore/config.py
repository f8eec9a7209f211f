"""The ``featurestore`` section of a recipe."""

from __future__ import annotations

import dataclasses
import numbers
from typing import Literal

from eaglenest.config import short
from eaglenest.engine import EngineConfig, is_int
from eaglenest.errors import ConfigError
from eaglenest.featurestore.table.names import check_name


@dataclasses.dataclass(frozen=True, kw_only=True)
class FeaturestoreConfig:
    #: Aux layers in vLLM's convention; empty means vLLM's EAGLE-3 default (2, L//2, L-3).
    layer_ids: list[int] = dataclasses.field(default_factory=list)
    #: Samples per Lance commit (each commit is atomic; a killed capture resumes after the last).
    commit_every: int = 64
    #: Samples in the capture engine at once: a window refilled (in order) as requests finish.
    batch_size: int = 32
    #: MiB of hidden states held in memory while capturing: rows are written as a Lance fragment
    #: each time they reach it (committed together every ``commit_every`` samples), and the engine's
    #: window of samples in flight is cut to it. Peak memory is about 3x this, or 3x the largest sample.
    write_buffer_mb: float = 128
    #: Table that holds this feature set (one table per feature set; its identity is in the metadata).
    table: str = "features"
    #: "raw" keeps the target dtype bit-exactly; "fp8_e4m3" halves bf16 bytes (per-token scale, lossy).
    storage: Literal["raw", "fp8_e4m3"] = "raw"
    engine: EngineConfig = EngineConfig()

    def __post_init__(self) -> None:
        check_name(self.table)  # a table name is one identifier, never a path
        self.engine.check("featurestore.engine")
        if self.engine.in_process:  # the capture engine's connector needs vLLM's own processes
            raise ConfigError("featurestore.engine.in_process: capture runs its engine in vLLM's own processes; "
                              "set it to null (or false)")
        if any(isinstance(i, bool) or not isinstance(i, numbers.Integral) for i in self.layer_ids):
            raise ConfigError(f"featurestore.layer_ids: {short(list(self.layer_ids))} holds a value that is not a "
                              "whole number (vLLM layer ids)")
        dup = sorted({i for i in self.layer_ids if list(self.layer_ids).count(i) > 1})
        if dup:
            raise ConfigError(f"featurestore.layer_ids: duplicate ids {dup}; give distinct layers (vLLM convention)")
        if any(i < 0 for i in self.layer_ids):
            raise ConfigError("featurestore.layer_ids: ids are >= 0 (vLLM convention: 0 = embeddings output)")
        mb = self.write_buffer_mb
        if isinstance(mb, bool) or not isinstance(mb, numbers.Real) or not 0 < mb < float("inf"):
            raise ConfigError(f"featurestore.write_buffer_mb: must be a number of MiB > 0, "
                              f"got {short(self.write_buffer_mb)}")
        for key in ("commit_every", "batch_size"):  # each named: a bad one blamed on the other is a wrong fix
            if not is_int(getattr(self, key)):  # built in code, not from a recipe (whose walker checks types)
                raise ConfigError(f"featurestore.{key}: must be a whole number, got {short(getattr(self, key))}")
            if getattr(self, key) < 1:
                raise ConfigError(f"featurestore.{key}: must be >= 1 (samples), got {short(getattr(self, key))}")
