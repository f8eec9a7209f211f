"""``evaluate``: measure a draft under vLLM speculative decoding.

    evaluate al [k=v ...]                 AL per domain/category and per context bucket, both averages
    evaluate throughput [k=v ...]         tokens/s, speed-up, TTFT and latency across a concurrency sweep
    evaluate compare --a A --b B [k=v ...]  two drafts (dirs) or two reports (report.json) side by side
"""

from __future__ import annotations

import sys

from eaglenest.cli import Command, run


def draft_dir(recipe) -> str:
    """The draft evaluated: ``evaluate.draft``, else where ``serve export`` writes it."""
    return recipe.evaluate.draft or str(recipe.run.path(recipe.serve.draft_subdir))


def cmd_al(recipe, args) -> int:
    from eaglenest.evaluate.report import markdown, write_report
    from eaglenest.evaluate.run import evaluate_al
    from eaglenest.provenance import write_provenance

    cfg, draft = recipe.evaluate, draft_dir(recipe)
    report = evaluate_al(target=recipe.run.target, draft=draft, store_uri=recipe.run.store_uri, cfg=cfg)
    out = args.out or str(recipe.run.path("eval"))
    write_report(out, report)
    write_provenance(out, config=recipe.to_dict(), argv=sys.argv, inputs=_inputs(recipe, draft))
    print(markdown(report))
    return 0


def _inputs(recipe, draft: str) -> dict:
    from eaglenest.featurestore import store

    uri = recipe.run.store_uri
    version = store.latest_version(uri, store.PROMPTS) if store.exists(uri, store.PROMPTS) else None
    return {"target": recipe.run.target, "draft": draft, "store": uri, "prompts_version": version,
            "prompt_path": recipe.evaluate.prompt_path or None}


def cmd_throughput(recipe, args) -> int:
    from eaglenest.evaluate.throughput import markdown, run_sweep
    from eaglenest.evaluate.plots import throughput_plot
    from eaglenest.provenance import write_json_atomic, write_provenance

    draft = draft_dir(recipe)
    result = run_sweep(target=recipe.run.target, draft=draft, store_uri=recipe.run.store_uri,
                       cfg=recipe.evaluate, serve_cfg=recipe.serve, log_dir=recipe.run.path("serve"))
    out = recipe.run.path(args.out or "throughput")
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "throughput.json", result)
    (out / "throughput.md").write_text(markdown(result), encoding="utf-8")
    throughput_plot(result, out)
    write_provenance(out, config=recipe.to_dict(), argv=sys.argv, inputs=_inputs(recipe, draft))
    print(markdown(result))
    return 0


def cmd_compare(recipe, args) -> int:
    from eaglenest.evaluate.compare import compare

    out = recipe.run.path(args.out or "compare")
    print(compare(args.a, args.b, recipe=recipe, outdir=out))
    return 0


def main(argv: list[str] | None = None) -> int:
    out = (("--out",), dict(default=None, help="output directory"))
    return run("evaluate", "Measure a draft under vLLM speculative decoding.", {
        "al": Command(cmd_al, "AL per domain and context bucket, from vLLM's spec-decode metrics", args=[out]),
        "throughput": Command(cmd_throughput, "throughput and latency against concurrency, with and "
                                              "without speculation", args=[out]),
        "compare": Command(cmd_compare, "two drafts or two report.json files side by side",
                           args=[(("--a",), dict(required=True, help="draft directory or report.json")),
                                 (("--b",), dict(required=True, help="draft directory or report.json")), out]),
    }, argv)


if __name__ == "__main__":
    raise SystemExit(main())
