"""The prompt pool: load sources, normalise, deduplicate, cap, and split held-out prompts.

Loading is the only I/O; everything after it is a pure function of the loaded records, so the same
manifest and sources always give the same pool. Order, the held-out split and the chat/raw choice
are all derived from a hash of the normalised content (never from file order or a random state),
so adding a source does not reshuffle the prompts already chosen. A conversation (several user
turns) is one pool entry; its identity is the hash of its system prompt and every user turn, each
apart (``eaglenest.text.conversation_key``; a table written before keeps the scheme it was written with).
Optional near-duplicate removal (``dedup.near_duplicate_threshold``) walks each domain in that same
hash order and drops a prompt whose user turns are near ones already kept (this domain's, or those
earlier domains chose); system prompts are left out of the comparison, since a shared system
prompt would make every prompt look alike. Adding a near twin with a lower hash than a chosen
prompt does replace it: the price of keeping the choice a pure function of the content.
"""

from __future__ import annotations

import codecs
import dataclasses
import hashlib
import json
import logging
from pathlib import Path
from typing import Callable

from eaglenest.errors import ManifestError, require
from eaglenest.hf import load_tokenizer
from eaglenest.text import SAMPLE_ID_SCHEME, content_key, conversation_key, is_blank, normalise, tidy
from eaglenest.ingest import compose
from eaglenest.ingest.manifest import Manifest, Source, input_file, source_format
from eaglenest.ingest.neardup import NearDupIndex
from eaglenest.paths import shown_path

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PoolEntry:
    sample_id: str
    domain: str
    source: str
    split: str     # "train" | "heldout"
    mode: str      # "chat" | "raw"
    system: str
    prompt: str
    #: Further user turns of a multi-turn conversation, answered on-policy in order.
    later_turns: tuple[str, ...] = ()

    def messages(self) -> list[dict[str, str]]:
        msgs = [{"role": "system", "content": self.system}] if self.system else []
        return msgs + [{"role": "user", "content": self.prompt}]

    def user_turns(self) -> list[str]:
        return [self.prompt, *self.later_turns]


def _unit(key: str, salt: str) -> float:
    """A deterministic number in [0, 1) from a content key."""
    return int(hashlib.sha256(f"{salt}:{key}".encode()).hexdigest()[:12], 16) / float(1 << 48)


def _read_rows(src: Source, where: str, base_dir) -> tuple[list, str]:
    """The raw rows of one source; unreadable data (binary, not UTF-8, corrupt) is a ManifestError."""
    if src.path:
        p = input_file(src.path, base_dir, key=f"{where}.path")
        fmt = source_format(src.path, p)
        if fmt == ".parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            try:
                return pq.read_table(p).to_pylist(), _label(src.path)
            except (pa.ArrowException, OSError) as exc:
                raise ManifestError(f"{where}.path: {shown_path(src.path)} is not a readable Parquet file "
                                    f"({_short(exc)})") from None
        text = read_text(p, src.path, f"{where}.path")
        if fmt == ".jsonl":
            return [row for _, row in json_lines(text, src.path, f"{where}.path")], _label(src.path)
        try:
            rows = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise ManifestError(f"{where}.path: {shown_path(src.path)} is not valid JSON "
                                f"({_json_error(exc)})") from None
        if not isinstance(rows, list):
            raise ManifestError(f"{where}.path: {shown_path(src.path)} holds {json_kind(rows)}, not a list of rows")
        return rows, _label(src.path)
    datasets = require("datasets")
    label = f"hf:{src.hf_id}/{src.hf_config or 'default'}/{src.hf_split}"
    try:
        if Path(src.hf_id, "state.json").is_file():  # a folder Dataset.save_to_disk wrote: one split, read whole
            return list(datasets.load_from_disk(src.hf_id)), f"hf:{src.hf_id}"
        ds = datasets.load_dataset(src.hf_id, src.hf_config or None, split=src.hf_split)
    except (OSError, ValueError, datasets.exceptions.DatasetsError) as exc:  # not found, offline, no such split
        raise ManifestError(f"{where}.hf_id: cannot load {shown_path(label)} ({_short(exc, 200)})") from None
    return list(ds), label


def _label(path: str) -> str:
    """A local source's label, stored in every row's ``source``: a file name byte that is not UTF-8
    (a lone surrogate in ``path``) is escaped, since Arrow refuses to write one."""
    return path.encode("utf-8", "backslashreplace").decode("utf-8")


def read_text(p: Path, path: str, key: str) -> str:
    """The UTF-8 text of file ``p`` (``path`` as the user wrote it); ManifestError naming ``key`` if not."""
    try:
        data = p.read_bytes()
    except OSError as exc:  # no read permission, a failing disk or mount
        raise ManifestError(f"{key}: {shown_path(path)} cannot be read ({exc.strerror or exc})") from None
    if _is_utf16(data):  # Windows "Unicode", PowerShell's `>`: not the binary file the error below suspects
        raise ManifestError(f"{key}: {shown_path(path)} is UTF-16 text, not UTF-8; save it as UTF-8")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ManifestError(f"{key}: {shown_path(path)} line {line} is not UTF-8 text (byte {exc.start}; "
                            "binary file?)") from None
    return text.removeprefix("\ufeff")  # a byte-order mark (Windows editors write one) is not content


def _is_utf16(data: bytes) -> bool:
    """Whether ``data`` is UTF-16 text with a byte-order mark (a binary file may start with one too)."""
    if not data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        return False
    try:
        data.decode("utf-16")
    except UnicodeDecodeError:
        return False
    return True


def json_lines(text: str, path: str, key: str) -> list[tuple[int, object]]:
    """``(line number, value)`` of every non-blank JSONL line; a bad line is a ManifestError naming ``key``."""
    rows = []
    for n, line in enumerate(text.split("\n"), 1):  # not splitlines(): U+2028 etc. may sit inside a string
        if not line.strip():
            continue
        try:
            rows.append((n, json.loads(line)))
        except (ValueError, RecursionError) as exc:
            raise ManifestError(f"{key}: {shown_path(path)} line {n} is not valid JSON "
                                f"({_json_error(exc, line_known=True)})") from None
    return rows


def _json_error(exc: Exception, *, line_known: bool = False) -> str:
    """Why ``json.loads`` refused a text, in one short phrase. Besides malformed JSON, Python's parser
    refuses valid JSON nested past its recursion limit (a RecursionError) and integers past its digit
    limit (a ValueError): both came out as a traceback."""
    if isinstance(exc, json.JSONDecodeError):
        return f"{exc.msg}, column {exc.colno}" if line_known else str(exc)
    if isinstance(exc, RecursionError):
        return "nested too deeply"
    return _short(exc)


def _short(value, limit: int = 80) -> str:
    """A user value or message echoed in an error: one line, at most ``limit`` characters."""
    text = " ".join(str(value).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def json_kind(value) -> str:
    """What a non-string value is, in JSON words (errors name the type, never echo the value)."""
    if value is None:
        return "null"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, (bytes, bytearray)):
        return "binary data"
    return f"a {type(value).__name__}"


def text_value(value, what: str, where: str, *, null_ok: bool = False) -> str:
    """``value`` if it is a string of valid Unicode ('' for null when ``null_ok``); otherwise a
    ManifestError. JSON escapes can spell a lone surrogate (``"\\ud800"``), which no UTF-8 writer takes."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ManifestError(f"{where}: {what} is not valid Unicode text (a lone surrogate)") from None
        return value
    if value is None and null_ok:
        return ""
    raise ManifestError(f"{where}: {what} is {json_kind(value)}, not a string")


def load_eval_prompts(path: str | Path, *, where: str) -> list[str]:
    """The prompts of one evaluation file (JSONL, a row's ``turns``, user ``messages`` or ``prompt``;
    ``contamination.py``). Prompts must be strings of valid Unicode, as in a source; anything else is a
    ManifestError naming ``where``, file and line."""
    out = []
    for n, row in json_lines(read_text(Path(path), str(path), where), str(path), where):
        at = f"{where}: line {n} of {shown_path(path)}"
        if not isinstance(row, dict):
            raise ManifestError(f"{at} is {json_kind(row)}, not an object")
        for col, what in (("turns", "prompts"), ("messages", "messages")):  # not skipped for a 'prompt' beside
            if row.get(col) is not None and not isinstance(row[col], list):  # null: a column this row leaves out
                raise ManifestError(f"{at}: '{col}' is {json_kind(row[col])}, not a list of {what}")
        if isinstance(row.get("turns"), list):
            out += [text_value(t, f"turn {j}", at) for j, t in enumerate(row["turns"])]
        elif isinstance(row.get("messages"), list):
            if not all(isinstance(m, dict) for m in row["messages"]):
                raise ManifestError(f"{at}: 'messages' is not a list of messages")
            out += [text_value(m.get("content"), f"message {j} (user) content", at)
                    for j, m in enumerate(row["messages"]) if m.get("role") == "user"]
        elif "prompt" in row:
            out.append(text_value(row["prompt"], "column 'prompt'", at))
        else:
            raise ManifestError(f"{at} has no 'turns', 'messages' or 'prompt'")
    if not out:  # an empty or failed download: the check would pass, having compared against nothing
        raise ManifestError(f"{where}: {shown_path(path)} holds no evaluation prompt (an empty or truncated file?); "
                            "give the evaluation set's file, or leave it out of contamination")
    return out


def evaluation_prompts(manifest: Manifest, *, base_dir: str | Path | None = None) -> list[str]:
    """Every prompt of the manifest's evaluation files (``contamination.mt_bench`` and ``.speed_bench``)."""
    evals: list[str] = []
    for kind in ("mt_bench", "speed_bench"):
        for i, path in enumerate(getattr(manifest.contamination, kind)):
            key = f"contamination.{kind}[{i}]"
            evals += load_eval_prompts(input_file(path, base_dir, key=key), where=key)
    return evals


def load_source(src: Source, *, where: str, base_dir: str | Path | None = None) -> list[dict]:
    """Rows of one source as dicts with ``prompt``, ``system``, ``later_turns`` (I/O edge).

    Prompts and message contents must be strings of valid Unicode (a null, number, list, object or
    lone surrogate is refused, never turned into the text "None" or "42"); a null system prompt counts
    as no system prompt, a conversation without a user turn as an empty prompt (counted, never kept).
    A source with no rows at all is an error.
    """
    rows, label = _read_rows(src, where, base_dir)
    shown = shown_path(label)  # in error lines: a newline in a file name stays visible, one line
    if not rows:
        raise ManifestError(f"{where}: {shown} has no rows")
    out = []
    for i, row in enumerate(rows):
        col = src.messages_field or src.field
        key = "messages_field" if src.messages_field else "field"
        if not isinstance(row, dict):
            raise ManifestError(f"{where}.{key}: row {i} of {shown} is {json_kind(row)}, not an object")
        if col not in row:
            raise ManifestError(f"{where}.{key}: row {i} of {shown} has no column '{col}'")
        system = (text_value(row.get(src.system_field), f"column '{src.system_field}'",
                             f"{where}.system_field: row {i} of {shown}", null_ok=True)
                  if src.system_field else "")
        if src.messages_field:
            msgs = row[col]
            if not isinstance(msgs, list) or not all(isinstance(m, dict) for m in msgs):
                raise ManifestError(f"{where}.messages_field: row {i} of {shown} is not a list of messages")
            at = f"{where}.messages_field: row {i} of {shown}"
            _check_roles(msgs, at)
            said = {r: [text_value(m.get("content"), f"message {j} ({r}) content", at)
                        for j, m in enumerate(msgs) if m.get("role") == r] for r in ("system", "user")}
            system = system or next(iter(said["system"]), "")
            turns = said["user"] or [""]  # no user turn: an empty row (counted as such, never kept)
        else:
            turns = [text_value(row[col], f"column '{col}'", f"{where}.field: row {i} of {shown}")]
        out.append({"prompt": turns[0], "later_turns": turns[1:], "system": system, "source": label})
    _check_system_column(src, rows, f"{where}.system_field", shown)
    return out


def _check_system_column(src: Source, rows: list[dict], key: str, shown: str) -> None:
    """A system prompt may be missing row by row, but a ``system_field`` that no row has is a typo (or
    another file's column): every system prompt of the source would be dropped without a word."""
    if src.system_field and not any(src.system_field in row for row in rows):
        columns = _short(", ".join(map(str, rows[0])) or "none")
        raise ManifestError(f"{key}: no row of {shown} has a column '{src.system_field}' (columns: {columns})")


#: Roles a conversation's messages may have: user and system turns are read, the others (answers the
#: target regenerates, tool results) are left out.
ROLES = ("user", "system", "assistant", "tool", "function", "ipython")


def _check_roles(msgs: list[dict], at: str) -> None:
    """Every message names a known role: one that does not (a ShareGPT ``{from, value}`` turn, or its
    speakers as roles, ``human``/``gpt``) would otherwise be skipped, its row counted as empty, and a
    ``developer`` message (OpenAI's system prompt) dropped without a word."""
    for j, m in enumerate(msgs):
        role = m.get("role")
        if not isinstance(role, str):
            keys = _short(", ".join(sorted(map(str, m))) or "none")
            raise ManifestError(f"{at}: message {j} has no 'role' string (its keys: {keys}); messages are "
                                "{role, content} objects")
        if role not in ROLES:
            raise ManifestError(f"{at}: message {j} has role '{_short(role, 40)}', not one of {', '.join(ROLES)} "
                                "(rename it: a prompt is read from user and system messages only)")


def build_pool(manifest: Manifest, loaded: dict[str, list[dict]], *,
               count_tokens: Callable[[str], int] | None = None, report: dict | None = None,
               id_scheme: int = SAMPLE_ID_SCHEME) -> list[PoolEntry]:
    """Pure: the pool from the rows loaded per domain (``loaded[domain]``).

    ``count_tokens`` (text -> number of target tokens) is needed only by domains with ``cap_tokens``.
    ``report``, if given, receives per-domain counts: rows, empty, exact and near duplicates, kept, and of
    the kept ones held out. ``id_scheme``: how a conversation's key is taken (``text.conversation_key``):
    the scheme of the prompts table the pool goes into (``build.stored_id_scheme``).
    """
    pool: list[PoolEntry] = []
    seen: set[str] = set()
    near = _near_index(manifest)  # prompts chosen by earlier domains
    for domain, dcfg in manifest.domains.items():
        cands = {}
        counts = {"rows": len(loaded.get(domain, [])), "empty": 0, "exact_duplicates": 0,
                  "near_duplicates": 0, "kept": 0}
        for row in loaded.get(domain, []):
            turns = [tidy(t) for t in [row["prompt"], *row.get("later_turns", [])]]
            if any(is_blank(normalise(t)) for t in turns):  # nothing visible (a zero-width space is no prompt)
                counts["empty"] += 1
                continue
            system = tidy(row["system"])
            if id_scheme > 1 and is_blank(system):  # shows nothing: no system prompt (scheme 1 sent and keyed it)
                system = ""
            key = conversation_key(system, turns, scheme=id_scheme)  # normalises (NFKC) itself
            if key in seen or key in cands:
                counts["exact_duplicates"] += 1
                continue  # exact duplicate (also across domains: the first domain listed owns it)
            cands[key] = (turns, system, row["source"])
        order = sorted(cands)
        if near is not None:  # greedy in hash order: a prompt goes if it is near one kept before it
            local, sketches, kept = _near_index(manifest), {}, []
            for key in order:
                sk = sketches[key] = local.sketch("\n".join(cands[key][0]))  # user turns only
                if near.find(sk) is not None or local.find(sk) is not None:
                    counts["near_duplicates"] += 1
                    continue
                local.add(key, sk)
                kept.append(key)
            order = kept
        chosen, tokens = [], 0
        for key in order:
            if dcfg.cap_prompts is not None and len(chosen) >= dcfg.cap_prompts:
                break
            if dcfg.cap_tokens is not None:
                if count_tokens is None:
                    raise ManifestError(f"domains.{domain}.cap_tokens: needs the target's tokenizer")
                turns, system, _ = cands[key]
                n = count_tokens("\n".join([system, *turns] if system else turns))  # no "\n" for no system
                if tokens + n > dcfg.cap_tokens:
                    break  # stop (not skip): a later, shorter prompt never jumps the hash order
                tokens += n
            chosen.append(key)
        # Every prompt of this domain's sources is its own, chosen or not: a prompt its caps leave out is
        # not passed on to a later domain, so a changed cap never moves a stored prompt between domains.
        seen.update(cands)
        if near is not None:
            for key in chosen:
                near.add(key, sketches[key])
        held = _heldout_keys(manifest, domain, chosen)
        counts["kept"], counts["held_out"] = len(chosen), len(held)
        if report is not None:
            report.setdefault("domains", {})[domain] = counts
        for key in chosen:
            turns, system, source = cands[key]
            heldout = key in held
            # Held-out prompts are decoded as chat (docs/manifest.md), except where every training prompt is
            # raw (raw_fraction 1.0: a base model, no chat template to render them with): `evaluate` decodes a
            # raw one, from its first turn, as the raw completion ingest sends.
            raw = (manifest.raw(domain) >= 1.0 if heldout
                   else len(turns) == 1 and _unit(key, "raw") < manifest.raw(domain))
            pool.append(PoolEntry(sample_id=f"{domain}-{key[:16]}", domain=domain, source=source,
                                  split="heldout" if heldout else "train",
                                  mode="raw" if raw else "chat", system=system, prompt=turns[0],
                                  later_turns=tuple(turns[1:])))
    return pool


def _near_index(manifest: Manifest) -> NearDupIndex | None:
    dd = manifest.dedup
    if dd.near_duplicate_threshold is None:
        return None
    return NearDupIndex(dd.near_duplicate_threshold, num_perm=dd.num_perm, shingle_words=dd.shingle_words)


def _heldout_keys(manifest: Manifest, domain: str, chosen: list[str]) -> set[str]:
    kind, value = manifest.held_out(domain)
    if kind == "fraction":
        return {k for k in chosen if _unit(k, "heldout") < value}
    return set(sorted(chosen, key=lambda k: _unit(k, "heldout"))[: int(value)])


def token_counter(target: str, *, trust_remote_code: bool = False) -> Callable[[str], int]:
    tok = load_tokenizer(target, trust_remote_code=trust_remote_code)
    return lambda text: len(tok(text, add_special_tokens=False)["input_ids"])


def load_pool(manifest: Manifest, *, base_dir: str | Path | None = None,
              target: str | None = None, report: dict | None = None, trust_remote_code: bool = False,
              id_scheme: int = SAMPLE_ID_SCHEME, evals: list[str] | None = None) -> list[PoolEntry]:
    """The pool of ``manifest`` (its sources read here). ``evals``: the prompts of its evaluation files,
    when the caller has read them (:func:`evaluation_prompts`; composing leaves them out of long chats)."""
    loaded = {
        name: [r for i, s in enumerate(d.sources)
               for r in load_source(s, where=f"domains.{name}.sources[{i}]", base_dir=base_dir)]
        for name, d in manifest.domains.items()
    }
    needs_tokens = any(d.cap_tokens is not None or d.compose is not None for d in manifest.domains.values())
    counter = token_counter(target, trust_remote_code=trust_remote_code) if needs_tokens and target else None
    if any(d.compose is not None for d in manifest.domains.values()):  # long conversations (compose.py)
        plain = dataclasses.replace(manifest, domains={n: d for n, d in manifest.domains.items() if d.compose is None})
        held = {content_key(t) for e in build_pool(plain, loaded, count_tokens=counter, id_scheme=id_scheme)
                if e.split == "heldout" for t in e.user_turns()}
        # evaluation prompts too: one composed in would make each long chat holding it contaminated, dropped whole
        evals = evaluation_prompts(manifest, base_dir=base_dir) if evals is None else evals
        held |= {content_key(t) for t in evals}
        loaded = compose.apply(manifest, loaded, count_tokens=counter, held_out=held)
    report = {} if report is None else report
    pool = build_pool(manifest, loaded, count_tokens=counter, report=report, id_scheme=id_scheme)
    for name, c in report.get("domains", {}).items():
        if not c["kept"] and pool:  # an empty pool as a whole is the caller's error
            log.warning("domains.%s: no prompt kept (%d rows, %d empty, %d duplicates)", name, c["rows"],
                        c["empty"], c["exact_duplicates"] + c["near_duplicates"])
    return pool


def raw_text(entry: PoolEntry) -> str:
    """What a raw-completion request sends: the prompt as a plain document, no chat markup."""
    return raw_document(entry.system, entry.prompt)


def raw_document(system: str, prompt: str) -> str:
    """:func:`raw_text` of a system prompt and a user turn (``evaluate`` decodes raw held-out prompts so)."""
    return (system + "\n\n" if system else "") + prompt + "\n"
