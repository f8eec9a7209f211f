"""The defaults and tables the docs state, held to the code (split from tests/test_docs_walk_qa.py):

* the defaults the docs state (a ``| key | default |`` table, ``key`` (default N), ``key=V`` (default),
  ``--flag`` (default N)) are the code's;
* the column tables of docs/formats.md are the Arrow schemas, and its list of feature metadata is
  ``FeatureMeta``'s fields;
* the tables that list a section's keys (docs/training.md, docs/trackers.md) list all of them, and
  the renamed flat keys docs/training.md lists are ``train/config.py``'s.

No engine, no subprocess, no run folder: a few seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import io
import re
import sys
import tempfile
from contextlib import redirect_stderr, redirect_stdout
from functools import cache
from pathlib import Path

import pytest

from eaglenest.config import override_value
from eaglenest.featurestore import schema
from eaglenest.recipe import SECTIONS, load_recipe
from eaglenest.train import config as train_config

sys.path.insert(0, str(Path(__file__).parent))
import test_docs_consistent as C  # noqa: E402  (its extraction of code spans, keys and commands)

ROOT = C.ROOT


# ---- defaults ----------------------------------------------------------------------------------

@cache
def _defaults() -> dict[str, object]:
    """Every recipe key's default, dotted (``train.stream.depth``), as the empty recipe loads it."""
    out: dict[str, object] = {}

    def walk(d: dict, prefix: str) -> None:
        for k, v in d.items():
            if isinstance(v, dict) and v and k != "storage_options":
                walk(v, f"{prefix}{k}.")
            out[f"{prefix}{k}"] = v

    with tempfile.TemporaryDirectory() as tmp:
        empty = Path(tmp, "empty.yaml")
        empty.write_text("{}\n")
        walk(load_recipe(empty).to_dict(), "")
    return out


def same_value(shown: str, value: object) -> bool:
    """Whether a doc's ``shown`` (``8``, ``1800``, ``features``, ``null``, ``[a, b]``), read as an
    override value would be, is ``value``."""
    parsed = override_value(shown.strip("`"))
    if parsed in ('""', "''"):
        parsed = ""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and isinstance(parsed, (int, float)):
        return float(parsed) == float(value)
    value = list(value) if isinstance(value, tuple) else value
    return type(parsed) is type(value) and parsed == value


def describes_unset(shown: str, value: object) -> bool:
    """Whether ``shown`` says what an unset key (``""``, ``[]``, null, 0) stands for rather than a
    value: ``<workdir>/store``, ``(2, L//2, L-3)``, another key (``run.target``)."""
    if isinstance(value, bool) or value not in ("", [], (), None, 0):
        return False
    parsed = override_value(shown.strip("`"))
    return (not isinstance(parsed, type(value)) or parsed in _defaults()
            or (isinstance(parsed, str) and "<" in parsed))


KEY_SPAN = rf"`((?:{C.STAGE})(?:\.[a-z_]\w*)+)(?:=[^`\s]*)?`"
#: ``key`` (what it is, default 8), ``key``, default ``features``, ``key`` (default 1800 s: ...).
INLINE_DEFAULT = re.compile(KEY_SPAN + r"[^`\n()]{0,80}?\(?[^`\n()]{0,60}?\bdefault:?\s+"
                            r"(`[^`\n]+`|[-\d.]+(?=[\s;,)])(?!\s*x\s))")  # not "4 x max_num_seqs"
#: ``key`` steps (10 by default).
BY_DEFAULT = re.compile(KEY_SPAN + r"[^`\n()]{0,40}?\((`[^`\n]+`|[-\d.]+) by default\)")
#: ``key=value`` (default).
VALUE_DEFAULT = re.compile(rf"`((?:{C.STAGE})(?:\.[a-z_]\w*)+)=([^`\s]+)`\s*\(default\)")


def _table_defaults(path: Path):
    """(where, key, shown) of each row of a Markdown table whose header has a ``default`` column; a key
    written relative (``tracker``) is under the section the heading above it names in a code span."""
    lines = path.read_text(encoding="utf-8").splitlines()
    section, columns = "", None
    for n, line in enumerate(lines, 1):
        if line.startswith("#"):
            spans = re.findall(rf"`((?:{C.STAGE})(?:\.\w+)*)`", line)
            section, columns = (spans[0] if spans else ""), None
            continue
        if not line.startswith("|"):
            columns = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if columns is None:
            columns = [c.lower() for c in cells]
            continue
        if "default" not in columns or set(line) <= set("|- "):
            continue
        key = cells[0].strip("`")
        key = key if key.split(".")[0] in SECTIONS else f"{section}.{key}"
        yield f"{path.relative_to(ROOT)}:{n}", key, cells[columns.index("default")]


def _stated_defaults():
    for path in C.DOCS:
        yield from _table_defaults(path)
        text = path.read_text(encoding="utf-8")
        for rx in (INLINE_DEFAULT, BY_DEFAULT, VALUE_DEFAULT):
            for m in rx.finditer(text):
                yield f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}", m.group(1), m.group(2)


def test_defaults_the_docs_state_are_the_codes():
    stated = list(_stated_defaults())
    assert len(stated) > 25, "the extraction finds the defaults the docs state"
    defaults = _defaults()
    bad = [f"{where}: `{key}`: the doc says {shown}, the code has {defaults.get(key, '(no such key)')!r}"
           for where, key, shown in stated
           if key not in defaults or not (same_value(shown, defaults[key]) or describes_unset(shown, defaults[key]))]
    assert not bad, "defaults in the docs that the code does not have:\n" + "\n".join(bad)


def test_same_value_compares_as_the_doc_means():
    assert same_value("8", 8) and same_value("1800", 1800.0) and same_value("`features`", "features")
    assert same_value("null", None) and same_value("`true`", True) and same_value('`""`', "")
    assert same_value("`[records, code]`", ["records", "code"])
    assert not same_value("7", 8) and not same_value("`raw`", "fp8_e4m3") and not same_value("0", None)
    assert describes_unset("`<workdir>/store`", "") and describes_unset("`(2, L//2, L-3)`", [])
    assert describes_unset("`run.target`", "") and not describes_unset("`other`", "")
    assert not describes_unset("4", 8) and not describes_unset("false", False)


#: ``--flag`` (default 1), the default ``--flag 0``.
OPTION_DEFAULT = re.compile(r"`(--[a-z][\w-]*)`[^`\n()]{0,20}\(default (\S+?)[\s);,]|"
                            r"default `(--[a-z][\w-]*) ([^`\s]+)`")


def _parsed_defaults(monkeypatch) -> dict[str, dict[str, object]]:
    """{option: {"script sub": its default}} for every option of every stage subcommand, from argparse
    itself: each subcommand is parsed with its required options and not run."""
    import eaglenest.launch as launch

    parsed: list[argparse.Namespace] = []
    monkeypatch.setattr(launch, "execute", lambda prog, cmd, args, argv=None: parsed.append(args) or 0)
    out: dict[str, dict[str, object]] = {}
    for script, target in C.SCRIPTS.items():
        if script not in SECTIONS:
            continue
        module, func = target.split(":")
        main = getattr(importlib.import_module(module), func)
        for sub in _subcommands(script):
            parsed.clear()
            with redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()):
                main([sub, *_required(script, sub)])
            for name, value in vars(parsed[0]).items():
                out.setdefault("--" + name.replace("_", "-"), {})[f"{script} {sub}"] = value
    return out


def _subcommands(script: str) -> list[str]:
    module, func = C.SCRIPTS[script].split(":")
    main = getattr(importlib.import_module(module), func)
    out = io.StringIO()
    with redirect_stdout(out), redirect_stderr(io.StringIO()), pytest.raises(SystemExit):
        main(["--help"])
    return re.findall(r"^    ([a-z][\w-]*)", out.getvalue(), re.M)


def _required(script: str, sub: str) -> list[str]:
    """Placeholder values for the options ``<script> <sub>`` requires, read from its usage line."""
    usage = C._help(script, sub) or ""
    usage = usage.split("\n\n")[0]
    required = re.findall(r"(?<!\[)(--[a-z][\w-]*)\s+(?:\{([\w,]+)\}|[A-Z_:]+)", usage)
    args = []
    for flag, choices in required:
        args += [flag, choices.split(",")[0] if choices else "0"]
    return args


def test_option_defaults_the_docs_state_are_the_parsers(monkeypatch):
    parsed = _parsed_defaults(monkeypatch)
    stated = []
    for path in C.DOCS:
        text = path.read_text(encoding="utf-8")
        for m in OPTION_DEFAULT.finditer(text):
            flag, shown = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
            stated.append((f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}", flag, shown))
    assert {flag for _, flag, _ in stated} >= {"--grace-hours", "--max-restarts"}
    assert parsed["--grace-hours"] and parsed["--max-restarts"], "the parsers' defaults are read"
    bad = []
    for where, flag, shown in stated:
        owners = parsed.get(flag, {})
        if not owners:
            continue  # another program's option (the tiny-target build's --seed)
        if not all(same_value(shown, value) for value in owners.values()):
            bad.append(f"{where}: {flag}: the doc says default {shown}, the parser has {owners}")
    assert not bad, "\n".join(bad)


# ---- docs/formats.md against the schema ---------------------------------------------------------

def _formats_table(heading: str) -> list[tuple[str, str]]:
    """(column, type) of every column the table under ``heading`` of docs/formats.md lists."""
    text = (ROOT / "docs" / "formats.md").read_text(encoding="utf-8")
    body = text.split(heading, 1)[1].split("\n#", 1)[0]
    rows = [line.strip().strip("|").split("|") for line in body.splitlines() if line.startswith("| ")]
    out = []
    for cells in rows[1:]:  # the header row first
        names, kind = cells[0].strip(), cells[1].strip()
        out += [(name.strip(), kind) for name in names.split(",")]
    return out


def _arrow_type(kind: str) -> str:
    """A doc's type cell (``list<int32>``, ``large_binary, Lance blob``) as Arrow prints it."""
    kind = kind.split(",")[0].strip()
    return re.sub(r"list<(\w+)>", r"list<item: \1>", kind)


@pytest.mark.parametrize("heading, arrow", [("### `prompts`", schema.PROMPTS_SCHEMA),
                                            ("### `features`", schema.FEATURES_SCHEMA)], ids=["prompts", "features"])
def test_formats_md_lists_the_schema_columns(heading, arrow):
    listed = _formats_table(heading)
    assert [name for name, _ in listed] == arrow.names, f"docs/formats.md {heading}: the columns, in order"
    wrong = [f"{name}: doc {_arrow_type(kind)}, schema {arrow.field(name).type}" for name, kind in listed
             if _arrow_type(kind) != str(arrow.field(name).type)]
    assert not wrong, "\n".join(wrong)


def test_formats_md_lists_the_feature_metadata_fields():
    text = (ROOT / "docs" / "formats.md").read_text(encoding="utf-8")
    said = text.split("Table metadata `eaglenest.feature_meta` (JSON) holds", 1)[1].split("(the JSON", 1)[0]
    listed = re.findall(r"`(\w+)`", re.sub(r"\([^)]*\)", "", said))  # not the values in brackets
    assert sorted(listed) == sorted(f.name for f in dataclasses.fields(schema.FeatureMeta))


# ---- tables of a section's keys, renamed keys ------------------------------------------------------

def _section_of(dotted: str):
    cls = None
    for i, part in enumerate(dotted.split(".")):
        if i == 0:
            module, name = SECTIONS[part].split(":")
            cls = getattr(importlib.import_module(module), name)
        else:
            cls = {f.name: f.type for f in dataclasses.fields(cls)}[part]
            cls = getattr(sys.modules[train_config.__name__], cls) if isinstance(cls, str) else cls
    return cls


def test_training_md_section_table_lists_every_key():
    text = (ROOT / "docs" / "training.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| `(train\.\w+)` \| ((?:`\w+`(?:, )?)+) \|", text, re.M)
    nested = {f.name for f in dataclasses.fields(train_config.TrainConfig) if dataclasses.is_dataclass(f.default)
              or (f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory))}
    assert {section.split(".")[1] for section, _ in rows} == nested, "one row per nested section of train"
    wrong = []
    for section, keys in rows:
        listed = re.findall(r"`(\w+)`", keys)
        fields = [f.name for f in dataclasses.fields(_section_of(section))]
        if sorted(listed) != sorted(fields):
            wrong.append(f"{section}: the doc lists {listed}, the code has {fields}")
    assert not wrong, "\n".join(wrong)


def test_trackers_md_table_lists_every_track_key():
    keys = [key for _where, key, _shown in _table_defaults(ROOT / "docs" / "trackers.md")]
    fields = [f"train.track.{f.name}" for f in dataclasses.fields(_section_of("train.track"))]
    assert sorted(keys) == sorted(fields)


def test_training_md_lists_the_renamed_keys():
    text = (ROOT / "docs" / "training.md").read_text(encoding="utf-8")
    said = text.split("The keys of the\nearlier flat layout are refused", 1)[1].split("Training states", 1)[0]
    pairs = re.findall(r"`([\w*]+)` -> `([\w.*]+)`", said)
    assert pairs, "docs/training.md lists the renamed keys as `old` -> `new`"
    covered = {old: new for old, new in train_config.RENAMED.items()
               for pat_old, pat_new in pairs
               if re.fullmatch(pat_old.replace("*", r"(\w+)"), old)
               and re.sub(r"^" + pat_old.replace("*", r"(\w+)") + "$", pat_new.replace("*", r"\1"), old) == new}
    assert covered == train_config.RENAMED, f"not listed (or listed wrong): {set(train_config.RENAMED) - set(covered)}"
