"""``featurestore``: capture hidden states and inspect the store.

    featurestore capture [k=v ...]   hidden states for every on-policy conversation not yet stored
    featurestore show [k=v ...]      tables, versions and counts per domain
"""

from __future__ import annotations

import json

from eaglenest.cli import Command, run


def cmd_capture(recipe, args) -> int:
    from eaglenest.featurestore.build import capture
    from eaglenest.provenance import write_json_atomic, write_provenance

    stats = capture(target=recipe.run.target, store_uri=recipe.run.store_uri, cfg=recipe.featurestore)
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


def main(argv: list[str] | None = None) -> int:
    return run("featurestore", "Capture and inspect the versioned feature store.", {
        "capture": Command(cmd_capture, "capture hidden states for stored conversations"),
        "show": Command(cmd_show, "tables, versions and per-domain counts"),
    }, argv)


if __name__ == "__main__":
    raise SystemExit(main())
