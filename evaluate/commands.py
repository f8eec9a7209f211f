"""What each ``evaluate`` subcommand does (the argument table is ``cli.py``'s). Imported only when a
subcommand runs: it pulls in the feature store, vLLM's prompt plumbing and, for ``offline``, torch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import sys
from pathlib import Path

from eaglenest import memfit
from eaglenest.errors import ConfigError
from eaglenest.evaluate.buckets import bucket_length
from eaglenest.evaluate.compare import compare
from eaglenest.evaluate.offline import offline_al, prompt_ids
from eaglenest.evaluate.parity import failure_line, parity_check
from eaglenest.evaluate.plots import throughput_plot
from eaglenest.evaluate.plan import max_positions
from eaglenest.evaluate.prompts import check_prompt_lengths, load_prompt_set
from eaglenest.evaluate.report import markdown as report_markdown
from eaglenest.evaluate.report import restore_report, unmark, write_report
from eaglenest.evaluate.run import evaluate_al
from eaglenest.evaluate.settings import check_draft_family, draft_dir, evaluate_config
from eaglenest.evaluate.throughput import markdown as throughput_markdown
from eaglenest.evaluate.throughput import run_sweep
from eaglenest.featurestore.capture.identity import weights_hash
from eaglenest.featurestore.table import store
from eaglenest.hf import check_remote_code, load_tokenizer
from eaglenest.paths import ensure_writable, make_dir
from eaglenest.provenance import package_versions, write_json_atomic, write_provenance, write_text_atomic
from eaglenest.serve.target_check import check_served_tokenization
from eaglenest.target import local_dir
from eaglenest.target import max_positions as vllm_positions
from eaglenest.train.checkpoint import INFO

log = logging.getLogger(__name__)


def _check_target(recipe) -> None:
    """A target that needs its own code is refused before anything else (run.trust_remote_code)."""
    check_remote_code(recipe.run.target, trust_remote_code=recipe.run.trust_remote_code)


#: What each ``evaluate`` command writes last, the mark of its finished run (``al``, ``offline``,
#: ``throughput``, ``parity``, ``compare``).
RESULTS = ("report.json", "offline_report.json", "throughput.json", "parity.json", "compare.json")


def _out(path, args, *, result: str, inputs: dict[str, str] | None = None) -> Path:
    """The command's output folder, proven writable before any engine starts (``--out`` or
    ``run.workdir`` named if not); the check leaves nothing behind: not every input is checked yet.
    ``inputs`` ({key: folder}: the draft, the target, a checkpoint) are refused as the output folder:
    the command's provenance.json would replace theirs (an export's, which ``serve push`` publishes).
    So is a folder holding another ``evaluate`` command's result (``RESULTS`` other than ``result``):
    its provenance.json would then describe this command's run, not the result beside it."""
    key = "--out" if args.out else "run.workdir"
    for name, folder in (inputs or {}).items():
        if folder and Path(folder).is_dir() and Path(path).resolve() == Path(folder).resolve():
            raise ConfigError(f"{key}: {path} is the {name} folder: this command's provenance.json and report "
                              "would replace its own; write the output elsewhere")
    other = next((name for name in RESULTS if name != result and (Path(path) / name).is_file()), None)
    if other is not None:
        raise ConfigError(f"{key}: {path} holds {other}, another evaluate command's result: this command's "
                          f"provenance.json would replace that run's; write the output elsewhere")
    ensure_writable(path, key, keep=False)
    return Path(path)


def _inputs_of(recipe, draft: str, **more: str) -> dict[str, str]:
    """The folders :func:`_out` must not write into: the draft, the target, the train checkpoint (its
    provenance.json and its own report.json) and ``more``."""
    return {"draft": draft, "target": recipe.run.target,
            "checkpoint": str(recipe.run.path(recipe.serve.checkpoint_subdir)), **more}


def cmd_al(recipe, args) -> int:
    _check_target(recipe)
    check_draft_family(recipe, draft_dir(recipe))
    cfg, draft = evaluate_config(recipe, manifest=args.manifest), draft_dir(recipe)
    out = str(_out(args.out or recipe.run.path("eval"), args, result="report.json", inputs=_inputs_of(recipe, draft)))
    key = _cache_key(recipe, draft, cfg)
    cached = None if args.force else _cached_report(out, key)
    if cached is not None:
        report, restored = cached
        print(f"evaluate: {out}/report.json already measures this draft with these settings "
              "(--force to measure again)", file=sys.stderr)
        for path in restored:
            print(f"evaluate: {path} was missing: written again from report.json", file=sys.stderr)
        print(report_markdown(report))
        return 0
    check_fit(recipe.run.target, cfg)  # the longest context bucket, before the engine starts
    report = evaluate_al(target=recipe.run.target, draft=draft, store_uri=recipe.run.store_uri, cfg=cfg,
                         features_table=recipe.featurestore.table, trust_remote_code=recipe.run.trust_remote_code)
    report["cache_key"] = key
    # Provenance first: report.json, written last, marks the folder as done for a re-run (an earlier
    # run's is removed first, so a kill from here on leaves the folder unmarked).
    unmark(out)
    write_provenance(out, config=recipe.to_dict(), argv=sys.argv, inputs=_inputs(recipe, draft))
    write_report(out, report)
    print(report_markdown(report))
    return 0


def check_fit(target: str, cfg) -> None:
    """Refuse (``memfit``) context buckets whose longest prompt, with its output, cannot fit memory
    in the serving engine (buckets past the target's positions are shortened first, as
    ``evaluate.buckets`` does; a hub target, without a local config, is not estimated)."""
    tcfg = memfit.load_target_config(target)
    if tcfg is None or not cfg.context_buckets:
        return
    derived = vllm_positions(tcfg)  # a linear or dynamic rotary factor counted, as vLLM does
    max_pos = derived[0] if derived else int(tcfg.get("max_position_embeddings") or 4096)
    tokens = max(bucket_length(b, max_positions=max_pos, max_tokens=cfg.bucket_max_tokens)
                 for b in cfg.context_buckets) + cfg.bucket_max_tokens
    memfit.check_engine(target, tokens=tokens, engine_dtype=cfg.engine.dtype, key="evaluate.context_buckets",
                        what=f"serving the longest context bucket ({tokens} tokens with its output)")


def _cache_key(recipe, draft: str, cfg=None) -> str:
    """Identity of a measurement: draft and target weights, the evaluate settings (``cfg``: resolved,
    so the chat-template kwargs count), the prompts version, and the software that measures (vLLM,
    torch, eaglenest... versions: an upgrade measures again)."""
    h = hashlib.sha256()
    # Weights through the feature store's hash (sampled for very large targets), configs, tokenizer
    # and chat template files in full.
    for d in (Path(draft), Path(recipe.run.target)):
        h.update(weights_hash(str(d)).encode())
        files_dir = local_dir(d)
        if files_dir != d:  # a hub id: its cached snapshot, named by the commit it resolved to
            h.update(f"revision:{files_dir.name}".encode())
        for f in _identity_files(files_dir):
            h.update(str(f.relative_to(files_dir)).encode() + f.read_bytes())
    kwargs = getattr(cfg, "chat_template_kwargs", None)  # only when set: earlier keys stay valid
    heldout = recipe.evaluate.prompt_set == "heldout"
    prompt_files = None if heldout else _prompt_files_hash(recipe.evaluate.prompt_path)
    h.update(json.dumps({"evaluate": recipe.to_dict()["evaluate"], **_inputs(recipe, draft),
                         "software": package_versions(),
                         **({"chat_template_kwargs": kwargs} if kwargs else {}),
                         **({"prompt_files": prompt_files} if prompt_files else {})},
                        sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]


#: Files of a model folder that change what is measured without being JSON: the tokenizer's own
#: formats (every sentencepiece model: tokenizer.model, spiece.model, sentencepiece.bpe.model, spm.model,
#: mistral_common's tokenizer.model.v3) and a chat template kept beside tokenizer_config.json
#: (``chat_template.jinja``).
_TOKENIZER_FILES = ("*.model", "*.model.v*", "vocab.txt", "merges.txt", "*.tiktoken", "*.jinja")


def _identity_files(folder: Path) -> list[Path]:
    """A model folder's configs (not its provenance.json), tokenizer files and chat templates; a file
    absent adds nothing, so a folder with JSON files only keeps the key it had."""
    patterns = ("*.json", *_TOKENIZER_FILES, "additional_chat_templates/*.jinja")
    files = {f for pattern in patterns for f in folder.glob(pattern) if f.is_file()}
    return sorted(f for f in files if f.name != "provenance.json")


#: What the prompt-set loader reads from a local prompt folder (``evaluate.prompts``).
_PROMPT_FILES = (".parquet", ".jsonl", ".json")


def _prompt_files_hash(prompt_path: str) -> str | None:
    """sha256 over a local prompt file, or the prompt files under a local prompt folder (None for a hub
    id): the path alone would keep a report measured on an earlier version of the file."""
    root = Path(prompt_path)
    files = (sorted(f for f in root.rglob("*") if f.suffix in _PROMPT_FILES and f.is_file()) if root.is_dir()
             else [root] if root.is_file() else [])
    if not files:
        return None
    h = hashlib.sha256()
    for f in files:
        h.update(str(f.relative_to(root) if root.is_dir() else f.name).encode() + f.read_bytes())
    return h.hexdigest()


def _cached_report(out: str, key: str) -> tuple[dict, list[Path]] | None:
    """``out``'s report.json when it measured ``key``, and the files of its run written again from it because
    they were missing (report.md, a plot: ``report.restore_report``); None (measure again) when it is
    missing, of another key, or cannot be shown: a report.json edited by hand, or of an older layout, under
    the same key."""
    path = Path(out) / "report.json"
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(report, dict) or report.get("cache_key") != key:
        return None
    try:
        report_markdown(report)
        restored = restore_report(out, report)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:  # a key missing or mistyped
        log.warning("evaluate: %s matches these settings but cannot be shown (%s %s): measuring again", path,
                    type(exc).__name__, str(exc)[:80])
        return None
    return report, restored


def _inputs(recipe, draft: str) -> dict:
    uri = recipe.run.store_uri
    version = store.latest_version(uri, store.PROMPTS) if store.exists(uri, store.PROMPTS) else None
    table = recipe.featurestore.table  # the n-gram reference is fitted on it
    features = store.latest_version(uri, table) if store.exists(uri, table) else None
    return {"target": recipe.run.target, "draft": draft, "store": uri, "prompts_version": version,
            "features_table": table, "features_version": features, "prompt_path": recipe.evaluate.prompt_path or None}


def _clear_result(out: Path, result: str, key: str) -> None:
    """Make ``out`` and remove an earlier run's ``result`` file, which the command writes again last: a
    run stopped while writing its other files (plots, provenance.json) leaves no result beside them
    that another run measured (as ``evaluate al`` does with report.json)."""
    make_dir(out, key)
    (out / result).unlink(missing_ok=True)


def cmd_throughput(recipe, args) -> int:
    _check_target(recipe)
    draft = draft_dir(recipe)
    check_draft_family(recipe, draft)
    out = _out(args.out or recipe.run.path("throughput"), args, result="throughput.json",
               inputs=_inputs_of(recipe, draft))
    result = run_sweep(target=recipe.run.target, draft=draft, store_uri=recipe.run.store_uri,
                       cfg=evaluate_config(recipe, manifest=args.manifest), serve_cfg=recipe.serve,
                       log_dir=recipe.run.path("serve"),
                       trust_remote_code=recipe.run.trust_remote_code)
    _clear_result(out, "throughput.json", "--out" if args.out else "run.workdir")
    write_text_atomic(out / "throughput.md", throughput_markdown(result))
    throughput_plot(result, out)
    write_provenance(out, config=recipe.to_dict(), argv=sys.argv, inputs=_inputs(recipe, draft))
    write_json_atomic(out / "throughput.json", result)
    print(throughput_markdown(result))
    return 0


def cmd_compare(recipe, args) -> int:
    _check_target(recipe)
    # Not into the recipe's draft or target, nor a compared draft's or report's folder with a provenance.json
    # (an export's, an `evaluate al` run's): this command's would replace it.
    specs = {"a": Path(args.a), "b": Path(args.b)}
    folders = {name: spec if spec.is_dir() else spec.parent for name, spec in specs.items()}
    sides = {f"--{name} draft or report": str(folder) for name, folder in folders.items()
             if (folder / "provenance.json").is_file()}
    out = _out(args.out or recipe.run.path("compare"), args, result="compare.json",  # before any draft is evaluated
               inputs=_inputs_of(recipe, draft_dir(recipe), **sides))
    print(compare(args.a, args.b, recipe=recipe, outdir=out, key="--out" if args.out else "run.workdir"))
    return 0


def cmd_offline(recipe, args) -> int:
    _check_target(recipe)
    draft = args.draft or draft_dir(recipe)
    check_draft_family(recipe, draft)
    cfg = evaluate_config(recipe, manifest=args.manifest, draft=draft)  # the K the given draft records
    out = _out(args.out or recipe.run.path("eval_offline"), args, result="offline_report.json",
               inputs=_inputs_of(recipe, draft))
    check_served_tokenization(draft, recipe.run.target, off_policy=False, stage="measuring")  # as `evaluate al`
    if cfg.temperature != 0.0:
        raise ConfigError(f"evaluate.temperature: offline AL is greedy only (0.0), got {cfg.temperature}")
    groups, info = load_prompt_set(cfg, recipe.run.store_uri)
    _check_offline_lengths(recipe, cfg, groups)
    report = offline_al(target=recipe.run.target, draft=draft, groups=groups,
                        num_speculative_tokens=cfg.num_speculative_tokens, max_tokens=cfg.max_tokens,
                        trust_remote_code=recipe.run.trust_remote_code, chat_template_kwargs=cfg.chat_template_kwargs,
                        draft_key="--draft" if args.draft else "evaluate.draft",
                        target_keys=dataclasses.asdict(recipe.run.target_keys))
    # what `evaluate compare` checks two reports were measured alike with, as `evaluate al` records it
    report.update(prompts=info, split=cfg.split, chat_template_kwargs=cfg.chat_template_kwargs or {})
    _clear_result(out, "offline_report.json", "--out" if args.out else "run.workdir")
    write_provenance(out, config=recipe.to_dict(), argv=sys.argv, inputs=_inputs(recipe, draft))
    write_json_atomic(out / "offline_report.json", report)
    print("| group | prompts | AL (pooled) | AL per-request |\n|---|---|---|---|")
    modes = report.get("modes") or {}  # held-out prompts stored both chat and raw
    for name, row in [*report["domains"].items(), *((f"mode {m}", r) for m, r in modes.items() if len(modes) > 1),
                      ("overall", report["overall"])]:
        print(f"| {name} | {row['prompts']} | {row['acceptance_length']} | {row['acceptance_length_per_request']} |")
    return 0


def _check_offline_lengths(recipe, cfg, groups) -> None:
    """Refuse, before the draft and the target load, a prompt with no room for an output token within
    the target's positions: ``evaluate al``'s engine refuses it, the HF replay would decode past them."""
    positions = max_positions(recipe.run.target, trust_remote_code=recipe.run.trust_remote_code)
    tok = load_tokenizer(recipe.run.target, trust_remote_code=recipe.run.trust_remote_code)
    check_prompt_lengths(tok, [p for ps in groups.values() for p in ps], cfg.chat_template_kwargs,
                         max_len=positions, max_positions=positions)


def cmd_parity(recipe, args) -> int:
    """``evaluate parity``: writes ``parity.json`` (+ provenance) and exits 1 with one line when the
    served draft's proposals part from the trained checkpoint's below the threshold."""
    _check_target(recipe)
    check_draft_family(recipe, draft_dir(recipe))
    cfg, draft = evaluate_config(recipe, manifest=args.manifest), draft_dir(recipe)
    checkpoint = args.checkpoint or str(recipe.run.path(recipe.serve.checkpoint_subdir))
    if not (Path(draft) / "config.json").is_file():
        raise ConfigError(f"evaluate.draft: {draft} is not an exported draft (no config.json; run `serve export`)")
    if not Path(checkpoint).is_dir():
        raise ConfigError(f"--checkpoint: {checkpoint} is not a train checkpoint dir (run `train run`, or name one)")
    if not (Path(checkpoint) / INFO).is_file():  # an export would be checked against itself and always pass
        raise ConfigError(f"--checkpoint: {checkpoint} is not a train checkpoint (no {INFO}; an exported draft "
                          "checked against itself proves nothing): name the `train run` folder it was exported from")
    out = _out(args.out or recipe.run.path("parity"), args, result="parity.json",
               inputs=_inputs_of(recipe, draft, checkpoint=checkpoint))
    # The served draft on another tokenizer or template than its features': a warning, as `evaluate al` gives.
    check_served_tokenization(draft, recipe.run.target, off_policy=False, stage="measuring")
    if cfg.temperature != 0.0:
        raise ConfigError(f"evaluate.temperature: the parity check is greedy only (0.0), got {cfg.temperature}")
    groups, info = load_prompt_set(cfg, recipe.run.store_uri)
    tok = load_tokenizer(recipe.run.target, trust_remote_code=recipe.run.trust_remote_code)
    chosen = [(p.get("sample_id", f"{name}-{i}"), p) for name, ps in groups.items() for i, p in enumerate(ps)]
    # vLLM refuses a prompt with no room for output only once its engine runs: refused here, naming the key
    check_prompt_lengths(tok, [p for _, p in chosen[: cfg.parity_prompts]], cfg.chat_template_kwargs,
                         max_len=cfg.engine.max_model_len,
                         max_positions=max_positions(recipe.run.target, trust_remote_code=recipe.run.trust_remote_code))
    prompts = {sid: prompt_ids(tok, p, cfg.chat_template_kwargs) for sid, p in chosen[: cfg.parity_prompts]}
    report = parity_check(target=recipe.run.target, draft=draft, checkpoint=checkpoint, prompts=prompts,
                          k=cfg.num_speculative_tokens, max_tokens=cfg.parity_max_tokens, engine=cfg.engine,
                          min_identical=cfg.parity_min_identical, trust_remote_code=recipe.run.trust_remote_code,
                          checkpoint_key="--checkpoint" if args.checkpoint else "serve.checkpoint_subdir")
    report["prompts"] = info
    _clear_result(out, "parity.json", "--out" if args.out else "run.workdir")
    write_provenance(out, config=recipe.to_dict(), argv=sys.argv,
                     inputs={**_inputs(recipe, draft), "checkpoint": checkpoint})
    write_json_atomic(out / "parity.json", report)
    by_pos = ", ".join("-" if x is None else f"{x:.3f}" for x in report["identical_by_position"])
    print(f"parity: {report['rounds']} rounds over {report['requests']} requests; identical by position {by_pos}")
    if not report["passed"]:
        print(f"evaluate: parity failed: {failure_line(report)}", file=sys.stderr)
        return 1
    return 0
