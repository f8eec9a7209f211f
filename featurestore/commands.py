"""The bodies of the ``featurestore`` subcommands (:mod:`eaglenest.featurestore.cli` names them).

The top of the feature store: it may use every room (table, read, capture, stream). Kept apart
from the CLI's argument table so that ``featurestore --help`` imports none of it (pyarrow, Lance,
the capture stack); :func:`eaglenest.featurestore.cli.main` imports this module only to run a
command. Each function is ``fn(recipe, args) -> int``.
"""

from __future__ import annotations

import collections
import contextlib
import json

from eaglenest import launch
from eaglenest.errors import ConfigError, EaglenestError, StoreError
from eaglenest.featurestore import schema
from eaglenest.featurestore.capture import build, identity, policy
from eaglenest.featurestore.interop import source
from eaglenest.featurestore.read import query
from eaglenest.featurestore.stream import xhost
from eaglenest.featurestore.table import integrity, lease, maintenance, names, objects, store, versions
from eaglenest.hf import check_remote_code
from eaglenest.paths import ensure_writable, user_path
from eaglenest.precheck import check_max_model_len
from eaglenest.provenance import write_json_atomic, write_provenance


def cmd_capture(recipe, args) -> int:
    check_remote_code(recipe.run.target, trust_remote_code=recipe.run.trust_remote_code)  # fail fast
    check_max_model_len(recipe.run.target, recipe.featurestore.engine.max_model_len, where="featurestore.engine")
    if not store.exists(recipe.run.store_uri, store.PROMPTS):  # refused before anything is written
        raise StoreError(f"no prompts table in {recipe.run.store_uri}: run `ingest build` first")
    # Before the engine starts; not kept: the capture may still refuse its input (featurestore.layer_ids).
    ensure_writable(recipe.run.path("featurestore"), "run.workdir", keep=False)
    ensure_writable(recipe.run.store_uri, "run.store" if recipe.run.store else "run.workdir")
    # The prompts table's own record, not <workdir>/ingest/stats.json (another store's when run.store is
    # set; a damaged one was a JSONDecodeError traceback).
    hashes = [lin["manifest_hash"] for lin in policy.response_lineages(recipe.run.store_uri) or []
              if lin.get("manifest_hash")]
    lineage = {"manifest_hash": hashes[-1] if hashes else None,
               "prompts_version": _version(recipe.run.store_uri, "prompts")}
    stats = build.capture(target=recipe.run.target, store_uri=recipe.run.store_uri, cfg=recipe.featurestore,
                          lineage=lineage, off_policy=recipe.run.off_policy, trust_remote_code=recipe.run.trust_remote_code)
    out = recipe.run.path("featurestore")
    write_json_atomic(out / "stats.json", stats)
    # inputs: what it was captured from (the prompts version read before the capture); outputs: what it wrote
    write_provenance(out, config=recipe.to_dict(), inputs={
        **identity.target_record(recipe.run.target), "store": recipe.run.store_uri,
        "prompts_version": lineage["prompts_version"], "manifest_hash": lineage["manifest_hash"]},
        extra={"outputs": {"store": recipe.run.store_uri, "table": stats["table"],
                           "version": stats["features_table_version"], "feature_set_id": stats["feature_set_id"],
                           "reused": stats["reused"]}})
    print(json.dumps(stats, indent=2))
    return 0


def _version(uri: str, name: str):
    return store.latest_version(uri, name) if store.exists(uri, name) else None


def _store_must_exist(recipe) -> str:
    """The store URI of a command that only reads it: a local store that is not there is refused (a
    mistyped run.store or run.workdir would otherwise read as an empty store)."""
    uri = recipe.run.store_uri
    key = "run.store" if recipe.run.store else "run.workdir"
    if not objects.is_remote(uri):
        user_path(uri, key, error=StoreError, resolve=False)  # a name too long, a NUL, a loop: one line
    if not objects.is_remote(uri) and not objects.exists(uri, directory=True):
        raise StoreError(f"{key}: no store at {uri} (check {key}, or run `ingest build` first)")
    return uri


def cmd_show(recipe, args) -> int:
    """Every table of the store; one that cannot be read is marked in the report with the line saying
    why, the others still listed, and the command fails at the end with that line (exit 2)."""
    uri = _store_must_exist(recipe)
    report, unreadable = {"store": uri, "tables": {}}, []
    for name in store.table_names(uri):  # every feature set's table, not only the default one's
        try:
            report["tables"][name] = _table_info(uri, name)
        except EaglenestError as exc:  # a damaged file or manifest: one line naming it, not its rows
            report["tables"][name] = {"error": str(exc)}
            unreadable.append(name)
    print(json.dumps(report, indent=2))
    if unreadable:  # the first one's line; the report above says why for each, and lists the others
        first, *rest = unreadable
        more = f"; table(s) {', '.join(rest)} cannot be read either (the report above says why)" if rest else ""
        raise StoreError(report["tables"][first]["error"] + more)
    return 0


def _table_info(uri: str, name: str) -> dict:
    """``show``'s entry for one table: its latest version, row counts per domain/split, versions, tags."""
    ds = integrity.checked_dataset(uri, name)
    with store.unreadable(uri, name, ds.version):
        t = ds.to_table(columns=["domain", "split"])
    counts = collections.Counter(zip(t.column("domain").to_pylist(), t.column("split").to_pylist()))
    info = {"version": ds.version, "rows": ds.count_rows(),
            "versions": [v["version"] for v in store.version_list(ds, uri, name)],
            "tags": sorted(store.tag_list(ds, uri, name)),
            "counts": {f"{d}/{s}": n for (d, s), n in sorted(counts.items())}}
    if store.is_features(name):
        info["meta"] = json.loads(schema.feature_meta(ds.schema).to_json())
    return info


def _print(obj) -> int:
    print(json.dumps(obj, indent=2, default=str))
    return 0


def _ver(text, what: str = "--version"):
    return names.version_arg(text, what)


def _t(recipe):
    """(store, table) of a command on featurestore.table; a table that is not there is refused here,
    before a maintenance command would create its lease files in a store that may not exist."""
    uri, name = _store_must_exist(recipe), recipe.featurestore.table
    if not store.exists(uri, name):
        raise StoreError(f"featurestore.table: no table '{name}' in store {uri} (tables: "
                         f"{', '.join(store.table_names(uri)) or 'none'}; run `featurestore capture` first)")
    return uri, name


def cmd_versions(recipe, args) -> int:
    return _print(versions.list_versions(*_t(recipe)))


def cmd_tags(recipe, args) -> int:
    # ``is not None``: an empty name (``--create "$UNSET"``) is a bad tag name, not no option
    if args.version is not None and args.create is None:
        raise ConfigError("tags: --version goes with --create NAME (the version the new tag points at)")
    if args.create is not None and args.delete is not None:  # one would be written before the other could fail
        raise ConfigError("tags: --create and --delete are one at a time; run `featurestore tags` twice")
    if args.create is not None:
        versions.set_tag(*_t(recipe), args.create, _ver(args.version))
    if args.delete is not None:
        versions.delete_tag(*_t(recipe), args.delete)
    uri, name = _t(recipe)
    return _print({k: v["version"] for k, v in store.tag_list(store.dataset(uri, name), uri, name).items()})


def cmd_diff(recipe, args) -> int:
    return _print(versions.diff(*_t(recipe), _ver(args.a, "--a"), _ver(args.b, "--b")))


def cmd_checkout(recipe, args) -> int:
    return _print(versions.summary(*_t(recipe), _ver(args.v, "--v")))


def cmd_restore(recipe, args) -> int:
    v = _ver(args.v, "--v")
    return _print({"restored": v, "new_version": versions.restore(*_t(recipe), v)})


def cmd_verify(recipe, args) -> int:
    report = maintenance.verify(*_t(recipe), version=_ver(args.version))
    _print(report)
    maintenance.require_ok(report)
    return 0


def cmd_compact(recipe, args) -> int:
    return _print(maintenance.compact(*_t(recipe)))


def cmd_gc(recipe, args) -> int:
    return _print(maintenance.gc(*_t(recipe), older_than_hours=args.older_than_hours,
                                 grace_hours=args.grace_hours))


def cmd_query(recipe, args) -> int:
    bad = [a for a in args.attach or [] if "=" not in a or not a.split("=", 1)[0] or not a.split("=", 1)[1]]
    if bad:
        raise ConfigError(f"--attach {bad[0][:80]!r}: expected name=file.parquet (or name=file.csv)")
    if args.max_rows < 0:
        raise ConfigError(f"--max-rows: must be >= 0, got {args.max_rows}")
    attach = _attachments(args.attach or [])
    pinned = {recipe.featurestore.table: _ver(args.version)} if args.version is not None else None
    kw = {"versions": pinned, "with_tensors": args.with_tensors, "attach": attach}
    query.check_read_only(args.sql)  # the statement before the store: bad input is named first
    uri = _store_must_exist(recipe)
    if args.out and source.inside_store(args.out, uri):
        raise ConfigError(f"--out {args.out}: inside the feature store ({uri}); write the result outside it")
    with _pin_read(uri, pinned):  # a compact and gc meanwhile must not delete the files being read
        if args.out:  # streamed into the file batch by batch (bounded memory, whatever the table's size)
            rows = query.write_query(uri, args.sql, args.out, config=recipe.to_dict(), **kw)
            print(f"{rows} rows -> {args.out}")
            return 0
        # max_rows 0: every row printed; else only what the printout shows is kept (bounded memory)
        table = query.preview_query(uri, args.sql, max_rows=args.max_rows, **kw) if args.max_rows \
            else query.run_query(uri, args.sql, **kw)
    print(table.to_pandas().to_string(index=False, max_rows=args.max_rows))
    return 0


def _pin_read(uri: str, pinned: dict | None) -> contextlib.ExitStack:
    """Pin the version of every table a query may read (``gc`` keeps it and every newer one), as an
    export and a training run do: a long query would otherwise fail half-way when a ``compact`` and a
    ``gc`` removed the files of the version it had opened."""
    stack = contextlib.ExitStack()
    for name in store.table_names(uri):
        try:
            version = store.dataset(uri, name, (pinned or {}).get(name)).version
        except StoreError:  # the query names the problem (a missing version, a rolled-back table) itself
            continue
        stack.enter_context(lease.pin(uri, name, version, purpose="featurestore query"))
    return stack


def _attachments(items: list[str]) -> dict[str, str]:
    """``--attach NAME=FILE`` items as {NAME: FILE}; a NAME given twice would silently read the last FILE."""
    out: dict[str, str] = {}
    for name, path in (a.split("=", 1) for a in items):
        if name in out:
            raise ConfigError(f"--attach {name!r}: given twice ({out[name]}, {path}); give each name once")
        out[name] = path
    return out


def cmd_stream_serve(recipe, args) -> int:
    launch.import_torch_quietly()  # a foreign service at --addr: one line, not its C++ retries
    return xhost.serve(args.addr, args.engine_rank, target=args.target, timeout_s=args.timeout_s)

