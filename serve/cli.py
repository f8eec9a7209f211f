"""``serve``: export a trained draft for vLLM and run an OpenAI-compatible server with it.

    serve export [--out DIR] [k=v ...]     vLLM-loadable LlamaForCausalLMEagle3 directory
    serve up [--no-spec] [k=v ...]         managed vLLM server until Ctrl-C (or --for-seconds)
"""

from __future__ import annotations

import sys
import time

from eaglenest.cli import Command, run


def _export(recipe, args) -> int:
    from eaglenest.serve.export import export_draft

    r, s = recipe.run, recipe.serve
    out = args.out or str(r.path(s.draft_subdir))
    path = export_draft(r.path(s.checkpoint_subdir), out, target_dir=r.target, dtype=s.dtype,
                        quantization=s.quantization, argv=sys.argv, recipe=recipe.to_dict())
    print(f"draft: {path}")
    return 0


def _up(recipe, args) -> int:
    from eaglenest.serve.server import Server

    r, s = recipe.run, recipe.serve
    draft = None if args.no_spec else str(r.path(s.draft_subdir))
    server = Server(r.target, draft=draft, num_speculative_tokens=s.num_speculative_tokens,
                    memory_fraction=s.gpu_memory_utilization, max_model_len=s.max_model_len,
                    log_dir=r.path("serve"))
    with server:
        print(f"serving {r.target}" + (f" with draft {draft}" if draft else " without speculation")
              + f" at {server.url}/v1 (model name 'target'; log {server.log_path}); Ctrl-C stops it",
              flush=True)
        deadline = time.monotonic() + args.for_seconds if args.for_seconds else None
        while server.proc.poll() is None and (deadline is None or time.monotonic() < deadline):
            time.sleep(0.5)
        code = server.proc.poll()
    if code not in (None, 0) and not args.for_seconds:
        print(f"serve: error: server exited with code {code} (log {server.log_path})", file=sys.stderr)
        return 2
    return 0


COMMANDS = {
    "export": Command(_export, "export the trained draft for vLLM (LlamaForCausalLMEagle3)",
                      args=[(("--out",), dict(default=None, help="output directory "
                                                                   "(default: <workdir>/<serve.draft_subdir>)"))]),
    "up": Command(_up, "start an OpenAI-compatible vLLM server for target + draft",
                  args=[(("--no-spec",), dict(action="store_true", help="serve the target without speculation")),
                        (("--for-seconds",), dict(type=float, default=0.0,
                                                  help="stop after this many seconds (0 = until Ctrl-C)"))]),
}


def main(argv: list[str] | None = None) -> int:
    return run("serve", "Export and serve EAGLE-3 drafts.", COMMANDS, argv)


if __name__ == "__main__":
    raise SystemExit(main())
