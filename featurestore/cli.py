"""``featurestore``: capture hidden states and inspect the store.

    featurestore capture [k=v ...]   hidden states for every on-policy conversation not yet stored
    featurestore show [k=v ...]      tables, versions and counts per domain
    featurestore versions | tags | diff A B | checkout V | restore V    versions of featurestore.table
    featurestore verify | compact | gc --older-than-hours N             maintenance
    featurestore query "SELECT ..." [--out f.csv|f.parquet] [--attach name=file] [--with-tensors]
    featurestore stream-serve --addr HOST:PORT --engine-rank I [--target DIR]   one engine host of a
                                     cross-host capture stream (train.stream_transport=gloo)
"""

from __future__ import annotations

import json

from eaglenest.cli import Command, run


def cmd_capture(recipe, args) -> int:
    from eaglenest.featurestore.build import capture
    from eaglenest.hf import check_remote_code
    from eaglenest.paths import ensure_writable
    from eaglenest.provenance import write_json_atomic, write_provenance

    check_remote_code(recipe.run.target, trust_remote_code=recipe.run.trust_remote_code)  # fail fast
    ensure_writable(recipe.run.path("featurestore"), "run.workdir")  # before the engine starts
    ensure_writable(recipe.run.store_uri, "run.store" if recipe.run.store else "run.workdir")
    ingest_stats = recipe.run.path("ingest") / "stats.json"
    manifest_hash = json.loads(ingest_stats.read_text()).get("manifest_hash") if ingest_stats.is_file() else None
    lineage = {"manifest_hash": manifest_hash, "prompts_version": _version(recipe.run.store_uri, "prompts")}
    stats = capture(target=recipe.run.target, store_uri=recipe.run.store_uri, cfg=recipe.featurestore,
                    lineage=lineage, off_policy=recipe.run.off_policy, trust_remote_code=recipe.run.trust_remote_code)
    out = recipe.run.path("featurestore")
    write_json_atomic(out / "stats.json", stats)
    write_provenance(out, config=recipe.to_dict(), inputs={
        "target": recipe.run.target, "store": recipe.run.store_uri,
        "prompts_version": _version(recipe.run.store_uri, "prompts")})
    print(json.dumps(stats, indent=2))
    return 0


def _version(uri: str, name: str):
    from eaglenest.featurestore import store

    return store.latest_version(uri, name) if store.exists(uri, name) else None


def cmd_show(recipe, args) -> int:
    import collections

    from eaglenest.featurestore import schema, store

    uri = recipe.run.store_uri
    report = {"store": uri, "tables": {}}
    for name in (store.PROMPTS, store.FEATURES):
        if not store.exists(uri, name):
            continue
        ds = store.dataset(uri, name)
        cols = ["domain", "split"]
        t = ds.to_table(columns=cols)
        counts = collections.Counter(zip(t.column("domain").to_pylist(), t.column("split").to_pylist()))
        info = {"version": ds.version, "rows": ds.count_rows(),
                "versions": [v["version"] for v in ds.versions()], "tags": sorted(ds.tags.list()),
                "counts": {f"{d}/{s}": n for (d, s), n in sorted(counts.items())}}
        if name == store.FEATURES:
            info["meta"] = json.loads(schema.feature_meta(ds.schema).to_json())
        report["tables"][name] = info
    print(json.dumps(report, indent=2))
    return 0


def _print(obj) -> int:
    print(json.dumps(obj, indent=2, default=str))
    return 0


def _ver(text):
    return None if text is None else int(text) if str(text).isdigit() else text


def _t(recipe):
    return recipe.run.store_uri, recipe.featurestore.table


def cmd_versions(recipe, args) -> int:
    from eaglenest.featurestore import versions

    return _print(versions.list_versions(*_t(recipe)))


def cmd_tags(recipe, args) -> int:
    from eaglenest.featurestore import store, versions

    if args.create:
        versions.set_tag(*_t(recipe), args.create, _ver(args.version))
    if args.delete:
        versions.delete_tag(*_t(recipe), args.delete)
    return _print({k: v["version"] for k, v in store.dataset(*_t(recipe)).tags.list().items()})


def cmd_diff(recipe, args) -> int:
    from eaglenest.featurestore import versions

    return _print(versions.diff(*_t(recipe), _ver(args.a), _ver(args.b)))


def cmd_checkout(recipe, args) -> int:
    from eaglenest.featurestore import versions

    return _print(versions.summary(*_t(recipe), _ver(args.v)))


def cmd_restore(recipe, args) -> int:
    from eaglenest.featurestore import versions

    return _print({"restored": _ver(args.v), "new_version": versions.restore(*_t(recipe), _ver(args.v))})


def cmd_verify(recipe, args) -> int:
    from eaglenest.featurestore import maintenance

    report = maintenance.verify(*_t(recipe), version=_ver(args.version))
    _print(report)
    maintenance.require_ok(report)
    return 0


def cmd_compact(recipe, args) -> int:
    from eaglenest.featurestore import maintenance

    return _print(maintenance.compact(*_t(recipe)))


def cmd_gc(recipe, args) -> int:
    from eaglenest.featurestore import maintenance

    return _print(maintenance.gc(*_t(recipe), older_than_hours=args.older_than_hours,
                                 grace_hours=args.grace_hours))


def cmd_query(recipe, args) -> int:
    from eaglenest.errors import ConfigError
    from eaglenest.featurestore import query

    attach = dict(a.split("=", 1) for a in args.attach or [])
    versions = {recipe.featurestore.table: _ver(args.version)} if args.version else None
    table = query.run_query(recipe.run.store_uri, args.sql, versions=versions, with_tensors=args.with_tensors,
                            attach=attach)
    if args.out:
        if args.out.endswith(".parquet"):
            import pyarrow.parquet as pq

            pq.write_table(table, args.out)
        elif args.out.endswith(".csv"):
            import pyarrow.csv as pcsv

            pcsv.write_csv(table, args.out)
        else:
            raise ConfigError(f"--out {args.out}: use a .csv or .parquet file name")
        print(f"{table.num_rows} rows -> {args.out}")
    else:
        print(table.to_pandas().to_string(index=False, max_rows=args.max_rows))
    return 0


def cmd_stream_serve(recipe, args) -> int:
    from eaglenest.featurestore.stream_xhost import serve

    return serve(args.addr, args.engine_rank, target=args.target, timeout_s=args.timeout_s)


_VERSION = (("--version",), {"default": None, "help": "table version number or tag (default latest)"})


def main(argv: list[str] | None = None) -> int:
    return run("featurestore", "Capture and inspect the versioned feature store.", {
        "capture": Command(cmd_capture, "capture hidden states for stored conversations"),
        "show": Command(cmd_show, "tables, versions and per-domain counts"),
        "versions": Command(cmd_versions, "versions of featurestore.table with tags and lineage"),
        "tags": Command(cmd_tags, "list tags; --create NAME [--version V] or --delete NAME", [
            (("--create",), {"default": None}), (("--delete",), {"default": None}), _VERSION]),
        "diff": Command(cmd_diff, "sample ids added/removed between two versions", [
            (("--a",), {"required": True}), (("--b",), {"required": True})]),
        "checkout": Command(cmd_checkout, "counts and lineage at one version (read-only)", [
            (("--v",), {"required": True})]),
        "restore": Command(cmd_restore, "make an old version the latest (history kept)", [
            (("--v",), {"required": True})]),
        "verify": Command(cmd_verify, "row counts, checksums, schema, NaN/inf scan", [_VERSION]),
        "compact": Command(cmd_compact, "merge small fragments (a new version)"),
        "gc": Command(cmd_gc, "drop untagged versions older than N hours", [
            (("--older-than-hours",), {"type": float, "required": True}),
            (("--grace-hours",), {"type": float, "default": 1.0,
                                  "help": "keep uncommitted data files younger than this (default 1)"})]),
        "query": Command(cmd_query, "read-only SQL over the store's tables", [
            (("--sql",), {"required": True}), (("--out",), {"default": None}),
            (("--attach",), {"action": "append", "help": "name=file.parquet|csv"}),
            (("--with-tensors",), {"action": "store_true"}), (("--max-rows",), {"type": int, "default": 50}),
            _VERSION]),
        "stream-serve": Command(cmd_stream_serve, "run one capture engine of a cross-host stream", [
            (("--addr",), {"required": True, "help": "the trainer's train.stream_addr (host:port)"}),
            (("--engine-rank",), {"type": int, "required": True, "help": "0..train.stream_engines-1"}),
            (("--target",), {"default": None, "help": "target directory on this host (default: the trainer's)"}),
            (("--timeout-s",), {"type": float, "default": 1800.0, "help": "longest wait for a peer"})],
            needs_recipe=False),
    }, argv)


if __name__ == "__main__":
    raise SystemExit(main())
