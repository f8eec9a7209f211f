"""``serve``: export a trained draft for vLLM and run an OpenAI-compatible server with it.

    serve export [--out DIR] [k=v ...]     vLLM-loadable LlamaForCausalLMEagle3 directory
                                           (serve.format=speculators: speculators' own layout)
    serve up [--no-spec] [k=v ...]         managed vLLM server until Ctrl-C (or --for-seconds)
    serve push serve.hub_repo_id=ns/name   the exported draft + model card to the Hugging Face Hub
"""

from __future__ import annotations

import json
import sys
import time

from eaglenest.cli import Command, run


def _export(recipe, args) -> int:
    from eaglenest.serve.export import export_draft

    r, s = recipe.run, recipe.serve
    out = args.out or str(r.path(s.draft_subdir))
    path = export_draft(r.path(s.checkpoint_subdir), out, target_dir=r.target, dtype=s.dtype,
                        quantization=s.quantization, format=s.format,
                        num_speculative_tokens=s.num_speculative_tokens, argv=sys.argv, recipe=recipe.to_dict())
    print(f"draft: {path}")
    return 0


def up_server(recipe, *, no_spec: bool = False):
    """The (not yet started) server ``serve up`` runs: serve.host:serve.port, the target's name."""
    from eaglenest.serve.server import Server

    r, s = recipe.run, recipe.serve
    draft = None if no_spec else str(r.path(s.draft_subdir))
    return Server(r.target, draft=draft, num_speculative_tokens=s.num_speculative_tokens,
                  memory_fraction=s.gpu_memory_utilization, max_model_len=s.max_model_len,
                  log_dir=r.path("serve"), trust_remote_code=r.trust_remote_code, host=s.host, port=s.port,
                  served_name=s.served_model_name or r.target)


def _up(recipe, args) -> int:
    r = recipe.run
    server = up_server(recipe, no_spec=args.no_spec)
    draft = None if args.no_spec else str(r.path(recipe.serve.draft_subdir))
    with server:
        print(f"serving {r.target}" + (f" with draft {draft}" if draft else " without speculation")
              + f" at {server.url}/v1 (model name '{server.served_name}'; log {server.log_path}); Ctrl-C stops it",
              flush=True)
        deadline = time.monotonic() + args.for_seconds if args.for_seconds else None
        while server.proc.poll() is None and (deadline is None or time.monotonic() < deadline):
            time.sleep(0.5)
        code = server.proc.poll()
    if code not in (None, 0) and not args.for_seconds:
        print(f"serve: error: server exited with code {code} (log {server.log_path})", file=sys.stderr)
        return 2
    return 0


def _push(recipe, args) -> int:
    from eaglenest.serve.push import check_repo_id, plan_push, push_draft, resolve_token

    r, s = recipe.run, recipe.serve
    check_repo_id(s.hub_repo_id)
    draft = r.path(s.draft_subdir)
    report_path = r.path("eval", "report.json")  # where `evaluate al` writes it
    report = json.loads(report_path.read_text()) if report_path.is_file() else None
    name, licences = _licences(recipe.ingest.manifest)
    plan = plan_push(draft, repo_id=s.hub_repo_id, revision=s.hub_revision, visibility=s.hub_visibility,
                     licences=licences, manifest_name=name, report=report)  # no draft: exit 2 here
    url = push_draft(plan, token=resolve_token())
    print(f"pushed {draft} ({len(plan.files)} files) to {s.hub_repo_id}@{s.hub_revision}: {url}")
    return 0


def _licences(manifest_path: str) -> tuple[str, dict[str, str]]:
    """(manifest name, {source: licence}): each source's licence, or the manifest's default."""
    from eaglenest.errors import ConfigError, ManifestError
    from eaglenest.ingest.manifest import load_manifest

    try:
        m = load_manifest(manifest_path)
    except ManifestError as exc:
        raise ConfigError(f"ingest.manifest: serve push takes the data licence from it: {exc}") from None
    return m.name, {f"{d}: {src.path or src.hf_id}": src.licence or m.licence or "unspecified"
                    for d, dom in m.domains.items() for src in dom.sources}


COMMANDS = {
    "export": Command(_export, "export the trained draft for vLLM (LlamaForCausalLMEagle3; "
                              "serve.format=speculators: speculators' checkpoint format)",
                      args=[(("--out",), dict(default=None, help="output directory "
                                                                   "(default: <workdir>/<serve.draft_subdir>)"))]),
    "push": Command(_push, "upload the exported draft and its model card to the Hugging Face Hub "
                           "(serve.hub_repo_id, serve.hub_visibility, serve.hub_revision; token from HF_TOKEN)"),
    "up": Command(_up, "start an OpenAI-compatible vLLM server for target + draft",
                  args=[(("--no-spec",), dict(action="store_true", help="serve the target without speculation")),
                        (("--for-seconds",), dict(type=float, default=0.0,
                                                  help="stop after this many seconds (0 = until Ctrl-C)"))]),
}


def main(argv: list[str] | None = None) -> int:
    return run("serve", "Export and serve EAGLE-3 drafts.", COMMANDS, argv)


if __name__ == "__main__":
    raise SystemExit(main())
