"""Evaluation prompt sets: the store's held-out split, MT-Bench and SPEED-Bench, in one shape.

Every loader returns ``{group: [{"sample_id", "messages"}]}`` where ``group`` is the manifest
domain (held-out) or the published ``category`` (MT-Bench, SPEED-Bench). MT-Bench and SPEED-Bench
are read in their published formats with ``datasets``: a local file (``.jsonl``/``.json``/
``.parquet``), a local directory (SPEED-Bench: ``<dir>/<config>/*.parquet``, MT-Bench: a
``question.jsonl`` inside) or a hub id (``load_dataset(id, config, split=...)``).

Only the first user turn of a multi-turn question (published, or a held-out conversation) is
decoded: later turns need the target's own answer to earlier ones, which would double the cost and
tie AL to that answer. Prompts whose normalised content (``eaglenest.text.content_key``, the same
key ingest deduplicates with) matches a training prompt of the store are reported and dropped, so
AL is never measured on training data.

A held-out prompt ingest stored as ``raw`` (with ``raw_fraction`` 1.0, every single-turn one: a base
model without a chat template) is decoded as the raw completion ingest would send (``"raw_text"`` in its
prompt dict: system prompt, blank line, prompt; no chat markup), the others with the target's template.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
from pathlib import Path

from eaglenest.config import short, short_text
from eaglenest.errors import ConfigError, StoreError
from eaglenest.evaluate.longctx import rendered
from eaglenest.featurestore.table import store
from eaglenest.ingest.compose import prompts_of
from eaglenest.ingest.pool import raw_document
from eaglenest.text import INVISIBLE, content_key

log = logging.getLogger(__name__)

Groups = dict[str, list[dict]]


def render(tok, messages: list[dict], chat_template_kwargs: dict | None = None) -> list[int]:
    """Token ids of a chat prompt as vLLM's ``LLM.chat`` renders it: the target's template with the
    generation prompt and ``evaluate.chat_template_kwargs`` (resolved, see ``evaluate/settings.py``); for a
    base model without a template (context buckets), the messages as a plain document (``longctx.rendered``)."""
    text, special = rendered(tok, messages, chat_template_kwargs)
    return list(tok(text, add_special_tokens=special)["input_ids"])


def prompt_tokens(tok, prompt: dict, chat_template_kwargs: dict | None = None) -> list[int]:
    """Token ids of an evaluation prompt as vLLM takes it: ``prompt_token_ids`` as given, a raw prompt's
    ``raw_text`` as ``LLM.generate`` tokenizes a text (the tokenizer's special tokens added, as ingest's raw
    requests were), else :func:`render`. A chat prompt for a target without a chat template is a ConfigError."""
    if "prompt_token_ids" in prompt:
        return list(prompt["prompt_token_ids"])
    if "raw_text" in prompt:
        return list(tok(prompt["raw_text"])["input_ids"])
    if not getattr(tok, "chat_template", None):
        raise ConfigError(f"run.target: {tok.name_or_path} has no chat template, and evaluation prompt "
                          f"{prompt.get('sample_id')} is chat "
                          "(a published prompt set, or a held-out prompt stored as chat: ingest it again with "
                          "raw_fraction 1.0 into a new run.store)")
    return render(tok, prompt["messages"], chat_template_kwargs)


def mode_of(prompt: dict) -> str:
    """How a prompt is decoded: ``raw`` (a completion of its ``raw_text``, as ingest stored it) or ``chat``
    (through the target's chat template); the report gives AL per mode as well as per group."""
    return "raw" if "raw_text" in prompt else "chat"


def _keys(messages: list[dict]) -> set[str]:
    """Content keys of a conversation's prompt: the user text alone and with the system prompt."""
    system = "".join(m["content"] for m in messages if m["role"] == "system")
    user = "\n".join(m["content"] for m in messages if m["role"] == "user")
    return {content_key(user), content_key(system + "\n" + user)}


def heldout(store_uri: str, split: str) -> Groups:
    if not store.exists(store_uri, store.PROMPTS):
        raise StoreError(f"no prompts table in {store_uri}: run `ingest build` first")
    rows = store.read(store_uri, store.PROMPTS, columns=["sample_id", "domain", "mode", "messages_json"],
                      filter=f"split = {store.sql_text(split)}").to_pylist()
    if not rows:
        raise StoreError(f"no '{split}' prompts in {store_uri}")
    groups: Groups = collections.defaultdict(list)
    for r in sorted(rows, key=lambda r: r["sample_id"]):
        msgs = first_turn(json.loads(r["messages_json"]))
        p = {"sample_id": r["sample_id"], "messages": msgs}
        if r["mode"] == "raw":  # decoded as ingest sends a raw prompt, never through the chat template
            p["raw_text"] = raw_document("".join(m["content"] for m in msgs if m["role"] == "system"),
                                         msgs[-1]["content"])
        groups[r["domain"]].append(p)
    return dict(groups)


def first_turn(messages: list[dict]) -> list[dict]:
    """A conversation up to its first user turn (the system prompt kept): what is decoded. A held-out
    multi-turn row holds every user turn unanswered (``ingest.regen.heldout_row``); decoding them all
    would send consecutive user messages, a conversation the target never sees (and that templates
    requiring alternating roles refuse)."""
    out = []
    for m in messages:
        if m["role"] == "assistant":
            continue
        out.append(m)
        if m["role"] == "user":
            break
    return out


def domains_without(store_uri: str, split: str, groups: Groups) -> dict[str, str]:
    """``{domain: why}`` for each domain of the prompts table with no ``split`` prompt (a manifest domain
    too small to hold one out): absent from the report's groups, so the report says so."""
    domains = set(store.read(store_uri, store.PROMPTS, columns=["domain"]).column("domain").to_pylist())
    return {d: f"no '{split}' prompts" for d in sorted(domains - set(groups))}


def _load_records(path: str, *, config: str | None, split: str) -> list[dict]:
    """Rows of a published dataset from a local file/directory or a hub id, via ``datasets``."""
    import datasets

    p = Path(path)
    if p.is_dir():
        files = sorted((p / config).glob("*.parquet")) if config and (p / config).is_dir() else []
        files = files or sorted(p.glob("*.parquet")) or sorted(p.glob("*.jsonl"))
        if not files:
            raise ConfigError(f"evaluate.prompt_path: no .parquet/.jsonl files in {p}"
                              + (f" or {p / config}" if config else ""))
        paths = [str(f) for f in files]
    elif p.is_file():
        if not p.stat().st_size:
            raise ConfigError(f"evaluate.prompt_path: {path} is empty")
        paths = [str(p)]
    elif p.is_absolute() or path.startswith("."):
        raise ConfigError(f"evaluate.prompt_path: {path} does not exist")
    else:
        try:
            return list(datasets.load_dataset(path, config, split=split))
        except Exception as exc:  # noqa: BLE001 - any hub failure is a user-facing problem here
            raise ConfigError(f"evaluate.prompt_path: cannot load hub dataset {path!r} "
                              f"({type(exc).__name__}: {_first_line(exc)})") from None
    kind = {".parquet": "parquet", ".jsonl": "json", ".json": "json"}.get(Path(paths[0]).suffix)
    if kind is None:
        raise ConfigError(f"evaluate.prompt_path: {path} is not a .jsonl, .json or .parquet file")
    try:
        with _quiet_datasets():
            return list(datasets.load_dataset(kind, data_files=paths, split="train"))
    except Exception as exc:  # noqa: BLE001 - a truncated or corrupt file: datasets raises many types
        # datasets wraps the parse error (the useful line) in a generic one
        raise ConfigError(f"evaluate.prompt_path: cannot read {path} as {kind} "
                          f"({_first_line(exc.__cause__ or exc)})") from None


@contextlib.contextmanager
def _quiet_datasets():
    """``datasets`` without its own log lines and progress bars while it reads a local file: a file it
    cannot parse is reported once, by the ConfigError, not also by its logger."""
    from datasets.utils import logging as ds_logging

    verbosity, bars = ds_logging.get_verbosity(), ds_logging.is_progress_bar_enabled()
    ds_logging.set_verbosity(logging.CRITICAL)
    ds_logging.disable_progress_bar()
    try:
        yield
    finally:
        ds_logging.set_verbosity(verbosity)
        if bars:
            ds_logging.enable_progress_bar()


def _first_line(exc: BaseException) -> str:
    """The first line of what ``exc`` says (its type's name when it says nothing)."""
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__


def published(path: str, *, name: str, config: str | None = None, split: str = "test") -> Groups:
    """MT-Bench / SPEED-Bench rows (``question_id``, ``category``, ``turns``) grouped by category."""
    groups = published_with_skipped(path, name=name, config=config, split=split)[0]
    if not groups:
        raise ConfigError(f"evaluate.prompt_path: no questions in {path}")
    return groups


def published_with_skipped(path: str, *, name: str, config: str | None = None,
                           split: str = "test") -> tuple[Groups, list[str]]:
    """:func:`published`'s groups and the question ids skipped for an empty first turn (as text). A first
    turn is empty when it holds no visible character (whitespace, zero-width spaces, byte-order marks:
    :data:`eaglenest.text.INVISIBLE`). No group when every question was skipped (the caller names why)."""
    rows = _load_records(path, config=config, split=split)
    groups: Groups = collections.defaultdict(list)
    seen: set[str] = set()
    empty = []
    for i, r in enumerate(rows):
        missing = {"question_id", "category", "turns"} - set(r)
        if missing:
            raise ConfigError(f"evaluate.prompt_path: row {i} of {path} lacks {sorted(missing)} "
                              f"(not the published {name} format)")
        where = f"evaluate.prompt_path: row {i} (question_id {short(r['question_id'])}) of {path}"
        if not r["turns"]:
            empty.append(r["question_id"])
            continue
        sample_id = f"{name}-{r['question_id']}"
        _check_turns(r["turns"], where)
        if not INVISIBLE.sub("", r["turns"][0]).strip():  # an empty prompt measures nothing but the template
            empty.append(r["question_id"])
            continue
        if r["category"] is None or not str(r["category"]).strip():  # not a group named "None"
            raise ConfigError(f"{where}: category must be a name, got {short(r['category'])}")
        if sample_id in seen:  # outputs, counts and the lossless check are keyed by it
            raise ConfigError(f"evaluate.prompt_path: question_id {short(r['question_id'])} occurs twice in {path} "
                              f"(row {i})")
        seen.add(sample_id)
        groups[str(r["category"])].append({"sample_id": sample_id,
                                           "messages": [{"role": "user", "content": r["turns"][0]}]})
    if empty:
        log.warning("evaluate.prompt_path: %d question(s) of %s have an empty first turn and are skipped "
                    "(question_id %s)", len(empty), path, ", ".join(short(q) for q in empty[:10]))
    if not groups and not empty:
        raise ConfigError(f"evaluate.prompt_path: no questions in {path}")
    return dict(groups), [str(q) for q in empty]


def _check_turns(turns, where: str) -> None:
    """``turns`` must be a list whose first entry is text (a bare string would be read letter by letter)."""
    if not isinstance(turns, list):
        raise ConfigError(f"{where}: turns must be a list of strings, got {type(turns).__name__} {short(turns)}")
    if not isinstance(turns[0], str):
        raise ConfigError(f"{where}: the first turn must be text, got {type(turns[0]).__name__} {short(turns[0])}")


def check_prompt_lengths(tok, prompts: list[dict], chat_template_kwargs, *, max_len: int, max_positions: int,
                         output_tokens: int = 1) -> None:
    """Refuse a chat prompt that leaves the engine (``max_len`` positions) no room for ``output_tokens``
    (vLLM refuses it mid-run, after the prompts before it were decoded)."""
    for p in prompts:
        n = len(prompt_tokens(tok, p, chat_template_kwargs))
        if n + output_tokens > max_positions:
            raise ConfigError(f"evaluate: prompt {p['sample_id']} has {n} tokens, no room for {output_tokens} output "
                              f"token(s) within the target's {max_positions} positions: leave it out of the prompt set")
        if n + output_tokens > max_len:
            raise ConfigError(f"evaluate.engine.max_model_len: prompt {p['sample_id']} has {n} tokens, no room for "
                              f"{output_tokens} output token(s) within {max_len}: raise it (the target has "
                              f"{max_positions} positions)")


def training_keys(store_uri: str, heldout_split: str = "heldout") -> set[str]:
    """Content keys of every non-held-out prompt of the store (the training pool), and of each user turn of
    a multi-turn one on its own (a long chat's first prompt after its fact preamble too: the turns ingest's
    contamination check compares; the row trains on the answer to its last). A raw prompt's document
    gives its whole text's key (system and prompt) and that of what follows its first blank line (the prompt
    after a system prompt; for a prompt of paragraphs without one, a key that can only exclude more)."""
    if not store.exists(store_uri, store.PROMPTS):
        return set()
    rows = store.read(store_uri, store.PROMPTS, columns=["source", "messages_json"],
                      filter=f"split != {store.sql_text(heldout_split)}").to_pylist()
    keys: set[str] = set()
    for r in rows:
        msgs = [m for m in json.loads(r["messages_json"]) if m["role"] != "assistant"]
        keys |= _keys(msgs)
        keys |= {content_key(t) for t in prompts_of(r["source"], [m["content"] for m in msgs if m["role"] == "user"])}
        for m in msgs:  # a raw prompt: one "document" (``ingest.pool.raw_document``: system, blank line, prompt)
            if m["role"] == "document":
                keys |= {content_key(m["content"]), content_key(m["content"].split("\n\n", 1)[-1])}
    return keys


def exclude_overlap(groups: Groups, train_keys: set[str]) -> tuple[Groups, list[str]]:
    """``groups`` without prompts found in the training pool, and the ids that were dropped."""
    kept: Groups = {}
    dropped: list[str] = []
    for g, prompts in groups.items():
        keep = []
        for p in prompts:
            (dropped.append(p["sample_id"]) if _keys(p["messages"]) & train_keys else keep.append(p))
        if keep:
            kept[g] = keep
    if dropped:
        log.warning("%d evaluation prompts overlap the training pool and are excluded", len(dropped))
    return kept, dropped


def load_prompt_set(cfg, store_uri: str) -> tuple[Groups, dict]:
    """The configured prompt set, overlap-filtered and capped; plus a small report of what happened."""
    empty: list[str] = []
    if cfg.prompt_set == "heldout":
        groups = heldout(store_uri, cfg.split)
    elif cfg.prompt_set == "mt_bench":
        groups, empty = published_with_skipped(cfg.prompt_path, name="mt_bench", split="train")
    else:
        groups, empty = published_with_skipped(cfg.prompt_path, name="speed_bench", config=cfg.speed_bench_config,
                                               split=cfg.hub_split)
    total = sum(map(len, groups.values()))
    missing = domains_without(store_uri, cfg.split, groups) if cfg.prompt_set == "heldout" else {}
    dropped: list[str] = []
    if cfg.exclude_overlap:
        loaded = set(groups)
        groups, dropped = exclude_overlap(groups, training_keys(store_uri, cfg.split))
        missing.update({g: "every prompt overlaps the training pool" for g in sorted(loaded - set(groups))})
    if missing:
        log.warning("evaluate: domains not evaluated: %s", "; ".join(f"{g} ({why})" for g, why in missing.items()))
    kept = sum(map(len, groups.values()))
    if cfg.max_prompts_per_domain > 0:
        groups = {g: ps[:cfg.max_prompts_per_domain] for g, ps in groups.items()}
    evaluated = sum(map(len, groups.values()))
    info = {"prompt_set": cfg.prompt_set, "source": cfg.prompt_path or store_uri, "loaded": total,
            "overlap_excluded": len(dropped), "overlap_ids": dropped[:50],
            "overlap_check": "normalised-content hash against the store's training prompts"
                             if cfg.exclude_overlap else "off",
            "max_prompts_per_domain": cfg.max_prompts_per_domain, "over_cap": kept - evaluated,
            "evaluated": evaluated, "decoded_raw": sum("raw_text" in p for ps in groups.values() for p in ps),
            "empty_first_turn": len(empty), "empty_first_turn_ids": empty[:50],
            "domains_not_evaluated": missing}
    if not groups:
        raise ConfigError(nothing_to_decode(cfg, empty, dropped))
    return dict(sorted(groups.items())), info


def nothing_to_decode(cfg, empty: list[str], dropped: list[str]) -> str:
    """Why a prompt set left no prompt to decode: its questions' empty first turns, the overlap with the
    training pool, or both (each with its count)."""
    ids = ", ".join(short_text(q, 40) for q in empty[:10]) + (", ..." if len(empty) > 10 else "")
    if not empty:
        return "evaluate: every prompt was excluded as overlapping the training pool"
    if not dropped:
        return (f"evaluate.prompt_path: all {len(empty)} questions of {cfg.prompt_path} have an empty first turn "
                f"(question_id {ids}): nothing to decode")
    return (f"evaluate: no prompt left to decode of {len(empty) + len(dropped)} questions in {cfg.prompt_path}: "
            f"{len(empty)} skipped for an empty first turn (question_id {ids}), {len(dropped)} excluded as "
            "overlapping the training pool (evaluate.exclude_overlap=false keeps those)")
