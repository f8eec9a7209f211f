"""Bodies of ``featurestore export`` and ``featurestore import`` (wired in featurestore/cli.py).

    featurestore export --format speculators|specforge|hf --out DIR [--version V] [--draft-vocab-size N]
                        [--with-tensors]                  a table version out to a peer trainer or datasets
    featurestore import --format speculators|specforge --src DIR [featurestore.table=NAME]
                                                          a peer's hidden-state dump in, as one new version

Both print a JSON summary. The target whose vocabulary size and final norm an export needs is
the table's recorded target when it is a local directory (or a cached hub id) still holding the weights
the table records, else ``run.target`` when it holds them (another model, there or at the recorded
path, is refused: its final norm would be applied to hidden states it did not make).
"""

from __future__ import annotations

import json
import logging

from eaglenest.errors import ConfigError
from eaglenest.featurestore.capture.identity import weights_hash
from eaglenest.featurestore.interop import hf, source, specforge, speculators
from eaglenest.featurestore.table.names import version_arg
from eaglenest.paths import ensure_writable
from eaglenest.provenance import write_json_atomic, write_provenance
from eaglenest.target import local_dir

EXPORTS = {"speculators": speculators, "specforge": specforge, "hf": hf}
IMPORTS = {"speculators": speculators, "specforge": specforge}

log = logging.getLogger(__name__)


def _version(text):
    return version_arg(text, "--version")


def _recorded_hash(src: source.Source) -> str | None:
    """The weights sha256 the table's identity records (None: none, or a hub id's ``hub:`` name)."""
    try:
        want = src.meta.identity_components.get("weights_sha256")
    except (ValueError, AttributeError):  # an identity that is not a JSON object: nothing to check against
        return None
    return want if isinstance(want, str) and not want.startswith("hub:") else None


def _is_model(target: str, want: str) -> bool:
    return local_dir(target).is_dir() and weights_hash(str(local_dir(target))) == want


def _target(recipe, src: source.Source) -> str:
    """The target an export reads (module docstring): the table's recorded target when it is here and
    still holds the weights the table records, else run.target when it does."""
    recorded, mine, want = src.meta.target, recipe.run.target, _recorded_hash(src)
    here = local_dir(recorded).is_dir()
    if want is None:
        if here:
            return str(local_dir(recorded))
        if mine != recorded:
            log.warning("the table's target %s is not here and the table records no weights hash to check "
                        "run.target %s against: exporting with run.target's vocabulary and final norm", recorded, mine)
        return mine
    if here and _is_model(recorded, want):
        return str(local_dir(recorded))
    if mine != recorded and _is_model(mine, want):
        return mine
    there = f"{recorded}, which holds another model now" if here else f"{recorded}, which is not here"
    also = "" if mine == recorded else f", and {mine} is another model"
    raise ConfigError(f"run.target: the table's features were captured from {there}{also} (weights other than the "
                      "ones the table records): an export applies the target's final norm and vocabulary. Set "
                      "run.target to a copy of the model the table was captured from")


def cmd_export(recipe, args) -> int:
    src = source.open_source(recipe.run.store_uri, recipe.featurestore.table, _version(args.version))
    config = recipe.to_dict()
    if args.format == "hf":
        record = hf.export(src, args.out, with_tensors=args.with_tensors, config=config)
    else:
        vocab = recipe.train.draft_vocab_size if args.draft_vocab_size is None else args.draft_vocab_size
        kw = {"norm_key": recipe.run.target_keys.norm} if args.format == "specforge" else {}
        record = EXPORTS[args.format].export(src, args.out, draft_vocab_size=vocab or None,
                                             target=_target(recipe, src), config=config, **kw)
    print(json.dumps({"out": str(args.out), **{k: record[k] for k in (
        "format", "table", "table_version", "rows", "feature_set_id", "layer_ids_vllm")}}, indent=2))
    return 0


def cmd_import(recipe, args) -> int:
    if args.format not in IMPORTS:
        raise ConfigError(f"--format {args.format}: import reads {', '.join(IMPORTS)}")
    kw = {"norm_key": recipe.run.target_keys.norm} if args.format == "specforge" else {}
    ensure_writable(recipe.run.path("import"), "run.workdir", keep=False)  # its record, before the table is written
    summary = IMPORTS[args.format].import_dump(
        args.src, recipe.run.store_uri, recipe.featurestore.table, target=recipe.run.target,
        layer_ids=recipe.featurestore.layer_ids, domain=args.domain, off_policy=recipe.run.off_policy,
        budget_bytes=int(recipe.featurestore.write_buffer_mb * (1 << 20)),
        trust_remote_code=recipe.run.trust_remote_code, storage=recipe.featurestore.storage, **kw)
    # what was imported, from where, into which version: <workdir>/import/<table>/ (capture's folder is its own)
    out = recipe.run.path("import", summary["table"])
    write_json_atomic(out / "stats.json", summary)
    write_provenance(out, config=recipe.to_dict(), inputs={"format": args.format, "src": str(args.src),
                                                           "target": recipe.run.target, "store": recipe.run.store_uri},
                     extra={"outputs": {"store": recipe.run.store_uri, "table": summary["table"],
                                        "version": summary["version"], "feature_set_id": summary["feature_set_id"]}})
    print(json.dumps(summary, indent=2))
    return 0
