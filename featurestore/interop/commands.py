"""Bodies of ``featurestore export`` and ``featurestore import`` (wired in featurestore/cli.py).

    featurestore export --format speculators|specforge|hf --out DIR [--version V] [--draft-vocab-size N]
                        [--with-tensors]                  a table version out to a peer trainer or datasets
    featurestore import --format speculators|specforge --src DIR [featurestore.table=NAME]
                                                          a peer's hidden-state dump in, as one new version

Both print a JSON summary. The target whose vocabulary size and final norm an export needs is
the table's recorded target when it is a local directory (or a cached hub id), else ``run.target``
when its weights are the ones the table records (another model is refused: its final norm would be
applied to hidden states it did not make).
"""

from __future__ import annotations

import json
import logging

from eaglenest.errors import ConfigError
from eaglenest.featurestore.capture.identity import weights_hash
from eaglenest.featurestore.interop import hf, source, specforge, speculators
from eaglenest.featurestore.table.names import version_arg
from eaglenest.target import local_dir

EXPORTS = {"speculators": speculators, "specforge": specforge, "hf": hf}
IMPORTS = {"speculators": speculators, "specforge": specforge}

log = logging.getLogger(__name__)


def _version(text):
    return version_arg(text, "--version")


def _target(recipe, src: source.Source) -> str:
    """The target an export reads (module docstring): run.target stands in for a table's target that
    is not here only when its weights hash is the one the table's identity records."""
    recorded = src.meta.target
    if local_dir(recorded).is_dir():
        return str(local_dir(recorded))
    mine = recipe.run.target
    try:
        want = src.meta.identity_components.get("weights_sha256")
    except (ValueError, AttributeError):  # an identity that is not a JSON object: nothing to check against
        want = None
    if mine == recorded or not isinstance(want, str) or want.startswith("hub:"):
        if mine != recorded:
            log.warning("the table's target %s is not here and the table records no weights hash to check "
                        "run.target %s against: exporting with run.target's vocabulary and final norm", recorded, mine)
        return mine
    if not local_dir(mine).is_dir() or weights_hash(str(local_dir(mine))) != want:
        raise ConfigError(f"run.target: the table's features were captured from {recorded}, which is not here, and "
                          f"{mine} is another model (its weights are not the ones the table records): an export "
                          f"applies the target's final norm and vocabulary. Set run.target to a copy of {recorded}")
    return mine


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
    summary = IMPORTS[args.format].import_dump(
        args.src, recipe.run.store_uri, recipe.featurestore.table, target=recipe.run.target,
        layer_ids=recipe.featurestore.layer_ids, domain=args.domain, off_policy=recipe.run.off_policy,
        budget_bytes=int(recipe.featurestore.write_buffer_mb * (1 << 20)),
        trust_remote_code=recipe.run.trust_remote_code, storage=recipe.featurestore.storage, **kw)
    print(json.dumps(summary, indent=2))
    return 0
