"""``evaluate``: measure a draft under vLLM speculative decoding.

    evaluate al [k=v ...]   acceptance length per domain and overall, per-position acceptance
"""

from __future__ import annotations

from eaglenest.cli import Command, run


def cmd_al(recipe, args) -> int:
    from eaglenest.evaluate.report import markdown, write_report
    from eaglenest.evaluate.run import evaluate_al
    from eaglenest.featurestore import store
    from eaglenest.provenance import write_provenance

    cfg = recipe.evaluate
    draft = cfg.draft or str(recipe.run.path("draft"))
    report = evaluate_al(target=recipe.run.target, draft=draft, store_uri=recipe.run.store_uri, cfg=cfg)
    out = recipe.run.path("eval")
    write_report(out, report)
    write_provenance(out, config=recipe.to_dict(), inputs={
        "target": recipe.run.target, "draft": draft, "store": recipe.run.store_uri,
        "prompts_version": store.latest_version(recipe.run.store_uri, store.PROMPTS)})
    print(markdown(report))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run("evaluate", "Measure acceptance length of a draft under vLLM speculative decoding.", {
        "al": Command(cmd_al, "acceptance length per domain, from vLLM's spec-decode metrics"),
    }, argv)


if __name__ == "__main__":
    raise SystemExit(main())
