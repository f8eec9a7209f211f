"""``serve``: export a trained draft for vLLM and run an OpenAI-compatible server with it.

    serve export [--out DIR] [k=v ...]     vLLM-loadable LlamaForCausalLMEagle3 directory
                                           (serve.format=speculators: speculators' own layout)
    serve up [--no-spec] [k=v ...]         managed vLLM server until Ctrl-C (or --for-seconds)
    serve push serve.hub_repo_id=ns/name   the exported draft + model card to the Hugging Face Hub

``up`` and ``push`` are :mod:`eaglenest.serve.commands`, ``export`` is
:mod:`eaglenest.serve.export_command` (torch and the trainer's checkpoint format, which the other two
do not need); each is imported when its subcommand runs, so ``--help`` imports neither.
"""

from __future__ import annotations

from eaglenest.cli import Command, path_text, run


COMMANDS = {
    "export": Command("eaglenest.serve.export_command:cmd_export",
                      "export the trained draft for vLLM (LlamaForCausalLMEagle3; "
                      "serve.format=speculators: speculators' checkpoint format)",
                      args=[(("--out",), dict(default=None, type=path_text, help="output directory "
                                                                   "(default: <workdir>/<serve.draft_subdir>)"))]),
    "push": Command("eaglenest.serve.commands:cmd_push",
                    "upload the exported draft and its model card to the Hugging Face Hub "
                    "(serve.hub_repo_id, serve.hub_visibility, serve.hub_revision; token from HF_TOKEN)"),
    "up": Command("eaglenest.serve.commands:cmd_up", "start an OpenAI-compatible vLLM server for target + draft",
                  args=[(("--no-spec",), dict(action="store_true", help="serve the target without speculation")),
                        (("--for-seconds",), dict(type=float, default=0.0,
                                                  help="stop after this many seconds (0 = until Ctrl-C)"))]),
}


def main(argv: list[str] | None = None) -> int:
    return run("serve", "Export and serve EAGLE-3 drafts.", COMMANDS, argv)


if __name__ == "__main__":
    raise SystemExit(main())
