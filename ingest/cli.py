"""``ingest``: build the prompt pool and regenerate responses on-policy.

    ingest validate [--manifest M]        check a manifest, print every problem (key first), exit 2
    ingest build [--manifest M] [k=v ...] pool + contamination check + regeneration into the store

The subcommands are :mod:`eaglenest.ingest.commands`, imported when one runs (the feature store,
pyarrow); ``--help`` imports nothing but the CLI plumbing.
"""

from __future__ import annotations

from eaglenest.cli import Command, path_text, run

MANIFEST_ARG = (("--manifest",), {"default": None, "type": path_text,  # empty: refused, not ingest.manifest
                                   "help": "domain manifest YAML (default: ingest.manifest)"})


def main(argv: list[str] | None = None) -> int:
    return run("ingest", "Build the prompt pool and regenerate responses on-policy with vLLM.", {
        "validate": Command("eaglenest.ingest.commands:cmd_validate",
                            "validate a domain manifest, listing every problem", [MANIFEST_ARG]),
        "build": Command("eaglenest.ingest.commands:cmd_build", "build the pool and regenerate responses",
                         [MANIFEST_ARG]),
    }, argv)


if __name__ == "__main__":
    raise SystemExit(main())
