"""The ``run`` section: where a run lives and which target it serves."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

from eaglenest.config import short
from eaglenest.errors import ConfigError
from eaglenest.paths import shown_path
from eaglenest.target import pin_revision

#: Seeds feed numpy (>= 0) and torch (< 2**64); this range suits both, with room for seed + epoch.
SEED_RANGE = range(0, 2**63)

#: Object stores a store URI may name (``run.store``); anything else with ``://`` is refused.
REMOTE_SCHEMES = ("s3", "gs", "az")
#: Characters Lance reads as URL syntax in an object-store URI (a query, a fragment, an escape), so
#: its files would land under another key than pyarrow's side files: refused in a store URI.
URL_SYNTAX = "?#%"
#: ``run.storage_options`` keys that hold credentials: only ``${ENV_VAR}`` references are accepted
#: there, so a resolved recipe (provenance, --dry-run, checkpoints) never holds a secret.
SECRET_KEY = re.compile(r"secret|token|password|passwd|credential|access_key|account_key|master_key|sas_|private_key|"
                        r"client_secret|session", re.IGNORECASE)
_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
#: A shell variable in a path (``$HOME``, ``${USER}``): nothing expands it in a recipe.
_SHELL_VAR = re.compile(r"\$\{?[A-Za-z_]")
#: This process's storage options by store URI: references, never secrets. Filled where a command
#: resolves its recipe (:meth:`RunConfig.register_storage`, called by ``eaglenest.launch.execute``), and
#: in a process that did not (a Dask task) from the options its driver sends it explicitly
#: (:func:`registered_storage_options`). Nothing goes through the environment: torchrun ranks and
#: other commands a run starts resolve the same recipe themselves.
_STORAGE_OPTIONS: dict[str, dict[str, str]] = {}


def _is_file(path: str) -> bool:
    """Whether ``path`` is a regular file; False for any path the system refuses to look at (too long,
    a NUL byte: the stage's own path check names those)."""
    try:
        return Path(path).is_file()
    except (OSError, ValueError):
        return False


def home_expanded(path: str) -> str:
    """``path`` with a leading ``~`` or ``~user`` expanded as a shell would: the shell leaves
    ``run.workdir=~/runs/x`` as typed (it is no variable assignment), and Lance and vLLM take ``~``
    literally. Left as typed where it cannot be (an unknown user: the stage's path check names it)."""
    if not path.startswith("~"):
        return path
    try:
        return os.path.expanduser(path)
    except (ValueError, RuntimeError):  # a NUL byte: the stage's path check names it too
        return path


def check_no_shell_variable(key: str, path: str) -> None:
    """Refuse ``run.<key>`` holding ``$VAR`` / ``${VAR}``: a shell expands it on a command line, but in a
    recipe it would be taken literally (a folder named '${HOME}' in the current directory)."""
    if _SHELL_VAR.search(path):
        raise ConfigError(f"run.{key}: {short(path)} holds an environment variable, which a recipe does not "
                          f"expand; write the path out (on a command line, the shell expands run.{key}=$VAR/...)")


def register_storage_options(store_uri: str, options: dict[str, str]) -> None:
    """Remember ``options`` for every path under ``store_uri`` (in this process)."""
    _STORAGE_OPTIONS[store_uri.rstrip("/")] = dict(options)


def registered_storage_options() -> dict[str, dict[str, str]]:
    """A copy of what this process registered, to hand to a worker process explicitly."""
    return {uri: dict(options) for uri, options in _STORAGE_OPTIONS.items()}


def storage_options_for(uri: str) -> dict[str, str]:
    """Lance/pyarrow storage options for ``uri``: those registered for the longest store URI it is
    under, ``${VAR}`` references resolved from the environment now (never stored resolved)."""
    text = uri.rstrip("/")
    best = max((k for k in _STORAGE_OPTIONS if text == k or text.startswith(k + "/")), key=len, default=None)
    if best is None:
        return {}
    out = {}
    for key, value in _STORAGE_OPTIONS[best].items():
        def env(m, key=key):
            if m.group(1) not in os.environ:
                raise ConfigError(f"run.storage_options.{key}: environment variable {m.group(1)} is not set")
            return os.environ[m.group(1)]

        out[key] = _REF.sub(env, value)
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class TargetKeys:
    """Names of the target tensors the draft needs, in the target's safetensors. Empty: found from
    the config and the weight map (nested language towers of multimodal checkpoints included)."""

    embed: str = ""
    norm: str = ""
    lm_head: str = ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    #: Directory for every output of this run (store, checkpoints, draft, reports).
    workdir: str = "runs/toy"
    #: Target model: a local Hugging Face directory (the tiny target by default) or a hub id.
    target: str = "assets/tiny-target"
    #: The revision (branch, tag or commit) of a target named by hub id that every loader and engine reads;
    #: empty: the local Hugging Face cache's ``main``. A local folder has none.
    target_revision: str = ""
    #: LanceDB directory of the feature store; empty means ``<workdir>/store``. Also an object
    #: store: ``s3://bucket/prefix``, ``gs://...``, ``az://...`` (docs/storage.md).
    store: str = ""
    #: Lance storage options of an object store (``aws_endpoint``, ``aws_region``, ``allow_http``,
    #: ...). Credentials stay in the environment (AWS_ACCESS_KEY_ID, ...) or are referenced as
    #: ``${ENV_VAR}``; a literal secret is refused, so no resolved recipe ever holds one.
    storage_options: dict[str, str | bool | int] = dataclasses.field(default_factory=dict)
    seed: int = 0
    #: Run the target's own Python code (``auto_map`` in its config / tokenizer_config), as
    #: transformers' and vLLM's ``trust_remote_code`` do. Off by default: only for checkpoints you trust.
    trust_remote_code: bool = False
    #: Override where the draft finds the target's embeddings, final norm and lm_head.
    target_keys: TargetKeys = TargetKeys()
    #: The prompts table records which target generated its responses; capture and train refuse
    #: another target unless this says the data is meant to be off-policy.
    off_policy: bool = False

    def __post_init__(self) -> None:
        if not self.workdir.strip():  # "" would put the run's store and outputs in the current directory
            raise ConfigError("run.workdir: must not be empty (a directory for this run's outputs, e.g. runs/toy)")
        if not self.target.strip():  # "" would be read as the current directory, or a hub id of no name
            raise ConfigError("run.target: must not be empty (a local Hugging Face model directory or a hub id, "
                              "e.g. assets/tiny-target)")
        for key in ("workdir", "target", "store"):  # the same folder for every reader of the recipe
            check_no_shell_variable(key, getattr(self, key))
            object.__setattr__(self, key, home_expanded(getattr(self, key)))
        if self.target_revision and (problem := revision_problem(self.target, self.target_revision)):
            raise ConfigError(f"run.target_revision: {problem}")
        if self.seed not in SEED_RANGE:
            raise ConfigError(f"run.seed: must be in [0, 2**63), got {short(self.seed)}")
        store = self.store_uri
        kind = store.split("://", 1)[0].lower() if "://" in store else ""
        if kind not in ("", "file", *REMOTE_SCHEMES):
            raise ConfigError(f"run.store: {kind[:20]}:// is not a supported store (a local path, or "
                              f"{', '.join(s + '://' for s in REMOTE_SCHEMES)})")
        if kind not in ("", "file") and (problem := store_key_problem(store)):
            raise ConfigError(problem)
        if not kind and _is_file(store):  # every stage would say only that it holds no table
            raise ConfigError(f"run.store: {shown_path(store)} is a file; the store is a folder (LanceDB tables)")
        opts = {}
        for key, value in self.storage_options.items():
            text = ("true" if value else "false") if isinstance(value, bool) else str(value)
            if SECRET_KEY.search(key) and not _REF.fullmatch(text):
                # The value is never echoed: it is a secret.
                raise ConfigError(f"run.storage_options.{key[:80]}: credentials are not written in a recipe or on "
                                  "the command line (they would land in provenance.json); set the standard "
                                  "environment variable (e.g. AWS_SECRET_ACCESS_KEY) or write ${ENV_VAR}")
            opts[key] = text
        object.__setattr__(self, "storage_options", opts)

    def register_storage(self) -> None:
        """Make ``storage_options`` the options of every path under an object-store ``store_uri`` in
        this process, and ``target_revision`` the revision every loader reads ``target`` at
        (``eaglenest.target.pin_revision``): called once, where a command has resolved its recipe
        (``eaglenest.launch.execute``)."""
        pin_revision(self.target, self.target_revision)
        store = self.store_uri
        if "://" in store and store.split("://", 1)[0].lower() in REMOTE_SCHEMES:
            register_storage_options(store, dict(self.storage_options))

    @property
    def store_uri(self) -> str:
        return self.store or str(Path(self.workdir) / "store")

    def path(self, *parts: str) -> Path:
        return Path(self.workdir, *parts)


def revision_problem(target: str, revision: str) -> str | None:
    """Why ``run.target_revision`` ``revision`` is refused for ``run.target`` ``target`` (None when it is
    fine): not a git revision name (blanks, control characters, ``..``: it names a folder of the cache),
    or a target that is a local folder, which has no revisions."""
    shown = short(revision)
    if (any(c.isspace() or not c.isprintable() or c in "\\~^:?*[" for c in revision) or ".." in revision
            or revision.startswith(("/", "-", ".")) or revision.endswith(("/", ".")) or "//" in revision):
        return f"a branch, tag or commit of the hub id run.target names, got {shown}"
    text = str(target)
    if (Path(text).is_dir() or Path(text).is_absolute() or text.startswith((".", "~")) or text.count("/") > 1):
        return (f"{shown} pins a revision, but run.target {text} is a local folder, which has no revisions "
                "(leave run.target_revision empty, or name the target by its hub id)")
    return None


def store_key_problem(uri: str) -> str | None:
    """Why the object-store URI ``uri`` is refused (its key would be read differently by Lance and
    pyarrow, or not at all: pyarrow raises ArrowInvalid for ``//``, Lance drops control characters and
    resolves ``.`` / ``..`` segments, which pyarrow keeps), as one line naming ``run.store``; None when
    it is fine."""
    rest = str(uri).split("://", 1)[1]
    bad = sorted(set(rest) & set(URL_SYNTAX))
    if any(ord(c) < 32 or ord(c) == 127 for c in rest):
        problem = "holds a control character"
    elif bad:
        problem = f"holds {' '.join(repr(c) for c in bad)}, which Lance reads as URL syntax"
    elif not rest.split("/", 1)[0]:
        problem = "names no bucket"
    elif "" in rest.rstrip("/").split("/"):
        problem = "has an empty path segment (//)"
    elif {".", ".."} & set(rest.split("/")[1:]):  # the table and its side files would part
        problem = "has a '.' or '..' path segment, which Lance resolves and pyarrow does not"
    else:
        return None
    shown = "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(uri))  # one line, whatever it holds
    return (f"run.store: {shown} {problem}: use s3://bucket/prefix with a prefix of plain path segments "
            "(no ? # % or control characters)")
