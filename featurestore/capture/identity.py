"""Feature-set identity: a content hash of everything that determines the stored hidden states.

Two captures with the same identity produce the same tensors, so the second one is pure waste:
``featurestore capture`` reuses the stored table and runs
zero target forward passes. The identity covers:

* ``target`` (model id or path) and ``weights_sha256``: a hash of the weight files' contents
  (``*.safetensors``/``*.bin``; the sha256 of each file, keyed by name). Files larger than
  ``FULL_HASH_BYTES`` in total are hashed by size plus their first and last 16 MiB, so a 140 GB
  target is identified in seconds; a hub revision pins the rest. This is the trade-off: a
  same-size in-place edit of the middle of a huge weight file would go unnoticed. A target named by
  hub id has no files here: its ``weights_sha256`` is ``hub:<id>``, and ``target_revision`` records the
  commit its local cache resolves the id to (:func:`hub_revision`: the snapshot every loader reads, at the
  revision ``run.target_revision`` pins, else the cache's ``main``), so two revisions of one id are two
  feature sets. A local folder records no ``target_revision``; nor does a table captured before it counted
  (:data:`ADDED`: revision unknown). :func:`revision_change` is the one comparison of a recorded revision
  with the one read now (capture and train, ``policy``; export, serving and measuring, ``serve.target_check``);
* ``config_sha256``: a hash of the target's ``config.json`` (norm epsilon, rotary settings, activation,
  attention layout: what turns the weights into hidden states), its keys that change no hidden state
  of given token ids left out (:data:`CONFIG_IGNORED`). A table captured before this component
  existed lacks it and is reused as is (:data:`ADDED`);
* ``layer_ids`` (vLLM convention), ``last_layer_id`` and ``capture_point`` (where the tensors are
  taken: vLLM ``extract_hidden_states``, residual stream before the final norm);
* ``tokenizer_sha256`` and ``chat_template_sha256``: every file transformers builds the tokenizer from
  (:func:`_tokenizer_files`) and every template file it (or AutoProcessor) renders chats with
  (:func:`template_hash`);
* ``prompt_pool``: a hash of the sorted sample ids of the training conversations (ids are content
  hashes, so this is the pool's content) and ``gen_params_ids`` (how the responses were generated);
* ``dtype``, ``storage`` (raw or fp8) and the schema version.

Components are kept in the table metadata next to the hash, so a refused capture can say which
component differs and which recipe key changes it (:data:`KEYS`).
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from eaglenest.errors import ConfigError
from eaglenest.featurestore import schema as S
from eaglenest.target import local_dir, pinned_revision

log = logging.getLogger(__name__)

CAPTURE_POINT = "vllm.extract_hidden_states/residual_pre_final_norm"
FULL_HASH_BYTES = 4 << 30
_EDGE = 16 << 20

#: Identity component -> the recipe key that changes it (named in refusal messages).
KEYS = {
    "target": "run.target", "weights_sha256": "run.target", "tokenizer_sha256": "run.target",
    "chat_template_sha256": "run.target", "layer_ids": "featurestore.layer_ids",
    "last_layer_id": "run.target", "capture_point": "(code version)", "prompt_pool": "ingest.manifest",
    "gen_params_ids": "ingest.manifest (generation)", "dtype": "featurestore.engine.dtype",
    "storage": "featurestore.storage", "schema_version": "(code version)", "config_sha256": "run.target",
    "target_revision": "run.target_revision",
}

#: Components added after tables were first captured: a stored identity that lacks one (and holds the
#: others) was captured before it existed, and is not told apart by it (``build.check_reuse``).
ADDED = ("config_sha256", "target_revision")

#: Keys of config.json that change no hidden state of given token ids: the engine's dtype is a
#: component of its own, special token ids only steer generation, the rest is bookkeeping.
CONFIG_IGNORED = frozenset({"transformers_version", "_name_or_path", "use_cache", "dtype", "torch_dtype",
                            "bos_token_id", "eos_token_id", "pad_token_id"})


def _sha_file(path: Path, *, full: bool) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        if full:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        else:
            size = path.stat().st_size
            h.update(str(size).encode())
            h.update(f.read(_EDGE))
            f.seek(max(0, size - _EDGE))
            h.update(f.read(_EDGE))
    return h.hexdigest()


def hub_revision(target: str) -> str:
    """The commit a target named by hub id resolves to in the local Hugging Face cache (the snapshot folder
    its files are read from: at the revision ``run.target_revision`` pins, else ``refs/main``); a pinned
    revision the cache does not hold as given (a loader fetches it); empty for a local folder, or a hub id
    neither pinned nor cached."""
    if Path(target).is_dir():
        return ""
    return _cached_commit(target) or pinned_revision(target)


def _cached_commit(target: str, revision: str | None = None) -> str:
    """The commit of the snapshot ``revision`` of hub id ``target`` names in the local cache (None: the pinned
    one, else ``main``); empty when the cache has none."""
    files = local_dir(target, revision=revision)
    return files.name if files != Path(target) and files.parent.name == "snapshots" else ""


def revision_change(comps: dict, target: str, *, recorded: str, what: str = "features were captured") -> str:
    """For a ``target`` named by hub id that the feature identity ``comps`` (read from ``recorded``) names too:
    the line naming the revision it is read at now (:func:`hub_revision`) when it is not the one the features
    were captured at (``what``: the responses generated, for a prompts table's lineage). Empty when they agree,
    when the id is neither pinned nor cached or is not the identity's, and when the identity records no revision
    (captured before revisions were: unknown, logged as a warning)."""
    now = hub_revision(target)
    if not now or comps.get("weights_sha256") != f"hub:{target}":
        return ""
    pinned = pinned_revision(target)
    where = f"(run.target_revision={pinned})" if pinned else "in the local Hugging Face cache"
    was = comps.get("target_revision")
    if not isinstance(was, str) or not was:
        log.warning("run.target: %s is at revision %s %s; %s records no revision (captured before revisions "
                    "were recorded), so whether its features are of that revision is unknown",
                    target, now[:12], where, recorded)
        return ""
    if now in (was, _cached_commit(target, was)):  # a branch recorded as given before it was cached: its commit now
        return ""
    return (f"run.target: {target} is at revision {now[:12]} {where}, not at {was[:12]}, the revision the "
            f"{what} at ({recorded}): other weights (run.target_revision={was} reads those)")


def weights_hash(target: str) -> str:
    """sha256 over the target's weight files (see the module docstring for very large targets)."""
    root = Path(target)
    if not root.is_dir():  # a hub id: its revision is the identity (resolved by the caller's cache)
        return "hub:" + str(target)
    files = sorted(p for p in root.iterdir() if p.suffix in (".safetensors", ".bin") and p.is_file())
    # One hash per content per process: capture and train consult it more than once (identity,
    # on-policy checks). Keyed by each file's stat, so any write, copy or replace hashes again.
    stats = tuple((str(p.resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
                  for p in files for st in (p.stat(),))
    if stats in _HASHED:
        return _HASHED[stats]
    full = sum(s[1] for s in stats) <= FULL_HASH_BYTES
    blob = {p.name: _sha_file(p, full=full) for p in files}
    _HASHED[stats] = digest = hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()
    return digest


_HASHED: dict[tuple, str] = {}


def _tokenizer_files(root: Path, *, legacy: bool = False) -> list[Path]:
    # (Mistral's tekken.json, BERT-style vocab.txt and tiktoken files too; then the legacy added_tokens.json
    # transformers still reads and the other sentencepiece models: spiece.model (T5, Pegasus),
    # sentencepiece.bpe.model, spm.model, mistral_common's tokenizer.model.v3. A file absent adds nothing,
    # and those added since come after the first ones, so the identities of stores captured before stay the same.
    # ``legacy``: the files hashed before the later ones counted, for :func:`legacy_tokenization`)
    names = ["tokenizer.json", "tokenizer.model", "tekken.json", "vocab.json", "vocab.txt", "merges.txt",
             "tokenizer_config.json", "special_tokens_map.json", *sorted(p.name for p in root.glob("*.tiktoken"))]
    later = ("added_tokens.json", *sorted(p.name for p in (*root.glob("*.model"), *root.glob("*.model.v*"))))
    names += [] if legacy else [name for name in later if name not in names]
    return [root / name for name in names if (root / name).is_file()]


def tokenizer_hashes(target: str) -> tuple[str, str]:
    """(sha256 of the tokenizer files, sha256 of the chat template: :func:`template_hash`)."""
    root = Path(target)
    return _files_hash(_tokenizer_files(root)), template_hash(root)


def _files_hash(files: list[Path]) -> str:
    h = hashlib.sha256()
    for p in files:
        h.update(p.name.encode() + p.read_bytes())
    return h.hexdigest()


#: transformers' template files beside tokenizer_config.json: the default template, the folder of named
#: ones (both read by AutoTokenizer and AutoProcessor) and the processor's legacy file (AutoProcessor only,
#: which vLLM asks first for a multimodal target, over the .jinja files).
TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_DIR = "additional_chat_templates"
PROCESSOR_TEMPLATE_FILE = "chat_template.json"


def template_hash(root: Path) -> str:
    """sha256 of the chat template: :func:`chat_template_text`, and the processor's ``chat_template.json``
    when there is one (its bytes: what vLLM renders a multimodal target's chats with). Without that file
    it is the text's sha256 alone, as for stores captured before it counted."""
    h = hashlib.sha256(chat_template_text(root).encode())
    legacy = Path(root) / PROCESSOR_TEMPLATE_FILE
    if legacy.is_file():
        h.update(b"\0" + PROCESSOR_TEMPLATE_FILE.encode() + b"\0" + legacy.read_bytes())
    return h.hexdigest()


def chat_template_text(root: Path, *, legacy: bool = False) -> str:
    """The target's chat template as AutoTokenizer loads it: ``tokenizer_config.json``'s, replaced as a
    whole by template files when there are any (``chat_template.jinja``, the default, and
    ``additional_chat_templates/<name>.jinja``, named ones); none: empty. Several templates (a list of
    named ones in tokenizer_config.json, or several files) as sorted JSON. ``legacy``: as read before the
    named files counted (chat_template.jinja alone), for :func:`legacy_tokenization`."""
    template = ""
    cfg = root / "tokenizer_config.json"
    if cfg.is_file():
        template = _json_object(cfg).get("chat_template") or ""
    files = {"default": root / TEMPLATE_FILE} if (root / TEMPLATE_FILE).is_file() else {}
    if not legacy:  # (after the default, as AutoTokenizer reads them: a named "default" wins)
        files.update({p.name.removesuffix(".jinja"): p for p in sorted((root / TEMPLATE_DIR).glob("*.jinja"))
                      if p.is_file()})
    if files:
        texts = {name: _template_file(p) for name, p in files.items()}
        template = texts["default"] if list(texts) == ["default"] else texts
    if not isinstance(template, str):
        template = json.dumps(template, sort_keys=True)
    return template


def legacy_tokenization(target: str) -> dict[str, str]:
    """What ``tokenizer_hashes`` (``tokenizer_sha256``, ``chat_template_sha256``) and ``vocab_hash``
    (``vocab_sha256``) gave before ``added_tokens.json``, the other sentencepiece models and the template
    files other than chat_template.jinja counted: a record written then equal to these is the same
    tokenization (those files were not recorded, so an edit of them since is not seen). Equal to the
    current hashes for a target without those files."""
    root = Path(target)
    return {"tokenizer_sha256": _files_hash(_tokenizer_files(root, legacy=True)),
            "chat_template_sha256": hashlib.sha256(chat_template_text(root, legacy=True).encode()).hexdigest(),
            "vocab_sha256": vocab_hash(target, legacy=True)}


def vocab_hash(target: str, *, legacy: bool = False) -> str:
    """sha256 of the tokenizer files with the chat template left out of ``tokenizer_config.json``:
    what turns text into token ids, so an edited template is told apart from another tokenizer."""
    h = hashlib.sha256()
    for p in _tokenizer_files(Path(target), legacy=legacy):
        if p.name == "tokenizer_config.json":
            cfg = {k: v for k, v in _json_object(p).items() if k != "chat_template"}
            data = json.dumps(cfg, sort_keys=True).encode()
        else:
            data = p.read_bytes()
        h.update(p.name.encode() + data)
    return h.hexdigest()


def config_hash(target: str) -> str:
    """sha256 of the target's config.json, :data:`CONFIG_IGNORED` keys left out at any depth (a
    multimodal wrapper's text config too); empty where there is no local config.json (a hub id: its
    revision pins it, as for the weights)."""
    path = Path(target) / "config.json"
    if not path.is_file():
        return ""

    def kept(value):
        if isinstance(value, dict):
            return {k: kept(v) for k, v in value.items() if k not in CONFIG_IGNORED}
        return [kept(v) for v in value] if isinstance(value, list) else value

    return hashlib.sha256(json.dumps(kept(_json_object(path)), sort_keys=True).encode()).hexdigest()


def _template_file(path: Path) -> str:
    """A chat template file's text (UTF-8, as transformers reads it); one :class:`ConfigError` line naming it
    otherwise."""
    try:
        return path.read_text(encoding="utf-8")
    except (ValueError, OSError) as exc:  # UnicodeDecodeError is a ValueError
        raise ConfigError(f"run.target: {path} is not a readable UTF-8 chat template ({str(exc)[:200]})") from None


def _json_object(path: Path) -> dict:
    """A target file holding a JSON object; one :class:`ConfigError` line naming it otherwise."""
    try:
        data = json.loads(path.read_text())
    except (ValueError, OSError) as exc:  # UnicodeDecodeError is a ValueError
        raise ConfigError(f"run.target: {path} is not valid JSON ({str(exc).splitlines()[0][:200]})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"run.target: {path} holds a JSON {type(data).__name__}, not an object")
    return data


def components(*, target: str, layer_ids, last_layer_id: int, dtype: str, storage: str,
               sample_ids, gen_params_ids) -> dict:
    tok, template = tokenizer_hashes(target)
    pool = hashlib.sha256("\n".join(sorted(sample_ids)).encode()).hexdigest()
    revision = hub_revision(str(target))  # only a hub id has one: a local folder's identity is as before
    return {
        "target": str(target), "weights_sha256": weights_hash(target), "config_sha256": config_hash(target),
        "tokenizer_sha256": tok,
        "chat_template_sha256": template, "layer_ids": list(layer_ids), "last_layer_id": int(last_layer_id),
        "capture_point": CAPTURE_POINT, "prompt_pool": pool, "gen_params_ids": sorted(set(gen_params_ids)),
        "dtype": dtype, "storage": storage, "schema_version": S.SCHEMA_VERSION,
        **({"target_revision": revision} if revision else {}),
    }


def identity_hash(comps: dict) -> str:
    # The target path is a name, not content: moving a model directory keeps its identity.
    keyed = {k: v for k, v in comps.items() if k != "target"}
    return hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()[:16]


def differences(have: dict, want: dict) -> list[str]:
    """Human-readable list of differing components with the recipe key to change."""
    out = []
    for k in sorted(set(have) | set(want)):
        if k != "target" and have.get(k) != want.get(k):
            out.append(f"{k} (key {KEYS.get(k, '?')})")
    return out


def target_record(target: str) -> dict:
    """The target as provenance names it: its path and the hashes of what it is (weights, tokenizer,
    chat template: components of the feature identity). A hub id has no files here: its weights entry
    is ``hub:<id>``, its revision the cached one (:func:`hub_revision`, when cached), and there are no
    tokenizer hashes."""
    record = {"target": str(target), "weights_sha256": weights_hash(str(target))}  # cached per process
    if revision := hub_revision(str(target)):
        record["target_revision"] = revision
    if Path(target).is_dir():
        record["tokenizer_sha256"], record["chat_template_sha256"] = tokenizer_hashes(str(target))
    return record
