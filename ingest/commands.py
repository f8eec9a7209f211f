"""What ``ingest validate`` and ``ingest build`` do (the argument table is ``cli.py``'s). Imported
only when a subcommand runs: it pulls in the feature store and pyarrow."""

from __future__ import annotations

import dataclasses
import json
import sys

from eaglenest.config import to_dict
from eaglenest import memfit
from eaglenest.errors import ConfigError, EaglenestError, ManifestError
from eaglenest.featurestore.capture import identity, policy
from eaglenest.hf import check_generation_config, check_remote_code, load_config, load_tokenizer
from eaglenest.ingest import compose, contamination, dask_executor
from eaglenest.ingest.backends import chat_kwargs
from eaglenest.ingest.build import build, check_chat_template, stored_heldout, stored_id_scheme, stored_splits
from eaglenest.ingest.manifest import Dedup, input_file, load_manifest, read_manifest
from eaglenest.ingest.pool import build_pool, evaluation_prompts, load_pool, load_source
from eaglenest.paths import ensure_writable
from eaglenest.precheck import check_max_model_len
from eaglenest.provenance import write_json_atomic, write_provenance
from eaglenest.shapes import check_weight_shapes
from eaglenest.text import SAMPLE_ID_SCHEME

#: ``ingest validate`` prints at most this many problems (a hostile manifest can have millions).
MAX_PROBLEMS = 50


def cmd_validate(recipe, args) -> int:
    path = args.manifest or recipe.ingest.manifest
    m, problems = read_manifest(path)
    if m is not None:  # structurally sound: its sources' rows are read beside its semantic problems
        problems += read_inputs(m, path, known=problems)
    if problems:
        for line in problems[:MAX_PROBLEMS]:
            print(line, file=sys.stderr)
        if len(problems) > MAX_PROBLEMS:
            print(f"... and {len(problems) - MAX_PROBLEMS} more", file=sys.stderr)
        print(f"ingest: error: {path}: {len(problems)} problem(s)", file=sys.stderr)
        return 2
    print(f"{path}: ok ({len(m.domains)} domains, manifest hash {m.content_hash()})")
    return 0


def read_inputs(m, path, *, known: list[str] = ()) -> list[str]:
    """Every problem ``ingest build`` would find reading the manifest's local files, one line each:
    the rows of local sources (an empty file, a bad JSON line, a missing column), the evaluation files,
    and an empty pool (only when nothing else is wrong). Hub datasets are left to ``ingest build`` (a
    download). A file whose path is among the ``known`` problems (not found, no known format) is not
    read again: its line is there already."""
    problems, loaded = [], {}
    for name, d in m.domains.items():
        for i, src in enumerate(d.sources):
            where = f"domains.{name}.sources[{i}]"
            if src.path and not _named(known, f"{where}.path"):
                try:
                    loaded.setdefault(name, []).extend(load_source(src, where=where))
                except ManifestError as exc:
                    problems.append(str(exc))
    for kind in ("mt_bench", "speed_bench"):
        for i, file in enumerate(getattr(m.contamination, kind)):
            key = f"contamination.{kind}[{i}]"
            if _named(known, key):
                continue
            try:
                contamination.load_eval_prompts(input_file(file, None, key=key), where=key)
            except ManifestError as exc:
                problems.append(str(exc))
    # The pool as `ingest build` finds it before its token caps and contamination check (those need
    # the target's tokenizer), when every row is here (no hub source, no composing): empty is empty.
    if not (problems or known) and all(d.compose is None and all(s.path for s in d.sources)
                                       for d in m.domains.values()):
        report: dict = {}
        if not build_pool(dataclasses.replace(m, dedup=Dedup()), loaded, count_tokens=lambda _: 0, report=report):
            problems.append(empty_pool(path, report, contaminated=0))
    return problems


def _named(problems, key: str) -> bool:
    """Whether a problem line is about ``key`` or a key inside it (``key.path: ...``, ``key: ...``)."""
    return any(line.startswith((f"{key}.", f"{key}:")) for line in problems)


def empty_pool(path, pool_report: dict, contaminated: int) -> str:
    """The one line for a manifest whose prompt pool is empty (``pool_report``: build_pool's counts)."""
    n = {k: sum(c[k] for c in pool_report.get("domains", {}).values()) for k in ("rows", "empty", "kept")}
    return (f"{path}: the prompt pool is empty ({n['rows']} rows read: {n['empty']} empty, {n['kept']} kept "
            f"after dedup and caps, {contaminated} of them contaminated)")


def all_held_out(manifest, pool_report: dict) -> list[str]:
    """Warnings for domains whose held-out share takes every prompt kept (none is trained on): a
    ``held_out_count`` as large as the domain, or a ``held_out_fraction`` whose hash draw took a small
    domain whole (3 prompts at 0.2: once in 125 domains)."""
    lines = []
    for domain, counts in pool_report.get("domains", {}).items():
        kind, value = manifest.held_out(domain)
        if counts["kept"] and counts["held_out"] == counts["kept"]:
            key = f"held_out_{kind}"
            how = "" if kind == "count" else " (each prompt's hash decides)"
            lines.append(f"ingest: warning: domain {domain}: {key} {value:g} takes all {counts['kept']} of its "
                         f"prompts{how}: none of them is trained on (lower {key}, or add prompts)")
    return lines


def check_long(manifest, recipe) -> None:
    """Refuse a manifest whose longest composed conversation (``compose.py``) the regeneration
    engine cannot hold: past ``ingest.engine.max_model_len``, or past memory (``memfit``)."""
    longest = compose.longest_tokens(manifest)
    if not longest or recipe.ingest.backend != "vllm":
        return
    key = "the manifest's compose.target_tokens"
    if longest > recipe.ingest.engine.max_model_len:
        raise ConfigError(f"ingest.engine.max_model_len: {recipe.ingest.engine.max_model_len} is shorter than the "
                          f"longest composed conversation ({longest} tokens with its last answer): raise it or "
                          f"lower {key}")
    memfit.check_engine(recipe.run.target, tokens=longest, engine_dtype=recipe.ingest.engine.dtype, key=key,
                        what=f"regenerating the longest composed conversation ({longest} tokens)")


def check_target_loads(target: str, *, trust_remote_code: bool, max_model_len: int) -> None:
    """transformers' own checks of the target's config and tokenizer, before anything is written: a
    config.json that reads as JSON but that transformers refuses (``num_attention_heads: 0``) is one
    line naming run.target (``eaglenest.hf``), not a traceback once the store was made; so are weights of
    other shapes than config.json makes (``eaglenest.shapes``) and a generation_config.json transformers
    refuses."""
    load_config(target, trust_remote_code=trust_remote_code)
    load_tokenizer(target, trust_remote_code=trust_remote_code)
    check_max_model_len(target, max_model_len, where="ingest.engine")
    check_weight_shapes(target)  # an engine would cut a tensor larger than config.json says to fit, silently
    check_generation_config(target)


def cmd_build(recipe, args) -> int:
    """``ingest build``: pool, contamination check, regeneration; stats and provenance in ``<workdir>/ingest``.
    A target transformers refuses, a target other than the one whose responses the store holds and a Dask
    scheduler that is not there fail first, before the pool is built or anything is written."""
    check_remote_code(recipe.run.target, trust_remote_code=recipe.run.trust_remote_code)  # fail fast
    check_target_loads(recipe.run.target, trust_remote_code=recipe.run.trust_remote_code,
                       max_model_len=recipe.ingest.engine.max_model_len)
    # Responses stored by another target: refused before the pool is read (a hub download, every prompt
    # tokenised) or anything is created; build() checks again under the table's lease (and warns, off-policy).
    if not recipe.run.off_policy:
        try:
            policy.check_prompts(recipe.run.store_uri, recipe.run.target, off_policy=False, stage="ingest build")
        except OSError:  # a store path the system refuses (a name too long): named by ensure_writable below
            pass
    cfg = recipe.ingest
    if cfg.dask_scheduler and cfg.executor != "dask":  # README: "ingest.dask_scheduler=... runs on a cluster"
        print(f"ingest: warning: ingest.dask_scheduler is {cfg.dask_scheduler} but ingest.executor is {cfg.executor}: "
              "this build runs in this process, not on the cluster; add ingest.executor=dask to use it",
              file=sys.stderr)
    client = dask_executor.connect(cfg.dask_scheduler) if cfg.executor == "dask" and cfg.dask_scheduler else None
    try:
        return _cmd_build(recipe, args, client)
    finally:
        if client is not None:
            client.close()


def _cmd_build(recipe, args, client) -> int:
    manifest = load_manifest(args.manifest or recipe.ingest.manifest)
    chat_kwargs(manifest.generation, recipe.ingest.chat_template_kwargs)  # refuses a contradiction
    check_long(manifest, recipe)  # composed lengths (the manifest's alone): before composing them, or any engine
    pool_report: dict = {}
    evals = evaluation_prompts(manifest)  # read once: composing and the contamination check both use them
    # A table written before keeps its sample-id scheme: its prompts keep their ids and splits (no row twice).
    try:
        id_scheme = stored_id_scheme(recipe.run.store_uri)
    except OSError:  # a store path the system refuses (a name too long): named by ensure_writable below
        id_scheme = SAMPLE_ID_SCHEME
    pool = load_pool(manifest, target=recipe.run.target, report=pool_report,  # all before anything is written
                     trust_remote_code=recipe.run.trust_remote_code, id_scheme=id_scheme, evals=evals)
    for line in all_held_out(manifest, pool_report):  # before any engine starts: a mistake is stopped cheaply
        print(line, file=sys.stderr)
    out = recipe.run.path("ingest")
    # Before the store is read, any engine starts or anything is committed; not kept: run.store may
    # still be refused.
    ensure_writable(out, "run.workdir", keep=False)
    stored = stored_splits(recipe.run.store_uri)
    pool, report = contamination.check(pool, manifest, stored_split=stored,
                                       stored_heldout=stored_heldout(recipe.run.store_uri), evals=evals)
    if not pool:
        raise ManifestError(empty_pool(args.manifest or recipe.ingest.manifest, pool_report, report["contaminated"]))
    # A target without a chat template for chat prompts still to generate: refused before the store is made
    # (build() refused it only after taking the table's lease there, leaving the store folder behind).
    check_chat_template(load_tokenizer(recipe.run.target, trust_remote_code=recipe.run.trust_remote_code),
                        recipe.run.target, sum(e.mode == "chat" and e.split == "train" and e.sample_id not in stored
                                               for e in pool))
    ensure_writable(recipe.run.store_uri, "run.store" if recipe.run.store else "run.workdir")
    stats = build(manifest, pool, target=recipe.run.target, store_uri=recipe.run.store_uri, cfg=recipe.ingest,
                  client=client, off_policy=recipe.run.off_policy, trust_remote_code=recipe.run.trust_remote_code,
                  dropped_path=out / "thinking_truncated.json", id_scheme=id_scheme)
    stats["contamination"] = report
    stats["pool"] = pool_report
    write_json_atomic(out / "stats.json", stats)
    write_provenance(out, config=recipe.to_dict(), inputs={
        "manifest": args.manifest or recipe.ingest.manifest, "manifest_hash": stats["manifest_hash"],
        **identity.target_record(recipe.run.target)}, extra={"manifest": to_dict(manifest), "outputs": {
            "store": recipe.run.store_uri, "table": "prompts", "version": stats["prompts_table_version"]}})
    failures = stats["failures"]
    first = " ".join(failures[0]["error"].split())[:300] if failures else ""
    if failures and not stats["regenerated"]:  # nothing was committed for them; the next run retries
        raise EaglenestError(f"all {len(failures)} requests failed; first error: {first} "
                             f"(every failure: {out / 'stats.json'})")
    print(json.dumps({k: v for k, v in stats.items() if k != "failures"}, indent=2))
    for f in failures:
        print(f"failed: {f['sample_id']}: {f['error']}", file=sys.stderr)
    if failures:
        print(f"ingest: warning: {len(failures)} of {len(failures) + stats['regenerated']} requests failed "
              f"(not stored; the next run retries them); first error: {first}", file=sys.stderr)
    if len(stats["gen_params_ids"]) > 1:
        print(f"ingest: warning: the prompts table holds responses of {len(stats['gen_params_ids'])} generation "
              f"settings ({stats['gen_params_ids']}; this run: {stats['gen_params_id']}): rows regenerated with "
              "other sampling, template or chat_template_kwargs are mixed; use a new run.store to keep them "
              "apart", file=sys.stderr)
    if len(stats["manifests"]) > 1:
        print(f"ingest: warning: the prompts table holds the pools of {len(stats['manifests'])} manifests "
              f"({', '.join(stats['manifests'])}; this run: {stats['manifest']}): their caps, held-out splits and "
              "evaluation files are mixed; use a new run.store to keep them apart", file=sys.stderr)
    long = stats["prompt_too_long"]
    if long["dropped"]:
        print(f"ingest: warning: {long['dropped']} training prompts ({long['per_domain']}) are "
              f"{long['max_model_len']} tokens or more as the engine renders them (the longest: {long['longest']}): "
              "left out of this run; raise ingest.engine.max_model_len to keep them", file=sys.stderr)
    gone = stats["not_in_pool"]
    if gone["prompts"] and len(stats["manifests"]) <= 1:  # another manifest's prompts: warned of above
        print(f"ingest: warning: {gone['prompts']} stored prompt(s) ({gone['per_domain']}) are not in this "
              "manifest's pool (a lower cap, a source row or a domain removed since they were stored): they stay "
              "in the prompts table and are trained on; use a new run.store for this pool alone", file=sys.stderr)
    moved = stats["split_changed"]
    if moved["prompts"]:
        print(f"ingest: warning: {moved['prompts']} stored prompt(s) ({moved['per_domain']}) fall in the other "
              "split under this manifest (held_out_fraction, held_out_count or caps changed since they were "
              "stored): each keeps its stored split, and training twins of the stored held-out ones are dropped; "
              "use a new run.store for a fresh split", file=sys.stderr)
    cut = stats["thinking_truncated"]
    if cut["dropped"]:
        print(f"ingest: warning: {cut['dropped']} answers hit generation.max_tokens inside an open think block "
              f"({cut['per_domain']}): dropped, and not retried with these generation settings; raise "
              f"generation.max_tokens to keep them", file=sys.stderr)
    return 0
