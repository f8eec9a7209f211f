"""``featurestore``: capture hidden states and inspect the store.

    featurestore capture [k=v ...]   hidden states for every on-policy conversation not yet stored
    featurestore show [k=v ...]      tables, versions and counts per domain
    featurestore versions | tags [--create NAME [--version V] | --delete NAME]   versions of featurestore.table
    featurestore diff --a A --b B | checkout --v V | restore --v V     (V: a version number or a tag)
    featurestore verify [--version V] | compact | gc --older-than-hours N    maintenance
    featurestore query --sql "SELECT ..." [--out f.csv|f.parquet] [--attach name=file] [--with-tensors]
    featurestore stream-serve --addr HOST:PORT --engine-rank I [--target DIR]   one engine host of a
                                     cross-host capture stream (train.stream.transport=gloo)
    featurestore export --format speculators|specforge|hf --out DIR [--version V]   to a peer trainer
    featurestore import --format speculators|specforge --src DIR                    a peer's dump in
"""

from __future__ import annotations

from eaglenest.cli import Command, run

#: The subcommands' bodies, named ``module:function`` and imported only when a command runs: they use
#: every room of the feature store (pyarrow, Lance, the capture stack), which ``--help`` must not load.
_COMMANDS = "eaglenest.featurestore.commands"
#: The bodies of ``export`` and ``import`` (docs/export.md, docs/import.md).
_INTEROP = "eaglenest.featurestore.interop.commands"
_VERSION = (("--version",), {"default": None, "help": "table version number or tag (default latest)"})


def main(argv: list[str] | None = None) -> int:
    return run("featurestore", "Capture and inspect the versioned feature store.", {
        "capture": Command(f"{_COMMANDS}:cmd_capture", "capture hidden states for stored conversations"),
        "show": Command(f"{_COMMANDS}:cmd_show", "tables, versions and per-domain counts"),
        "versions": Command(f"{_COMMANDS}:cmd_versions", "versions of featurestore.table with tags and lineage"),
        "tags": Command(f"{_COMMANDS}:cmd_tags", "list tags; --create NAME [--version V] or --delete NAME", [
            (("--create",), {"default": None, "help": "tag the version (--version, default latest) with this name"}),
            (("--delete",), {"default": None, "help": "remove this tag (the version stays)"}), _VERSION]),
        "diff": Command(f"{_COMMANDS}:cmd_diff", "sample ids added/removed between two versions", [
            (("--a",), {"required": True, "help": "the older version (number or tag)"}),
            (("--b",), {"required": True, "help": "the newer version (number or tag)"})]),
        "checkout": Command(f"{_COMMANDS}:cmd_checkout", "counts and lineage at one version (read-only)", [
            (("--v",), {"required": True, "help": "version number or tag"})]),
        "restore": Command(f"{_COMMANDS}:cmd_restore", "make an old version the latest (history kept)", [
            (("--v",), {"required": True, "help": "version number or tag to restore"})]),
        "verify": Command(f"{_COMMANDS}:cmd_verify", "row counts, checksums, schema, NaN/inf scan", [_VERSION]),
        "compact": Command(f"{_COMMANDS}:cmd_compact", "merge small fragments (a new version)"),
        "gc": Command(f"{_COMMANDS}:cmd_gc", "drop untagged versions older than N hours", [
            (("--older-than-hours",), {"type": float, "required": True,
                                        "help": "drop versions older than this; tagged and latest ones are kept"}),
            (("--grace-hours",), {"type": float, "default": 1.0,
                                  "help": "keep uncommitted data files younger than this (default 1)"})]),
        "query": Command(f"{_COMMANDS}:cmd_query", "read-only SQL over the store's tables", [
            (("--sql",), {"required": True, "help": "one SELECT/WITH statement; tables: features, prompts, ..."}),
            (("--out",), {"default": None, "help": "write every row to this .parquet or .csv file instead"}),
            (("--attach",), {"action": "append", "help": "name=file.parquet|csv|json|jsonl: a file joinable as a table"}),
            (("--with-tensors",), {"action": "store_true", "help": "include aux_hidden and last_hidden (bytes)"}),
            (("--max-rows",), {"type": int, "default": 50, "help": "rows printed (default 50; 0: all)"}),
            _VERSION]),
        "stream-serve": Command(f"{_COMMANDS}:cmd_stream_serve", "run one capture engine of a cross-host stream", [
            (("--addr",), {"required": True, "help": "the trainer's train.stream.addr (host:port)"}),
            (("--engine-rank",), {"type": int, "required": True, "help": "0..train.stream.engines-1"}),
            (("--target",), {"default": None, "help": "target directory on this host (default: the trainer's)"}),
            (("--timeout-s",), {"type": float, "default": 1800.0, "help": "longest wait for a peer"})],
            needs_recipe=False),
        "export": Command(f"{_INTEROP}:cmd_export", "a table version out to speculators, SpecForge or HF datasets", [
            (("--format",), {"required": True, "choices": ["speculators", "specforge", "hf"]}),
            (("--out",), {"required": True, "help": "a new directory"}), _VERSION,
            (("--draft-vocab-size",), {"type": int, "default": None,
                                       "help": "d2t/t2d for this draft vocabulary (default train.draft_vocab_size; 0: none)"}),
            (("--with-tensors",), {"action": "store_true", "help": "hf: include aux_hidden and last_hidden"})]),
        "import": Command(f"{_INTEROP}:cmd_import", "a speculators or SpecForge hidden-state dump in, as one version", [
            (("--format",), {"required": True, "choices": ["speculators", "specforge"]}),
            (("--src",), {"required": True, "help": "the dump's directory"}),
            (("--domain",), {"default": "imported", "help": "domain of rows the dump does not name (default imported)"})]),
    }, argv)


if __name__ == "__main__":
    raise SystemExit(main())
