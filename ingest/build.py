"""``ingest build``: manifest -> prompt pool -> on-policy responses in the store's ``prompts`` table.

Resumable and exactly-once by construction: sample ids are content hashes; the training prompts
still missing from the table are cut into shards of ``commit_every``; each shard's rows are written
as Lance fragments (by whichever process ran it) and committed by this driver in one Append commit
as the shard finishes. Shards are a unit of commit, not of generation: in-process, every prompt
streams through one engine with a bounded number in flight (``ingest.max_in_flight``), and a shard
is written and committed the moment its last prompt is answered, while the engine (its own
process) goes on with the next prompts; no batch barrier, no idle engine during commits. A re-run
skips ids already in the table. So a killed run loses at most the shards in flight (their fragments
are uncommitted garbage, never visible), and a shard whose Dask worker died is simply run again
elsewhere, its lost fragments never committed: no row can appear twice. Failed prompts (backend
errors after retries) are not written, reported per prompt in the stats, and retried by the next
run. Chat answers cut off inside an open think block (``reasoning.py``) are not written either; they
are counted per domain and recorded in ``dropped_path`` under their ``gen_params_id``, so a re-run
with the same generation settings skips them instead of regenerating them to the same cut-off (new
settings, e.g. a larger ``max_tokens``, give a new id and try them again). No engine is started
when nothing is left to do. One shard's work is ``shard.py``'s, shared by both executors (in-process
here, ``dask_executor.py``).
"""

from __future__ import annotations

import collections
import json
import logging
import time
from pathlib import Path

from jinja2 import TemplateError
from tqdm import tqdm

from eaglenest import faults
from eaglenest.errors import ConfigError, StoreError
from eaglenest.featurestore import schema
from eaglenest.featurestore.capture import policy
from eaglenest.featurestore.table import lease, store
from eaglenest.featurestore.table.fragments import commit_fragments, lineage_of, removed_lineage
from eaglenest.hf import load_tokenizer
from eaglenest.ingest import dask_executor
from eaglenest.ingest.backends import chat_kwargs
from eaglenest.ingest.config import IngestConfig
from eaglenest.ingest.manifest import Manifest
from eaglenest.ingest.pool import PoolEntry, raw_text
from eaglenest.ingest.reasoning import ThinkCheck, resolve_tags
from eaglenest.ingest.regen import Dropped, gen_params_id, heldout_row, stream
from eaglenest.ingest.shard import guarded, make_backend, shard_result, write_rows
from eaglenest.provenance import code_version, write_json_atomic
from eaglenest.text import SAMPLE_ID_SCHEME, SAMPLE_ID_SCHEMES

log = logging.getLogger(__name__)


def chat_template(target: str, *, trust_remote_code: bool = False) -> str | dict:
    return load_tokenizer(target, trust_remote_code=trust_remote_code).chat_template or ""


def commit(store_uri: str, fragments: list, lineage: dict) -> int:
    return commit_fragments(store_uri, store.PROMPTS, fragments, lineage=lineage)


def build(manifest: Manifest, pool: list[PoolEntry], *, target: str, store_uri: str, cfg: IngestConfig,
          backend=None, client=None, off_policy: bool = False, trust_remote_code: bool = False,
          dropped_path: str | Path | None = None, id_scheme: int = SAMPLE_ID_SCHEME) -> dict:
    """Regenerate what is missing from the prompts table; return the run's stats.

    ``backend`` (in-process executor) or ``client`` (a ``distributed.Client``, Dask executor) reuse a
    running engine or cluster instead of starting one; the caller keeps and closes it. The run holds
    the prompts table's writer lease throughout (``featurestore/table/lease.py``): what is missing is
    decided once at the start and stays true, so two ingests at once cannot both regenerate and
    append the same prompts; the second is refused, naming the first. Each commit records the
    generating target (``featurestore/capture/policy.py``); responses from a different target than those
    already stored are refused unless ``off_policy``. ``dropped_path``: the JSON file of
    conversations dropped for truncated thinking (read to skip them, then updated). ``id_scheme``: the
    sample-id scheme the pool was built with (``pool.build_pool``), recorded in every commit's lineage;
    a table whose rows were written under another is refused (its prompts would be stored twice).
    """
    own = None
    if cfg.executor == "dask" and client is None and cfg.dask_scheduler:
        client = own = dask_executor.connect(cfg.dask_scheduler)  # a dead address fails before any write
    try:
        with lease.hold(store_uri, store.PROMPTS, purpose="ingest build", wait_s=5):
            return _build(manifest, pool, target=target, store_uri=store_uri, cfg=cfg, backend=backend,
                          client=client, off_policy=off_policy, trust_remote_code=trust_remote_code,
                          dropped_path=dropped_path, id_scheme=id_scheme)
    finally:
        if own is not None:
            own.close()


def _build(manifest: Manifest, pool: list[PoolEntry], *, target: str, store_uri: str, cfg: IngestConfig,
           backend=None, client=None, off_policy: bool = False, trust_remote_code: bool = False,
           dropped_path=None, id_scheme: int = SAMPLE_ID_SCHEME) -> dict:
    t0 = time.time()
    have = stored_id_scheme(store_uri)
    if have != id_scheme:
        raise ConfigError(f"run.store: the prompts table in {store_uri} holds sample ids of scheme {have}, and this "
                          f"pool's are of scheme {id_scheme}: its prompts would be stored twice; build the pool "
                          "with the table's scheme (ingest build does), or ingest into a new run.store")
    rendered = chat_kwargs(manifest.generation, cfg.chat_template_kwargs) or {}  # a contradiction: refused here
    if backend is not None and getattr(backend, "chat_template_kwargs", {}) != dict(cfg.chat_template_kwargs):
        raise ConfigError("ingest.chat_template_kwargs: the backend given renders with other kwargs "
                          "(build it with make_backend, or with the same chat_template_kwargs)")
    tok = load_tokenizer(target, trust_remote_code=trust_remote_code)
    gen_id = gen_params_id(manifest.generation, tok.chat_template or "", cfg.chat_template_kwargs)
    think = ThinkCheck(*resolve_tags(cfg.think_tags, tok), target=target, trust_remote_code=trust_remote_code)
    earlier = _read_dropped(dropped_path)
    skipped = earlier.get(gen_id, {})
    stored_split = stored_splits(store_uri)
    done = set(stored_split)
    resplit = collections.Counter(e.domain for e in pool if stored_split.get(e.sample_id, e.split) != e.split)
    chosen = {e.sample_id for e in pool}
    # stored prompts this manifest no longer chooses (a lower cap, a source row or domain removed): kept
    unchosen = collections.Counter(sid.rsplit("-", 1)[0] for sid in stored_split if sid not in chosen)
    todo = [e for e in pool if e.sample_id not in done and e.sample_id not in skipped]
    _check_moved(todo, done)
    heldout = [e for e in todo if e.split == "heldout"]
    check_chat_template(tok, target, sum(e.mode == "chat" and e.split == "train" for e in todo))  # before rendering
    train, too_long = _fits(cfg, tok, [e for e in todo if e.split == "train"], manifest.generation)
    if train:  # responses are about to be added: they must come from the same target as those stored
        policy.check_prompts(store_uri, target, off_policy=off_policy, stage="ingest build")
    # How the prompts were rendered, readable (gen_params_id is only a hash of it): evaluation renders
    # its prompts the same way unless told otherwise (evaluate/settings.py).
    lineage = {"stage": "ingest", "manifest": manifest.name, "manifest_hash": manifest.content_hash(),
               "gen_params_id": gen_id, "reasoning": manifest.generation.reasoning,
               "chat_template_kwargs": rendered, "sample_id_scheme": id_scheme, "code_version": code_version(),
               **policy.lineage_record(target)}
    if heldout:
        guarded(lambda: commit(store_uri, write_rows(store_uri, [heldout_row(e, gen_id) for e in heldout]),
                               {**lineage, "shard": "heldout"}), store_uri)
    shards = [train[i:i + cfg.commit_every] for i in range(0, len(train), cfg.commit_every)]
    totals = {"rows": 0, "tokens": 0, "failures": [], "retries": 0, "dropped": []}
    if shards:
        runner = _run_dask if cfg.executor == "dask" else _run_inprocess
        # disable=None: no bar when stderr is not a terminal (logs keep one line per event)
        with tqdm(total=len(train), desc="ingest: regenerate", unit="prompt", disable=None) as bar:
            def on_result(k: int, res: dict) -> None:
                if res["fragments"]:
                    faults.delay("ingest.before_commit")  # tests: hold the fragments-written window
                    guarded(lambda: commit(store_uri, res["fragments"], {**lineage, "shard": k}), store_uri)
                totals["rows"] += res["rows"]
                totals["tokens"] += res["tokens"]
                totals["failures"] += res["failures"]
                totals["dropped"] += res.get("dropped", [])
                if res.get("dropped") and dropped_path is not None:  # kept at once: a killed run loses none
                    _record_dropped(dropped_path, earlier, gen_id, res["dropped"])
                totals["retries"] += res.get("retries", 0)
                bar.update(len(shards[k]))
                bar.set_postfix(tok_s=f"{totals['tokens'] / max(time.time() - t0, 1e-9):.0f}",
                                failed=len(totals["failures"]))

            extra = {"client": client} if cfg.executor == "dask" else {"backend": backend}
            runner(shards, cfg=cfg, target=target, store_uri=store_uri, gen=manifest.generation,
                   gen_id=gen_id, on_result=on_result, think=think, trust_remote_code=trust_remote_code, **extra)
    columns = ["domain", "split", "finish_reason", "gen_params_id"]
    stored = store.exists(store_uri, store.PROMPTS)  # not when nothing was held out and every request failed
    table = (store.read(store_uri, store.PROMPTS, columns=columns) if stored
             else schema.PROMPTS_SCHEMA.empty_table().select(columns))
    counts = collections.Counter(zip(table.column("domain").to_pylist(), table.column("split").to_pylist()))
    truncated = sum(1 for f in table.column("finish_reason").to_pylist() if f == "length")
    # Responses of every generation setting in the table: more than one means rows generated with
    # other settings (sampling, template, chat_template_kwargs) sit beside these; the CLI warns.
    answered = [g for g, f in zip(table.column("gen_params_id").to_pylist(), table.column("finish_reason").to_pylist())
                if f]
    return {
        "manifest": manifest.name, "manifest_hash": manifest.content_hash(), "gen_params_id": gen_id,
        "chat_template_kwargs": rendered, "sample_id_scheme": id_scheme,
        "backend": cfg.backend, "executor": cfg.executor, "shards": len(shards),
        "pool_size": len(pool), "skipped_existing": len(pool) - len(todo),
        "regenerated": totals["rows"], "heldout_written": len(heldout), "generated_tokens": totals["tokens"],
        "failed": len(totals["failures"]), "failures": totals["failures"], "retries": totals["retries"],
        "truncated_responses": truncated,
        "gen_params_ids": dict(sorted(collections.Counter(answered).items())),
        "manifests": stored_manifests(store_uri) if stored else [],
        "thinking_truncated": {
            "tags": [think.open_tag, think.close_tag], "dropped": len(totals["dropped"]),
            "per_domain": dict(sorted(collections.Counter(d["domain"] for d in totals["dropped"]).items())),
            "skipped_from_earlier_runs": sum(e.sample_id in skipped for e in pool if e.sample_id not in done),
        },
        "prompt_too_long": {
            "max_model_len": cfg.engine.max_model_len if cfg.backend == "vllm" else None,
            "dropped": len(too_long),
            "per_domain": dict(sorted(collections.Counter(e.domain for e, _ in too_long).items())),
            "longest": max((n for _, n in too_long), default=0),
        },
        # stored prompts this manifest puts in the other split (held-out policy or caps changed): kept as stored
        "split_changed": {"prompts": sum(resplit.values()), "per_domain": dict(sorted(resplit.items()))},
        "not_in_pool": {"prompts": sum(unchosen.values()), "per_domain": dict(sorted(unchosen.items()))},
        "weights": {d: c.weight for d, c in manifest.domains.items()},
        "counts": {f"{d}/{s}": n for (d, s), n in sorted(counts.items())},
        "prompts_table_version": store.latest_version(store_uri, store.PROMPTS) if stored else None,
        "seconds": round(time.time() - t0, 2),
    }


def stored_manifests(store_uri: str) -> list[str]:
    """The names of the manifests whose ``ingest build`` committed to the prompts table, in commit
    order: more than one means their pools (caps, held-out splits, evaluation files) are mixed. Those of
    versions ``gc`` removed count too: their rows stay."""
    names: list[str] = []
    for lin in _lineages(store_uri):
        name = lin.get("manifest")
        if isinstance(name, str) and name not in names:
            names.append(name)
    return names


def _lineages(store_uri: str) -> list[dict]:
    """The lineage of every version of the prompts table, in version order, those ``gc`` removed included."""
    ds = store.dataset(store_uri, store.PROMPTS)
    lineages = removed_lineage(store_uri, store.PROMPTS)
    lineages.update({int(v["version"]): lineage_of(ds, int(v["version"])) or {}
                     for v in store.version_list(ds, store_uri, store.PROMPTS)})
    return [lin for _, lin in sorted(lineages.items())]


def stored_id_scheme(store_uri: str) -> int:
    """The sample-id scheme (``text.conversation_key``) of the prompts table's rows: the one its first
    commit recording one names (gc's kept lineage included), 1 for rows no commit records one for (written
    before the record), and this eaglenest's own for a table with no row (or none at all). A re-run keys its
    pool with it, so a stored prompt keeps its id and split. A store path the system refuses raises OSError."""
    if not store.exists(store_uri, store.PROMPTS) or not store.dataset(store_uri, store.PROMPTS).count_rows():
        return SAMPLE_ID_SCHEME
    found = next((lin["sample_id_scheme"] for lin in _lineages(store_uri) if "sample_id_scheme" in lin), 1)
    if found not in SAMPLE_ID_SCHEMES or isinstance(found, bool):
        raise StoreError(f"run.store: the prompts table in {store_uri} records sample-id scheme {found!r}, which "
                         f"this eaglenest does not know ({', '.join(map(str, SAMPLE_ID_SCHEMES))}): a newer "
                         "eaglenest wrote it")
    return found


def stored_splits(store_uri: str) -> dict[str, str]:
    """``{sample_id: split}`` of the prompts already stored (what a re-run skips)."""
    try:
        if not store.exists(store_uri, store.PROMPTS):
            return {}
        table = store.read(store_uri, store.PROMPTS, columns=["sample_id", "split"])
    except OSError as exc:
        raise StoreError(f"run.store: cannot read the prompts table in {store_uri} ({exc.strerror or exc})") from None
    return dict(zip(table.column("sample_id").to_pylist(), table.column("split").to_pylist()))


def stored_heldout(store_uri: str) -> dict[str, list[str]]:
    """``{sample_id: user turns}`` of the prompts stored as held out. They stay held out whatever a
    later manifest says (stored ids are skipped), so evaluation decodes them: the contamination check
    keeps their twins out of training even when the pool no longer holds them out (a changed held-out
    policy or cap, a source row removed)."""
    try:
        if not store.exists(store_uri, store.PROMPTS):
            return {}
        table = store.read(store_uri, store.PROMPTS, columns=["sample_id", "messages_json"],
                           filter="split = 'heldout'")
    except OSError as exc:
        raise StoreError(f"run.store: cannot read the prompts table in {store_uri} ({exc.strerror or exc})") from None
    ids, texts = table.column("sample_id").to_pylist(), table.column("messages_json").to_pylist()
    return {sid: [m.get("content") for m in json.loads(text) if m.get("role") == "user"]
            for sid, text in zip(ids, texts)}


def _check_moved(todo: list[PoolEntry], done: set[str]) -> None:
    """Refuse prompts stored already under another domain: a sample id is ``<domain>-<content hash>``,
    so a renamed domain (or a source moved to another) would store the same conversations again
    under new ids."""
    stored = {sid.rsplit("-", 1)[1]: sid.rsplit("-", 1)[0] for sid in done if "-" in sid}
    moved = [(stored[e.sample_id.rsplit("-", 1)[1]], e.domain) for e in todo
             if stored.get(e.sample_id.rsplit("-", 1)[1], e.domain) != e.domain]
    if moved:
        (was, now), _ = collections.Counter(moved).most_common(1)[0]
        n = len(moved)
        raise ConfigError(f"manifest: {n} prompt(s) of domain '{now}' are stored already under domain '{was}' "
                          "(a renamed domain, a source moved between domains, or domains that share prompts "
                          "removed or reordered: the first one listed owns a shared prompt): they would be stored "
                          f"twice, under new ids; keep domain '{was}' where it was, or ingest into a new store "
                          "(run.store)")


def check_chat_template(tok, target: str, num_chat: int) -> None:
    """Refuse, before any engine starts or row is written, chat prompts for a target without a chat
    template: vLLM would refuse each of them, on every run (``ingest build`` checks its pool before the
    store is made, too)."""
    if num_chat and not tok.chat_template:
        raise ConfigError(f"run.target: {target} has no chat template, and {num_chat} training prompts are chat; "
                          "give its tokenizer one (chat_template in tokenizer_config.json or chat_template.jinja)")


def _fits(cfg: IngestConfig, tok, entries: list[PoolEntry], gen) -> tuple[list[PoolEntry], list[tuple]]:
    """``(kept, too_long)``: the training prompts whose requests the in-process engine can take, and
    ``(entry, tokens)`` for those it would refuse on every run (a prompt, or a multi-turn chat's user
    turns with its answers still to come, of ``max_model_len`` tokens or more, rendered as vLLM renders
    it). Left out of this run with a warning, never recorded: a larger ``ingest.engine.max_model_len``
    tries them again. Endpoints' limits are their own."""
    if cfg.backend != "vllm":
        return entries, []
    limit = cfg.engine.max_model_len
    kept, too_long = [], []
    for e in entries:
        n = prompt_tokens(tok, e, gen, cfg.chat_template_kwargs, limit=limit)
        (too_long.append((e, n)) if n >= limit else kept.append(e))
    return kept, too_long


def prompt_tokens(tok, e: PoolEntry, gen, template_kwargs, *, limit: int) -> int:
    """The fewest tokens of ``e``'s longest request as the engine tokenizes it: its only one for a
    single turn; for a multi-turn conversation the last, its every user turn rendered with the answers
    to come left empty (the target's answers only add to it), so a chat the engine would refuse at a
    later turn is known before its first turn is answered. A request whose text (rendered by the chat
    template: a default system preamble counts) is less than half of ``limit`` in UTF-8 bytes is not
    tokenized (each token holds at least one byte) and counts 0. So does a conversation the chat
    template refuses (``raise_exception``: "System role not supported"): the engine refuses that
    request alone, and it is reported with the run's other failed requests."""
    if e.mode == "raw":
        text = raw_text(e)
        if len(text.encode("utf-8")) * 2 < limit:
            return 0
        return len(tok(text)["input_ids"])  # vLLM adds the tokenizer's special tokens to a plain prompt
    later = [m for t in e.later_turns for m in ({"role": "assistant", "content": ""}, {"role": "user", "content": t})]
    try:  # rendering is cheap next to tokenizing; it tells what the template adds (a long preamble)
        rendered = tok.apply_chat_template(e.messages() + later, tokenize=False, add_generation_prompt=True,
                                           **(chat_kwargs(gen, template_kwargs) or {}))
    except TemplateError:
        return 0
    if len(rendered.encode("utf-8")) * 2 < limit:
        return 0
    return len(tok(rendered, add_special_tokens=False)["input_ids"])


def _record_dropped(path, earlier: dict, gen_id: str, dropped: list[dict]) -> None:
    earlier[gen_id] = {**earlier.get(gen_id, {}), **{d["sample_id"]: d["domain"] for d in dropped}}
    _write_dropped(path, earlier)


def _read_dropped(path) -> dict[str, dict[str, str]]:
    """``{gen_params_id: {sample_id: domain}}`` of earlier runs' drops (empty if no file)."""
    if path is None or not Path(path).is_file():
        return {}
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (ValueError, RecursionError):  # nested past the parser's depth: as unreadable
        log.warning("%s is not valid JSON: earlier drops are tried again", path)
        return {}
    if not isinstance(data, dict) or not all(isinstance(ids, dict) for ids in data.values()):
        log.warning("%s does not map gen_params_ids to {sample_id: domain}: earlier drops are tried again", path)
        return {}
    return data


def _write_dropped(path, data: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(Path(path), data)


def _run_inprocess(shards, *, cfg, target, store_uri, gen, gen_id, on_result, backend=None, think=None,
                   trust_remote_code: bool = False) -> None:
    """Stream every shard's prompts through one backend; write + commit each shard as it completes."""
    own = backend is None
    backend = backend or make_backend(cfg, target, trust_remote_code=trust_remote_code)
    where = {e.sample_id: (k, i) for k, shard in enumerate(shards) for i, e in enumerate(shard)}
    left = [len(s) for s in shards]
    rows: dict[int, dict[int, dict]] = {k: {} for k in range(len(shards))}
    failures: dict[int, list] = {k: [] for k in range(len(shards))}
    dropped: dict[int, list] = {k: [] for k in range(len(shards))}
    retries = getattr(backend, "retries", 0)
    try:
        for e, r, err in stream(backend, (e for shard in shards for e in shard), gen, gen_id, think=think):
            k, i = where[e.sample_id]
            if isinstance(err, Dropped):
                dropped[k].append({"sample_id": e.sample_id, "domain": e.domain, "reason": str(err)})
            elif r is None:
                failures[k].append({"sample_id": e.sample_id, "error": err})
            else:
                rows[k][i] = r
            left[k] -= 1
            if left[k]:
                continue
            got = rows.pop(k)
            done = [got[i] for i in sorted(got)]  # entry order: the same fragments as a batch run
            res = shard_result(guarded(lambda: write_rows(store_uri, done), store_uri) if done else [],
                               done, failures.pop(k), dropped.pop(k))
            now = getattr(backend, "retries", 0)
            res["retries"], retries = now - retries, now
            on_result(k, res)
    finally:
        if own:
            backend.close()


def _run_dask(shards, *, cfg, target, store_uri, gen, gen_id, on_result, client=None, think=None,
              trust_remote_code: bool = False) -> None:
    dask_executor.run(shards, cfg=cfg, target=target, store_uri=store_uri, gen=gen, gen_id=gen_id,
                      on_result=on_result, client=client, think=think, trust_remote_code=trust_remote_code)
