"""The ``serve`` recipe section: where the exported draft goes and how vLLM runs it."""

from __future__ import annotations

import dataclasses
import posixpath
from typing import Literal

from eaglenest.config import short
from eaglenest.engine import MAX_NUM_SPECULATIVE_TOKENS
from eaglenest.errors import ConfigError

#: Folders of run.workdir that servers write logs to, never a draft folder (``serve push`` would upload them).
LOG_DIRS = {"serve": "`serve up` and `evaluate throughput` write their server logs",
            "logs": "engine commands write vLLM's log"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServeConfig:
    #: Draft checkpoint to export, relative to run.workdir (train.output_subdir of the train stage).
    checkpoint_subdir: str = "train"
    #: vLLM-loadable draft directory, relative to run.workdir.
    draft_subdir: str = "draft"
    #: Weight dtype of the exported draft; "auto" = the target's torch_dtype.
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    #: "fp8": linears as float8_e4m3fn with per-output-channel fp32 scales (compressed-tensors
    #: format vLLM loads); norms, lm_head and the vocab maps stay at ``dtype``.
    quantization: Literal["none", "fp8"] = "none"
    #: "vllm": the ``LlamaForCausalLMEagle3`` directory (vLLM); "speculators": speculators'
    #: own Eagle-3 checkpoint (``speculators_config`` + ``transformer_layer_config``), which vLLM
    #: also serves directly (docs/serve.md, "Formats").
    format: Literal["vllm", "speculators"] = "vllm"
    #: Draft tokens per round ``serve up`` asks vLLM for; null: the exported draft's
    #: ``recommended_num_speculative_tokens`` (its family's best on the demo, docs/families.md). ``serve
    #: export`` records it as that default (null: the family's, eaglenest.train.config).
    num_speculative_tokens: int | None = None
    #: ``serve up`` listens here, as ``vllm serve`` does by default (port 0: any free port).
    host: str = "127.0.0.1"
    port: int = 8000
    #: Model name clients send; empty: the target's own name (run.target), vLLM's default.
    served_model_name: str = ""
    #: On CPU: fraction of the NUMA node's RAM reserved for the KV cache.
    gpu_memory_utilization: float = 0.15
    max_model_len: int = 2048
    #: ``serve push``: Hugging Face Hub repo ("namespace/name"), its visibility when created, and
    #: the branch to commit to (created when missing). The token comes from HF_TOKEN or the login.
    hub_repo_id: str = ""
    hub_visibility: Literal["private", "public"] = "private"
    hub_revision: str = "main"

    def __post_init__(self) -> None:
        for name in ("checkpoint_subdir", "draft_subdir"):
            value = getattr(self, name)
            if not value or value.startswith("/") or ".." in value.split("/"):
                raise ConfigError(f"serve.{name}: a relative path inside run.workdir, got {short(value)}")
            if posixpath.normpath(value) == ".":
                raise ConfigError(f"serve.{name}: a folder inside run.workdir, not run.workdir itself, "
                                  f"got {short(value)}")
        if posixpath.normpath(self.draft_subdir) in LOG_DIRS:
            raise ConfigError(f"serve.draft_subdir: {short(self.draft_subdir)} is where "
                              f"{LOG_DIRS[posixpath.normpath(self.draft_subdir)]}; choose another folder")
        draft, ckpt = (posixpath.normpath(v).split("/") for v in (self.draft_subdir, self.checkpoint_subdir))
        if draft[:len(ckpt)] == ckpt or ckpt[:len(draft)] == draft:
            raise ConfigError(f"serve.draft_subdir: {short(self.draft_subdir)} would overwrite the checkpoint "
                              f"(serve.checkpoint_subdir={short(self.checkpoint_subdir)}); choose another folder")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"serve.port: 0..65535, got {short(self.port)}")
        if not self.host or any(c.isspace() for c in self.host):
            raise ConfigError(f"serve.host: an address to listen on, got {short(self.host)}")
        if self.num_speculative_tokens is not None and self.num_speculative_tokens < 1:
            raise ConfigError("serve.num_speculative_tokens: must be >= 1 or null, "
                              f"got {short(self.num_speculative_tokens)}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"serve.gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_model_len < 16:
            raise ConfigError(f"serve.max_model_len: must be >= 16, got {short(self.max_model_len)}")
        most = min(MAX_NUM_SPECULATIVE_TOKENS, self.max_model_len - 1)
        if self.num_speculative_tokens is not None and self.num_speculative_tokens > most:
            raise ConfigError(f"serve.num_speculative_tokens: {short(self.num_speculative_tokens)} draft tokens a "
                              f"round; vLLM verifies at most {MAX_NUM_SPECULATIVE_TOKENS} a round, and they and the "
                              f"target's own token must fit serve.max_model_len ({self.max_model_len}); "
                              f"set at most {most}")
        if self.format == "speculators" and self.quantization != "none":
            raise ConfigError("serve.format: speculators checkpoints carry no quantised weights; "
                              "use serve.format=vllm with serve.quantization=fp8")
        if self.hub_repo_id:  # refused here too, so --dry-run says so (empty: `serve push` asks for one)
            check_repo_id(self.hub_repo_id)
        if not is_branch_name(self.hub_revision):  # refused before the Hub, where the repo would be made first
            raise ConfigError(f"serve.hub_revision: a branch name git accepts, got {short(self.hub_revision)}")


def is_branch_name(name: str) -> bool:
    """Whether git accepts ``name`` as a branch (``git check-ref-format --branch``'s rules): no
    whitespace, control or ``~^:?*[\\`` characters, no ``..``, ``@{`` or empty path component, no
    component starting with ``.`` or ending in ``.lock``, not starting with ``-`` or ending in ``.``, not ``HEAD``."""
    parts = name.split("/")
    return (bool(name) and name != "HEAD" and not name.startswith("-") and not name.endswith(".")
            and ".." not in name and "@{" not in name
            and not any(c.isspace() or ord(c) < 32 or ord(c) == 127 or c in "~^:?*[\\" for c in name)
            and all(p and not p.startswith(".") and not p.endswith(".lock") for p in parts))


def check_repo_id(repo_id: str) -> None:
    """``serve.hub_repo_id`` must be a Hub model id ("namespace/name"), as the Hub client validates one."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not repo_id:
        raise ConfigError("serve.hub_repo_id: set the Hub repo to push to, e.g. serve.hub_repo_id=me/my-draft")
    try:
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        raise ConfigError(f"serve.hub_repo_id: {exc}") from None
    if "/" not in repo_id:
        raise ConfigError(f"serve.hub_repo_id: 'namespace/name', got {repo_id!r}")
