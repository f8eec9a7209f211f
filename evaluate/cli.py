"""``evaluate``: measure a draft under vLLM speculative decoding.

    evaluate al [--manifest M] [k=v ...]  AL per domain/category and per context bucket, both averages
    evaluate throughput [--manifest M] [k=v ...]  tokens/s, speed-up, TTFT and latency across a sweep
    evaluate compare --a A --b B [k=v ...]  two drafts (dirs) or two reports (report.json) side by side
    evaluate offline [--draft DIR] [k=v ...]  AL without vLLM: HF target + PyTorch draft, greedy
    evaluate parity [--checkpoint DIR] [k=v ...]  vLLM's proposals from the export vs the trained checkpoint's

The subcommands run :mod:`eaglenest.evaluate.commands`, imported when one runs (the feature store,
torch); ``--help`` imports neither.
"""

from __future__ import annotations

from eaglenest.cli import Command, path_text, run

COMMANDS = "eaglenest.evaluate.commands"


def main(argv: list[str] | None = None) -> int:
    # Paths are refused when empty (`--out "$DIR"` with DIR unset), not read as their default.
    out = (("--out",), dict(default=None, type=path_text,
                            help="output directory, relative to the current one (default: a folder of run.workdir)"))
    # The same meaning as on `ingest build`: the domain manifest to use instead of ingest.manifest
    # (here: its generation.reasoning decides the chat mode instead of the store's record).
    manifest = (("--manifest",), dict(default=None, type=path_text,
                                      help="domain manifest whose chat mode prompts are rendered "
                                           "in (default: as the store's prompts were)"))
    side = dict(required=True, type=path_text, help="draft directory or report.json")
    return run("evaluate", "Measure a draft under vLLM speculative decoding.", {
        "al": Command(f"{COMMANDS}:cmd_al", "AL per domain and context bucket, from vLLM's spec-decode metrics",
                      args=[out, manifest, (("--force",), dict(action="store_true",
                                                               help="measure again even if report.json matches"))]),
        "throughput": Command(f"{COMMANDS}:cmd_throughput", "throughput and latency against concurrency, "
                                                             "with and without speculation", args=[out, manifest]),
        "compare": Command(f"{COMMANDS}:cmd_compare", "two drafts or two report.json files side by side",
                           args=[(("--a",), side), (("--b",), side), out]),
        "offline": Command(f"{COMMANDS}:cmd_offline",
                           "AL without vLLM (HF target + PyTorch draft, greedy verification)",
                           args=[(("--draft",), dict(default=None, type=path_text,
                                                     help="exported draft dir or train checkpoint "
                                                          "dir (default: evaluate.draft)")), out,
                                 manifest]),
        "parity": Command(f"{COMMANDS}:cmd_parity",
                          "train/serve parity: vLLM's draft tokens per round against the trained checkpoint's",
                          args=[(("--checkpoint",), dict(default=None, type=path_text,
                                                         help="train checkpoint dir (default: "
                                                              "<workdir>/<serve.checkpoint_subdir>)")),
                                out, manifest]),
    }, argv)


if __name__ == "__main__":
    raise SystemExit(main())
