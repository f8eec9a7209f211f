"""What ``serve up`` and ``serve push`` do (the argument table is ``cli.py``'s; ``export`` is
``export_command.py``). Imported only when a subcommand runs."""

from __future__ import annotations

import dataclasses
import sys
import time

from eaglenest.engine import draft_num_speculative_tokens
from eaglenest.errors import ConfigError, ManifestError
from eaglenest.ingest.manifest import load_manifest
from eaglenest.precheck import check_max_model_len
from eaglenest.serve.config import check_repo_id
from eaglenest.serve.draft_files import check_draft_dir, local_target_config
from eaglenest.serve.push import plan_push, push_draft, read_report, resolve_token
from eaglenest.serve.server import Server
from eaglenest.serve.target_check import check_served_tokenization
from eaglenest.train.config import recommended_num_speculative_tokens


def check_positions(target: str, max_model_len: int) -> None:
    """Refuse, before a server starts (a minute here), a ``serve.max_model_len`` past a local target's
    positions as vLLM derives them (a rotary factor counted where vLLM counts it: not YaRN's); vLLM
    would refuse it at start-up."""
    check_max_model_len(target, max_model_len, where="serve")


def up_server(recipe, *, no_spec: bool = False):
    """The (not yet started) server ``serve up`` runs: serve.host:serve.port, the target's name."""
    r, s = recipe.run, recipe.serve
    draft = None if no_spec else str(r.path(s.draft_subdir))
    check_positions(r.target, s.max_model_len)
    if draft:  # its features' tokenizer and template, not another's (run.off_policy: a warning)
        check_served_tokenization(draft, r.target, off_policy=r.off_policy)
    k = s.num_speculative_tokens or recommended_num_speculative_tokens(dataclasses.asdict(recipe.train))
    if draft and not s.num_speculative_tokens:  # null: the draft's recorded default (no draft: none to read)
        check_draft_dir(draft, local_target_config(r.target))  # a damaged config.json: one line, not its K
        k = draft_num_speculative_tokens(draft, k)
        if k >= s.max_model_len:  # (the recipe's own K is checked against it by ServeConfig)
            raise ConfigError(f"{draft}/config.json: the draft's default of {k} draft tokens a round and the "
                              f"target's own token must fit serve.max_model_len ({s.max_model_len}); set "
                              "serve.num_speculative_tokens")
    return Server(r.target, draft=draft, num_speculative_tokens=k,
                  memory_fraction=s.gpu_memory_utilization, max_model_len=s.max_model_len,
                  log_dir=r.path("serve"), trust_remote_code=r.trust_remote_code, host=s.host, port=s.port,
                  served_name=s.served_model_name or r.target)


def cmd_up(recipe, args) -> int:
    r = recipe.run
    if not args.for_seconds >= 0:  # NaN included: it would stop the server as soon as it is up
        raise ConfigError(f"--for-seconds: seconds >= 0 (0: until Ctrl-C), got {args.for_seconds}")
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
    if code is not None:  # the server ended by itself (or another process stopped it), before Ctrl-C or
        # --for-seconds: nothing serves any more, whatever its code (vLLM's is 0 after a SIGTERM of its own)
        print(f"serve: error: server exited with code {code} before it was asked to stop (log {server.log_path})",
              file=sys.stderr)
        return 2
    return 0


def cmd_push(recipe, args) -> int:
    r, s = recipe.run, recipe.serve
    check_repo_id(s.hub_repo_id)
    draft = r.path(s.draft_subdir)
    report = read_report(r.path("eval", "report.json"))  # where `evaluate al` writes it
    name, licences = _licences(recipe.ingest.manifest)
    plan = plan_push(draft, repo_id=s.hub_repo_id, revision=s.hub_revision, visibility=s.hub_visibility,
                     licences=licences, manifest_name=name, report=report)  # no draft: exit 2 here
    url = push_draft(plan, token=resolve_token())
    print(f"pushed {draft} ({len(plan.files)} files) to {s.hub_repo_id}@{s.hub_revision}: {url}")
    return 0


def _licences(manifest_path: str) -> tuple[str, dict[str, str]]:
    """(manifest name, {source: licence}): each source's licence, or the manifest's default."""
    try:
        m = load_manifest(manifest_path)
    except ManifestError as exc:
        raise ConfigError(f"ingest.manifest: serve push takes the data licence from it: {exc}") from None
    return m.name, {f"{d}: {src.path or src.hf_id}": src.licence or m.licence or "unspecified"
                    for d, dom in m.domains.items() for src in dom.sources}
