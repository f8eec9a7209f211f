"""``serve export``: turn the run's draft checkpoint into a vLLM-loadable EAGLE-3 directory."""

from __future__ import annotations

import sys

from eaglenest.cli import Command, run


def _export(recipe, args) -> int:
    from eaglenest.serve.export import export_draft

    r, s = recipe.run, recipe.serve
    out = args.out or str(r.path(s.draft_subdir))
    path = export_draft(r.path(s.checkpoint_subdir), out, target_dir=r.target, dtype=s.dtype,
                        argv=sys.argv, recipe=recipe.to_dict())
    print(f"draft: {path}")
    return 0


COMMANDS = {
    "export": Command(_export, "export the trained draft for vLLM (LlamaForCausalLMEagle3)",
                      args=[(("--out",), dict(default=None, help="output directory "
                                                                   "(default: <workdir>/<serve.draft_subdir>)"))]),
}


def main(argv: list[str] | None = None) -> int:
    return run("serve", "Export and serve EAGLE-3 drafts.", COMMANDS, argv)


if __name__ == "__main__":
    raise SystemExit(main())
