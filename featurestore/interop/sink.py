"""Bringing a checked dump into a features table: one new version, all of it or nothing.

An import runs in two passes. The first reads only what is cheap (file list, headers, shapes,
dtypes, token ids, loss masks) and refuses a bad or partial dump, naming the file, before a byte is
written. The second decodes the hidden states and writes rows through
:class:`~eaglenest.featurestore.capture.writer.FeatureWriter` (fragments every
``featurestore.write_buffer_mb``, so memory stays bounded) and makes **one** commit at the end,
under the table's writer lease: a failure in between (a non-finite value, a full disk) leaves the
table at its previous version, the written fragments being uncommitted garbage for
``featurestore gc``. Trade-off: the first pass reads the small tensors twice.

The feature metadata comes from the dump when eaglenest exported it (``eaglenest_export.json``:
the original ``FeatureMeta``, so a round trip is bit-exact), else from the recipe's target and
``featurestore.layer_ids`` and the dump's own shapes and dtype.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import shutil
import unicodedata
from pathlib import Path
from typing import Iterable

import numpy as np
from tqdm import tqdm

from eaglenest import faults
from eaglenest.config import short, short_text
from eaglenest.errors import ConfigError, SchemaError, StoreError
from eaglenest.featurestore import schema as S
from eaglenest.featurestore.capture.build import target_facts
from eaglenest.featurestore.capture.engine import resolve_layer_ids
from eaglenest.featurestore.capture.identity import (
    identity_hash,
    legacy_tokenization,
    tokenizer_hashes,
    weights_hash,
)
from eaglenest.featurestore.capture.writer import FeatureWriter
from eaglenest.featurestore.interop.source import EXPORT_RECORD, SAMPLES, STRING_COLUMNS
from eaglenest.featurestore.table import lease, objects, store
from eaglenest.paths import user_path
from eaglenest.provenance import code_version
from eaglenest.text import DOMAIN_NAME

log = logging.getLogger(__name__)

_DTYPES = {"torch.bfloat16": "bfloat16", "torch.float16": "float16", "torch.float32": "float32"}


def dtype_of(tensor, where: str) -> str:
    name = _DTYPES.get(str(tensor.dtype))
    if name is None:
        raise SchemaError(f"{where}: hidden states are {tensor.dtype}; eaglenest stores bfloat16, float16 or "
                          "float32")
    return name


_META_FIELDS = {"target": str, "layer_ids": list, "last_layer_id": int, "hidden_size": int, "dtype": str}


def check_domain(domain, where: str) -> str:
    if not isinstance(domain, str) or not DOMAIN_NAME.fullmatch(domain):
        raise ConfigError(f"{where}: domain {short(domain)} must be ASCII letters, digits, '-' or '_' (it goes into "
                          "sample ids and file names)")
    return domain


def check_table(name: str) -> None:
    """An import writes a features table: ``prompts`` is refused up front (as export refuses it)."""
    if not store.is_features(name):
        raise StoreError(f"table '{name}' holds prompts, not features: import into a features table "
                         "(featurestore.table=NAME)")


def _json(path: Path | str, text: str, what: str):
    try:
        return json.loads(text)
    except ValueError as exc:  # JSONDecodeError
        raise SchemaError(f"{path}: not valid JSON ({short_text(str(exc))}); {what}") from None


def _utf8(path: Path) -> str:
    """The file's text; bytes that are not UTF-8 are refused naming the offset (replacing them would
    change sample ids and domains without a word)."""
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SchemaError(f"{path}: not UTF-8 text (byte {exc.start}); an eaglenest export writes UTF-8") from None


def read_record(src: Path, fmt: str) -> tuple[dict | None, dict[int, dict]]:
    """The dump's ``eaglenest_export.json`` and per-index sample lines (empty for a foreign dump),
    validated: a bad record or line, or an export of another format than ``fmt``, is refused with one
    line naming the file (and line) and key."""
    rec_path, lines_path = src / EXPORT_RECORD, src / SAMPLES
    record = None
    if rec_path.is_file():
        record = _json(rec_path, _utf8(rec_path),
                       "an eaglenest export's record (remove it to import the dump as a foreign one)")
        if not isinstance(record, dict):
            raise SchemaError(f"{rec_path}: holds a JSON {type(record).__name__}, expected an object")
        record_meta(record, rec_path)
        if record.get("format", fmt) != fmt:
            raise SchemaError(f"{rec_path}: key 'format' is {short(record['format'])}: an eaglenest export of "
                              f"another format, not a {fmt} dump (import reads speculators and specforge exports, "
                              "each with its --format)")
        rows = record.get("rows")
        if rows is not None and (type(rows) is not int or rows < 0):
            raise SchemaError(f"{rec_path}: key 'rows' is {short(rows)}, expected a row count")
    samples: dict[int, dict] = {}
    if lines_path.is_file():
        # JSON Lines end at '\n' only: str.splitlines() also splits at U+2028, U+0085, ... which JSON
        # strings may hold raw (a peer's json.dumps(ensure_ascii=False)), cutting such a line in two.
        for n, line in enumerate(_utf8(lines_path).split("\n"), 1):
            if not line.strip():
                continue
            where = f"{lines_path}:{n}"
            d = _json(where, line, "one JSON object per exported sample")
            if not isinstance(d, dict):
                raise SchemaError(f"{where}: holds a JSON {type(d).__name__}, expected an object")
            bad = [k for k in ("file",) + STRING_COLUMNS if not isinstance(d.get(k), str)]
            if type(d.get("index")) is not int or d["index"] < 0:
                bad.insert(0, "index")
            if bad:
                raise SchemaError(f"{where}: key {bad[0]!r} is missing or not a "
                                  f"{'sample index' if bad[0] == 'index' else 'string'}")
            if not d["sample_id"]:
                raise SchemaError(f"{where}: key 'sample_id' is empty")
            check_identifiers(d, where)
            check_domain(d["domain"], f"{where}: key 'domain'")
            if d["index"] in samples:
                raise SchemaError(f"{where}: sample index {d['index']} is listed twice")
            samples[d["index"]] = d
    return record, samples


#: Line breaks and other control characters: a sample id holding one breaks one-line errors, ``query``
#: output and any line-based list of ids (Unicode categories Cc, Zl and Zp).
_CONTROL = {"Cc", "Zl", "Zp"}


def check_identifiers(line: dict, where: str) -> None:
    """Refuse a control character or line break in a sample line's identifiers (``source`` is free text)."""
    for key in STRING_COLUMNS:
        bad = next((c for c in line[key] if unicodedata.category(c) in _CONTROL), None)
        if key != "source" and bad is not None:
            raise SchemaError(f"{where}: key {key!r} is {short_text(line[key])}, which holds the control character "
                              f"{bad!r}; sample ids, splits and modes are one-line text")


def record_meta(record: dict, where: Path | str) -> S.FeatureMeta:
    """The ``FeatureMeta`` an eaglenest export recorded, checked key by key."""
    fm = record.get("feature_meta")
    if not isinstance(fm, dict):
        raise SchemaError(f"{where}: key 'feature_meta' is missing or not an object (an eaglenest export records "
                          "its table's FeatureMeta there)")
    for key, kind in _META_FIELDS.items():
        v = fm.get(key)
        if type(v) is not kind or (kind is list and not all(type(i) is int for i in v)):
            raise SchemaError(f"{where}: key 'feature_meta.{key}' is {short(v)}, expected a "
                              f"{'list of ints' if kind is list else kind.__name__}")
    if fm["dtype"] not in S._DTYPES or fm.get("storage", "raw") not in S.STORAGES or fm["hidden_size"] < 1:
        raise SchemaError(f"{where}: feature_meta dtype {short(fm['dtype'])}, storage {short(fm.get('storage'))} or "
                          f"hidden_size {fm['hidden_size']} is not one eaglenest stores")
    if not isinstance(fm.get("identity", ""), str) or not isinstance(fm.get("feature_set_id", ""), str):
        raise SchemaError(f"{where}: keys 'feature_meta.identity' and 'feature_set_id' must be strings")
    ids, last = fm["layer_ids"], fm["last_layer_id"]
    if not ids or len(set(ids)) != len(ids) or not all(0 <= i < last for i in ids):  # the capture's rule
        raise SchemaError(f"{where}: key 'feature_meta.layer_ids' {ids} with last_layer_id {last}: expected "
                          "aux layer ids in 0..last_layer_id - 1, each once")
    try:
        comps = json.loads(fm.get("identity") or "{}")
    except ValueError:
        comps = None
    if not isinstance(comps, dict):
        raise SchemaError(f"{where}: key 'feature_meta.identity' is not a JSON object")
    if not isinstance(comps.get("weights_sha256", ""), str):
        raise SchemaError(f"{where}: key 'feature_meta.identity' weights_sha256 is {short(comps['weights_sha256'])}, "
                          "expected a sha256 string")
    return S.FeatureMeta.from_json(json.dumps(fm))


def check_rows(record: dict | None, samples: dict[int, dict], found: int, src: Path, what: str) -> None:
    """An eaglenest export's row count against what the dump holds: a partial copy is refused."""
    rows = None if record is None else record.get("rows")
    if rows is not None and rows != found:
        raise StoreError(f"--src {src}: {EXPORT_RECORD} says rows: {rows}, the dump holds {found} {what} "
                         "(a partial copy?); nothing was imported")
    if samples and len(samples) != found:
        raise StoreError(f"--src {src}: {SAMPLES} lists {len(samples)} samples, the dump holds {found} {what} "
                         "(a partial copy?); nothing was imported")
    if record is not None and found and not samples:  # its rows would come back as split 'train', new ids
        raise StoreError(f"--src {src}: {EXPORT_RECORD} is there but {SAMPLES} is missing (a partial copy?): it "
                         "holds the rows' sample ids, domains and splits; nothing was imported")


def target_vocab(target: str, record: dict | None, *, trust_remote_code: bool = False) -> int | None:
    """The target's vocabulary size, which every token id must be below. A foreign dump needs the
    target anyway (its shapes); an eaglenest export whose target cannot be read is imported without
    the check (a warning says so)."""
    try:
        vocab = target_facts(target, trust_remote_code=trust_remote_code)["vocab_size"]
        if type(vocab) is int and vocab > 0:
            return vocab
        problem = f"its config has vocab_size {short(vocab)}"
    except Exception as exc:  # noqa: BLE001 - a missing or unreadable config, whatever raised it
        problem = short_text(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    if record is None:
        raise ConfigError(f"run.target: {target}: cannot read the target's vocabulary size ({problem}); an import "
                          "checks every token id against it")
    log.warning("run.target %s: cannot read the vocabulary size (%s); token ids are not checked against it",
                target, problem)
    return None


def check_tokens(ids, vocab: int | None, where: str) -> np.ndarray:
    """Token ids (a numpy array or a list) as int64 ``[T]``, refusing another shape, no tokens, a non-integer
    dtype and ids outside ``0..vocab-1``, before any cast (a cast would wrap 2^40 to 0)."""
    arr = np.asarray(ids)
    if arr.ndim != 1:  # a dataset column of scalars, or of lists of lists
        raise SchemaError(f"{where}: input_ids are a {arr.ndim}-d value, expected a list of token ids")
    if arr.size == 0:
        raise SchemaError(f"{where}: the sample has no tokens; nothing was imported")
    if arr.dtype.kind not in "iu":
        raise SchemaError(f"{where}: input_ids are {arr.dtype}, expected integers")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or (vocab is not None and hi >= vocab):
        bad = lo if lo < 0 else hi
        raise SchemaError(f"{where}: token id {bad} is outside the target's vocabulary "
                          f"(0..{'' if vocab is None else vocab - 1}); is run.target the dump's target?")
    return arr.astype(np.int64)


def check_storage(storage: str) -> None:
    """An import stores the dump's tensors as they are (``raw``); fp8 is a capture-time choice."""
    if storage != "raw":
        raise ConfigError(f"featurestore.storage={short_text(str(storage))}: an import stores the dump's tensors "
                          "raw (bit-exact); set featurestore.storage=raw")


def string_columns(samples: dict[int, dict], index: int, input_ids: np.ndarray, *, domain: str,
                   source: str) -> dict:
    """The row's string columns: as exported by eaglenest, else ``<domain>-<sha256 of the token ids>``
    (the shape of eaglenest's own content-hash ids) and the dump file as ``source``."""
    if index in samples:
        return {k: samples[index][k] for k in STRING_COLUMNS}
    digest = hashlib.sha256(np.ascontiguousarray(input_ids, dtype="<i4").tobytes()).hexdigest()[:16]
    return {"sample_id": f"{domain}-{digest}", "domain": domain, "source": source, "split": "train",
            "mode": "chat", "gen_params_id": ""}


def check_ids(ids: list[tuple[str, str]], existing: set[str], name: str) -> None:
    """Refuse a sample id twice in the dump or already in the table, naming the files."""
    seen: dict[str, str] = {}
    for sid, where in ids:
        if sid in seen:
            raise StoreError(f"{where}: sample id {sid} is also {seen[sid]} (duplicate samples in the dump); "
                             "nothing was imported")
        if sid in existing:
            raise StoreError(f"{where}: sample id {sid} is already in table '{name}'; import into a new "
                             "table (featurestore.table=NAME); nothing was imported")
        seen[sid] = where


def check_target(record: dict | None, target: str, *, off_policy: bool) -> None:
    """A dump that records its target's weights hash must match ``run.target`` (when local), and its
    tokenizer files and chat template too (:func:`check_tokenization`)."""
    comps = {} if record is None else record_meta(record, EXPORT_RECORD).identity_components
    have = comps.get("weights_sha256")
    if have and Path(target).is_dir():
        want = weights_hash(target)
        if have != want:
            msg = (f"the dump was captured from target {comps.get('target')} (weights sha256 {have[:12]}), not "
                   f"run.target {target} ({want[:12]})")
            if not off_policy:
                raise StoreError(msg + "; set run.target to that target, or run.off_policy=true")
            log.warning("%s; importing anyway (run.off_policy=true)", msg)
    check_tokenization(comps, target, off_policy=off_policy)


#: Identity component -> what it hashes (featurestore/capture/identity.py; serve/target_check.py compares
#: the same two at export). ``NO_TEMPLATE``: the template hash of a target without one (its features hold no chat).
TOKENIZATION = {"tokenizer_sha256": "tokenizer files", "chat_template_sha256": "chat template"}
NO_TEMPLATE = hashlib.sha256(b"").hexdigest()


def check_tokenization(comps: dict, target: str, *, off_policy: bool) -> None:
    """The dump's token ids were made by the tokenizer files and chat template its identity records: another
    ``run.target`` tokenizer or template is refused (a warning with ``run.off_policy=true``), as serve export
    refuses one. A dump that records neither (a peer's dump, an export of imported features) or a hub id on
    either side (no files here to hash) cannot be checked: one warning says so."""
    recorded = {k: comps[k] for k in TOKENIZATION if isinstance(comps.get(k), str) and comps[k]}
    no_files = str(comps.get("weights_sha256", "")).startswith("hub:") or not Path(target).is_dir()
    if not recorded or no_files:
        why = "run.target is not a local directory" if not Path(target).is_dir() else (
            "the dump's target was a hub id" if recorded else "the dump records no tokenizer or chat template hash")
        log.warning("the dump's tokenizer and chat template are not checked against run.target %s (%s), only its "
                    "token ids' range; make sure the dump was tokenized with that target's tokenizer and template",
                    target, why)
        return
    have = dict(zip(TOKENIZATION, tokenizer_hashes(target)))
    old = legacy_tokenization(target)  # an identity from before the files counted since: the same tokenization
    changed = [f"{TOKENIZATION[k]} (sha256 {v[:12]} in the dump's {EXPORT_RECORD}, {have[k][:12]} in {target})"
               for k, v in recorded.items() if v not in (have[k], old[k])
               and not (k == "chat_template_sha256" and v == NO_TEMPLATE)]
    if not changed:
        return
    msg = (f"run.target: the {' and the '.join(changed)} differ from those of {comps.get('target')}, which the dump "
           "was captured with: its token ids are not what run.target makes")
    if not off_policy:
        raise ConfigError(msg + "; set run.target to that target, or run.off_policy=true; nothing was imported")
    log.warning("%s; importing anyway (run.off_policy=true)", msg)


def check_width(record: dict | None, target: str, *, trust_remote_code: bool = False) -> None:
    """An eaglenest export's hidden size and layer count against ``run.target``'s (a foreign dump's:
    :func:`import_meta`). Neither the weights hash (it leaves config.json out) nor ``run.off_policy=true``
    (another model's states, let in on purpose) holds the width: states of another hidden size would be committed and
    fail only in the trainer, which applies run.target's final norm and lm_head to them. Nor the layer
    count. A target whose config does not read is not checked (:func:`target_vocab` warns)."""
    if record is None:
        return
    meta = record_meta(record, EXPORT_RECORD)
    try:
        facts = target_facts(target, trust_remote_code=trust_remote_code)
    except Exception:  # noqa: BLE001 - an unreadable config: target_vocab says so
        return
    if meta.hidden_size != facts["hidden_size"]:
        raise SchemaError(f"the dump's hidden size is {meta.hidden_size} ({EXPORT_RECORD}), run.target {target} has "
                          f"{facts['hidden_size']}: set run.target to the dump's target; nothing was imported")
    # The layer count too: the aux layer ids name layers of the dump's target, which the draft's config
    # hands vLLM to capture from run.target (ids past its depth, or other depths' layers).
    if meta.last_layer_id != facts["num_layers"]:
        raise SchemaError(f"the dump's target has {meta.last_layer_id} layers (aux layers {list(meta.layer_ids)}, "
                          f"{EXPORT_RECORD}), run.target {target} has {facts['num_layers']}: set run.target to the "
                          "dump's target; nothing was imported")


def import_meta(*, fmt: str, target: str, layer_ids, n_aux: int, hidden: int, dtype: str, ids: list[str],
                dump_digest: str, trust_remote_code: bool = False) -> S.FeatureMeta:
    """Feature metadata for a foreign dump: the target's shapes, checked against the dump's."""
    facts = target_facts(target, trust_remote_code=trust_remote_code)
    # Ascending whatever order they are given in: a peer's dump holds its aux layers as the target's
    # forward meets them (vLLM's and SGLang's capture append layer by layer), so [5, 2, 4] would label
    # the stored layers wrongly, and the trainer's reorder to ascending would then permute them.
    layer_ids = tuple(sorted(resolve_layer_ids(layer_ids, facts["num_layers"])))
    if len(layer_ids) != n_aux:
        raise SchemaError(f"the dump holds {n_aux} aux layers, featurestore.layer_ids gives {len(layer_ids)} "
                          f"({list(layer_ids)}, vLLM convention); set featurestore.layer_ids to the dump's layers")
    if hidden != facts["hidden_size"]:
        raise SchemaError(f"the dump's hidden size is {hidden}, run.target {target} has {facts['hidden_size']}: "
                          "set run.target to the dump's target")
    comps = {"target": str(target), "weights_sha256": weights_hash(target), "layer_ids": list(layer_ids),
             "last_layer_id": facts["num_layers"], "capture_point": f"import:{fmt}",
             "prompt_pool": hashlib.sha256("\n".join(sorted(ids)).encode()).hexdigest(), "dump": dump_digest,
             "dtype": dtype, "storage": "raw", "schema_version": S.SCHEMA_VERSION}
    return S.FeatureMeta(target=str(target), layer_ids=tuple(layer_ids), last_layer_id=facts["num_layers"],
                         hidden_size=hidden, dtype=dtype, storage="raw", feature_set_id=identity_hash(comps),
                         identity=json.dumps(comps, sort_keys=True))


def dump_digest(files: list[Path], root: Path) -> str:
    """sha256 over the dump's (relative path, size) list: names the dump in the identity."""
    h = hashlib.sha256()
    for p in files:
        h.update(f"{p.relative_to(root)}\0{p.stat().st_size}\n".encode())
    return h.hexdigest()


def feature_row(strings: dict, input_ids: np.ndarray, loss_mask: np.ndarray, aux, last, meta: S.FeatureMeta,
                where: str) -> dict:
    """One features row from decoded tensors (torch, the table dtype), refusing non-finite values and
    tensors whose dtype or element count is not the table's (``input_ids``: checked by :func:`check_tokens`)."""
    import torch

    T, n_aux, H = len(input_ids), len(meta.layer_ids), meta.hidden_size
    for what, t, shape in (("aux", aux, (T, n_aux, H)), ("last", last, (T, H))):
        if t.numel() != int(np.prod(shape)):
            raise SchemaError(f"{where}: {what} hidden states hold {t.numel()} values, the table needs "
                              f"{' x '.join(map(str, shape))}; nothing was imported")
        if _DTYPES.get(str(t.dtype)) != meta.dtype:
            raise SchemaError(f"{where}: {what} hidden states are {t.dtype}, the table stores {meta.dtype}; "
                              "nothing was imported")
        if not bool(torch.isfinite(t).all()):
            raise SchemaError(f"{where}: {what} hidden states hold NaN or inf; nothing was imported")
    if input_ids.dtype.kind not in "iu" or (T and (input_ids.min() < 0 or input_ids.max() > np.iinfo(np.int32).max)):
        raise SchemaError(f"{where}: token ids do not fit the table's int32 input_ids; nothing was imported")
    return {**strings, "num_tokens": T, "num_loss_tokens": int(loss_mask.sum()),
            "input_ids": input_ids.astype(np.int32), "loss_mask": loss_mask.astype(np.uint8),
            "aux_hidden": S.encode_value(S.to_numpy(aux.reshape(T, n_aux, H).contiguous()), meta),
            "last_hidden": S.encode_value(S.to_numpy(last.reshape(T, H).contiguous()), meta)}


def commit_rows(uri: str, name: str, meta: S.FeatureMeta, rows: Iterable[dict], *, total: int,
                lineage: dict, budget_bytes: int, desc: str, ids: list[tuple[str, str]] = ()) -> int:
    """Write ``rows`` as fragments and commit them once, under the writer lease; the new version.
    ``ids`` ((sample id, where) of the rows, checked by the caller before the lease) are checked again
    once the lease is held, before a byte is written: another import may have committed them meanwhile.

    A table this import created (it did not exist when the lease was taken) is removed again when
    the import fails before its commit, so a refused dump leaves neither an empty table nor its
    fragments behind; so does a SIGTERM, which the CLI unwinds like Ctrl-C (only a SIGKILLed
    process cannot clean up: that leaves the empty table and the fragments to ``featurestore gc``)."""
    with lease.hold(uri, name, purpose="featurestore import", wait_s=lease.MAINTENANCE_WAIT_S):
        created = not store.exists(uri, name)
        if not created:
            have = S.feature_meta(store.dataset(uri, name).schema)
            if have != meta:
                raise SchemaError(f"table '{name}' holds another feature set ({have.feature_set_id}, layers "
                                  f"{list(have.layer_ids)}, {have.dtype}) than the dump ({meta.feature_set_id}, "
                                  f"layers {list(meta.layer_ids)}, {meta.dtype}); import into a new table "
                                  "(featurestore.table=NAME)")
            check_ids(ids, store.sample_ids(uri, name), name)
        writer = FeatureWriter(uri, name, meta, budget=budget_bytes)
        try:
            for row in tqdm(rows, total=total, desc=desc, unit="sample"):
                writer.add(row)
                faults.delay("import.row_written")  # tests: hold an import between its first write and its commit
            version = writer.commit({**lineage, "code_version": code_version(),
                                     "feature_set_id": meta.feature_set_id})
        except BaseException:  # an error or Ctrl-C: nothing was committed
            if created:
                _remove_uncommitted(uri, name, written=writer.data_files)
            raise
    if version is None:
        raise StoreError("the dump holds no samples; nothing was imported")
    return version


def _remove_uncommitted(uri: str, name: str, *, written: Iterable[str] = ()) -> None:
    """Remove table ``name`` if it holds nothing committed (its first, empty version only): the
    import that created it failed, having written the data files ``written``. The caller holds the
    table's writer lease; an object store has none, so there only what this import wrote goes
    (:func:`_remove_remote`), and the check is what keeps a table another writer has committed to
    since (it has a second version then) from being removed."""
    if not store.exists(uri, name):
        return
    try:
        ds = store.dataset(uri, name, allow_rolled_back=True)
        if ds.count_rows() or len(ds.versions()) > 1:
            return
        if objects.is_remote(uri):
            _remove_remote(store.table_uri(uri, name), written)
        else:
            shutil.rmtree(store.table_path(uri, name))
    except Exception as exc:  # noqa: BLE001 - cleanup must not hide the import's own error
        log.warning("could not remove the empty table '%s' this import created: %s", name, exc)


def _remove_remote(table: str, written: Iterable[str]) -> None:
    """Remove an object-store table that holds only its empty first manifest, and the data files
    ``written`` this import wrote. With no lease there, another writer may be writing into the new
    table: while any data file it wrote is there (not yet committed), or once it has committed a
    manifest, the empty table stays (its version is kept; the import's own files are gone)."""
    data = objects.join(table, "data")
    for file in written:
        with contextlib.suppress(FileNotFoundError):
            objects.delete(objects.join(data, file))
    manifests = objects.join(table, "_versions")
    found = [e.name for e in objects.listdir(manifests) if e.name.endswith(".manifest")]
    if len(found) != 1 or _others_data(data):
        return
    objects.delete(objects.join(manifests, found[0]))
    if any(e.name.endswith(".manifest") for e in objects.listdir(manifests)) or _others_data(data):
        log.warning("another writer wrote to %s while this import failed; its files are kept", table)
        return
    objects.delete_tree(table)


def _others_data(data: str) -> bool:
    """Whether the table's data prefix holds a file (another writer's: the caller removed its own)."""
    return any(e.is_file for e in objects.listdir(data))


def require_dir(src: str | Path, fmt: str) -> Path:
    if not str(src).strip():  # an unset shell variable: Path('') would be the working directory, imported whole
        raise ConfigError(f"--src is empty; give the {fmt} dump's directory")
    src = user_path(src, "--src", error=ConfigError, resolve=False)  # a name too long, a NUL, a loop: one line
    if not src.is_dir():
        raise ConfigError(f"--src {src}: not a directory (a {fmt} hidden-state dump)")
    return src


def as_raw(meta: S.FeatureMeta, fmt: str) -> S.FeatureMeta:
    """An exported ``fp8_e4m3`` table comes back dequantized: stored ``raw``, a feature set of its own."""
    if meta.storage == "raw":
        return meta
    comps = {**meta.identity_components, "storage": "raw", "capture_point": f"import:{fmt}"}
    return dataclasses.replace(meta, storage="raw", feature_set_id=identity_hash(comps),
                               identity=json.dumps(comps, sort_keys=True))
