"""``ingest``: build the prompt pool and regenerate responses on-policy.

    ingest validate [--manifest M]        check a manifest, print every problem's key
    ingest build [--manifest M] [k=v ...] pool + on-policy regeneration into the store
"""

from __future__ import annotations

import json
import logging

from eaglenest.cli import Command, run

log = logging.getLogger(__name__)

MANIFEST_ARG = (("--manifest",), {"default": None, "help": "domain manifest YAML (default: ingest.manifest)"})


def _manifest(recipe, args):
    from eaglenest.ingest.manifest import load_manifest

    return load_manifest(args.manifest or recipe.ingest.manifest)


def cmd_validate(recipe, args) -> int:
    m = _manifest(recipe, args)
    print(f"{args.manifest or recipe.ingest.manifest}: ok ({len(m.domains)} domains, "
          f"manifest hash {m.content_hash()})")
    return 0


def cmd_build(recipe, args) -> int:
    from eaglenest.config import to_dict
    from eaglenest.ingest.build import build
    from eaglenest.ingest.pool import load_pool
    from eaglenest.provenance import write_json_atomic, write_provenance

    manifest = _manifest(recipe, args)
    pool = load_pool(manifest)  # validated and loaded before anything is written
    stats = build(manifest, pool, target=recipe.run.target, store_uri=recipe.run.store_uri,
                  engine=recipe.ingest.engine, commit_every=recipe.ingest.commit_every)
    out = recipe.run.path("ingest")
    write_json_atomic(out / "stats.json", stats)
    write_provenance(out, config=recipe.to_dict(), extra={"manifest": to_dict(manifest)},
                     inputs={"manifest": args.manifest or recipe.ingest.manifest, "target": recipe.run.target})
    print(json.dumps(stats, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run("ingest", "Build the prompt pool and regenerate responses on-policy with vLLM.", {
        "validate": Command(cmd_validate, "validate a domain manifest", [MANIFEST_ARG]),
        "build": Command(cmd_build, "build the pool and regenerate responses", [MANIFEST_ARG]),
    }, argv)


if __name__ == "__main__":
    raise SystemExit(main())
