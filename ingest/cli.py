"""``ingest``: build the prompt pool and regenerate responses on-policy.

    ingest validate [--manifest M]        check a manifest, print every problem (key first), exit 2
    ingest build [--manifest M] [k=v ...] pool + contamination check + regeneration into the store
"""

from __future__ import annotations

import json
import logging
import sys

from eaglenest.cli import Command, run

log = logging.getLogger(__name__)

MANIFEST_ARG = (("--manifest",), {"default": None, "help": "domain manifest YAML (default: ingest.manifest)"})


def _manifest(recipe, args):
    from eaglenest.ingest.manifest import load_manifest

    return load_manifest(args.manifest or recipe.ingest.manifest)


def cmd_validate(recipe, args) -> int:
    from eaglenest.ingest.manifest import ManifestProblems

    path = args.manifest or recipe.ingest.manifest
    try:
        m = _manifest(recipe, args)
    except ManifestProblems as exc:
        for line in exc.problems:
            print(line, file=sys.stderr)
        print(f"ingest: error: {path}: {len(exc.problems)} problem(s)", file=sys.stderr)
        return 2
    print(f"{path}: ok ({len(m.domains)} domains, manifest hash {m.content_hash()})")
    return 0


def cmd_build(recipe, args) -> int:
    from eaglenest.config import to_dict
    from eaglenest.ingest import contamination
    from eaglenest.ingest.build import build
    from eaglenest.ingest.pool import load_pool
    from eaglenest.provenance import write_json_atomic, write_provenance

    manifest = _manifest(recipe, args)
    pool_report: dict = {}
    pool = load_pool(manifest, target=recipe.run.target, report=pool_report)  # all before anything is written
    pool, report = contamination.check(pool, manifest)
    stats = build(manifest, pool, target=recipe.run.target, store_uri=recipe.run.store_uri, cfg=recipe.ingest)
    stats["contamination"] = report
    stats["pool"] = pool_report
    out = recipe.run.path("ingest")
    write_json_atomic(out / "stats.json", stats)
    write_provenance(out, config=recipe.to_dict(), extra={"manifest": to_dict(manifest)},
                     inputs={"manifest": args.manifest or recipe.ingest.manifest, "target": recipe.run.target})
    print(json.dumps({k: v for k, v in stats.items() if k != "failures"}, indent=2))
    for f in stats["failures"]:
        print(f"failed: {f['sample_id']}: {f['error']}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run("ingest", "Build the prompt pool and regenerate responses on-policy with vLLM.", {
        "validate": Command(cmd_validate, "validate a domain manifest, listing every problem", [MANIFEST_ARG]),
        "build": Command(cmd_build, "build the pool and regenerate responses", [MANIFEST_ARG]),
    }, argv)


if __name__ == "__main__":
    raise SystemExit(main())
