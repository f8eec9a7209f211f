"""What walking README.md and the docs as a newcomer found, each as a check that would catch it again.

tests/test_docs_consistent.py checks that keys, commands, options, files, tests and sections the docs
name exist. These check what it does not, all read from the text and held to the project's own code:

* a Python name a doc cites (``eaglenest.engine.make_llm``, ``lease.WAIT_S``) exists: reliability.md
  named ``versions._check_tag``, which no module has (the check is ``store.check_tag``);
* an override the shell would change is shown quoted: the README showed
  ``ingest.chat_template_kwargs={enable_thinking: true}`` bare, which the shell splits into two
  arguments that are both refused, and storage.md ``...aws_secret_access_key=${MY_SECRET}``, which
  the shell expands to the secret itself, which the recipe refuses as a literal credential;
* a key that looks like a module path (``train.peagle.num_slots``: there is a ``train/peagle.py``) still
  resolves, as a recipe key or as that module's name: test_docs_consistent leaves every such key out,
  so 84 mentions (``train.state.*``, ``train.peagle.*``, ``train.dflash.*``, ``train.track.*``, ...)
  were never checked;
* the defaults the docs state (a ``| key | default |`` table, ``key`` (default N), ``key=V`` (default),
  ``--flag`` (default N)) are the code's;
* the column tables of docs/formats.md are the Arrow schemas, and its list of feature metadata is
  ``FeatureMeta``'s fields;
* the tables that list a section's keys (docs/training.md, docs/trackers.md) list all of them, and
  the renamed flat keys docs/training.md lists are ``train/config.py``'s;
* a link between pages (``[featurestore.md](featurestore.md#...)``) reaches a file and one of its
  headings: reliability.md linked ``#...-featurestoreleasepy``, a heading from before ``lease.py``
  moved into ``featurestore/table/``;
* README.md's Docs section links every page of docs/ (docs/families.md was missing), its Layout
  table is pyproject.toml's package map, and design.md's "Errors" names every error type
  (``MissingExtraError`` was missing);
* docs/design.md's map of featurestore's rooms names every module of each folder, in the order
  tests/test_layering.py holds them to.

No engine, no subprocess, no run folder: a few seconds.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import io
import re
import sys
import tempfile
import tomllib
from contextlib import redirect_stderr, redirect_stdout
from functools import cache
from pathlib import Path

import pytest

from eaglenest import errors
from eaglenest.config import override_value
from eaglenest.errors import ConfigError
from eaglenest.featurestore import schema
from eaglenest.recipe import SECTIONS, load_recipe
from eaglenest.train import config as train_config

sys.path.insert(0, str(Path(__file__).parent))
import test_docs_consistent as C  # noqa: E402  (its extraction of code spans, keys and commands)
import test_layering as L  # noqa: E402  (the order it holds featurestore's rooms to)

ROOT = C.ROOT
STAGE_FOLDERS = ("ingest", "featurestore", "train", "serve", "evaluate", "pipeline", "tinytarget")
PROJECT = [p for folder in ("common", *STAGE_FOLDERS) for p in sorted((ROOT / folder).rglob("*.py"))]


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    parts = parts[1:] if parts[0] == "common" else parts
    return ".".join(("eaglenest", *parts)).removesuffix(".__init__")


@cache
def _quoted_in_code() -> frozenset[str]:
    """Every dotted word the project's code writes between quotes (``"eaglenest.lineage"``)."""
    quoted = re.compile(r"""["']([\w.]+\.[\w.]+)["']""")
    return frozenset(m for p in PROJECT for m in quoted.findall(p.read_text(encoding="utf-8")))


@cache
def _modules_by_stem() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for path in PROJECT:
        if path.stem != "__init__":
            out.setdefault(path.stem, []).append(_module_name(path))
    return out


def _module_file(dotted: str) -> Path | None:
    """The source file of project module ``dotted`` (``eaglenest.featurestore.table.lease``), if any."""
    parts = dotted.split(".")
    if parts[0] != "eaglenest":
        return None
    rest = parts[1:]
    base = ROOT / ("common" if not rest or rest[0] not in STAGE_FOLDERS else "")
    for candidate in (base.joinpath(*rest).with_suffix(".py") if rest else None, base.joinpath(*rest, "__init__.py")):
        if candidate is not None and candidate.is_file():
            return candidate
    return None


@cache
def _names_defined(path: Path, cls: str = "") -> frozenset[str]:
    """Names bound at the top of module ``path`` (or in the body of its class ``cls``): functions,
    classes, assignments, imports; read with ``ast``, so no heavy library is imported."""
    body = ast.parse(path.read_text(encoding="utf-8")).body
    if cls:
        body = next((n.body for n in body if isinstance(n, ast.ClassDef) and n.name == cls), [])
    out = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            out |= {n.id for target in targets for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return frozenset(out)


def python_name_problem(dotted: str) -> str | None:
    """None if ``dotted`` (``eaglenest.a.b``, ``eaglenest.a.b.Name``, ``eaglenest.a.b.Class.attr``) is
    a project module and names bound in it; else why not."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        path = _module_file(module)
        if path is None:
            continue
        rest = parts[i:]
        if rest and rest[0] not in _names_defined(path):
            return f"{module} has no {rest[0]}"
        if len(rest) > 1 and rest[0][:1].isupper() and _names_defined(path, rest[0]) \
                and rest[1] not in _names_defined(path, rest[0]):
            return f"{module}.{rest[0]} has no {rest[1]}"
        return None
    return "no such module"


# ---- Python names ------------------------------------------------------------------------------

#: A dotted name in a code span: ``eaglenest.x.y``, ``lease.WAIT_S``, ``query.preview_query()``.
DOTTED = re.compile(r"(?<![\w./<$-])([a-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\(\))?(?![\w/=-])")
FILE_SUFFIX = re.compile(r"\.(md|py|yaml|json|jsonl|lance|safetensors|log|csv|parquet|png|toml|sh|txt|crc|stamp)$")
#: First segments that a doc uses for something other than a project module, each with what it is.
NOT_MODULES = {
    "model": "Hugging Face weight names (model.norm.weight, model.language_model.*)",
    "compose": "the manifest's compose keys (compose.target_tokens)",
    "pool": "stats.json's pool section (pool.domains)",
    "state": "train.state keys written relative to the train section (state.every_steps)",
    "speculators": "the speculators package's own modules",
}


def _cited_names():
    """(where, as written, the eaglenest name it stands for) of every dotted Python name in a code span
    or block: ``eaglenest.*`` as written, ``<module>.<name>`` when ``<module>`` is the file name of one
    project module. Left out: recipe keys (``train.*``: test_docs_consistent), file names, and names
    the code itself writes in quotes (``eaglenest.lineage`` is a metadata key, not a module)."""
    stems = _modules_by_stem()
    for path in C.DOCS:
        for line, text, _lang in C._code(path):
            for m in DOTTED.finditer(text):
                name = m.group(1)
                head = name.split(".")[0]
                if FILE_SUFFIX.search(name) or name in _quoted_in_code():
                    continue
                if head == "eaglenest":
                    full = name
                elif head not in SECTIONS and head not in NOT_MODULES and len(stems.get(head, [])) == 1:
                    full = stems[head][0] + name[len(head):]
                else:
                    continue
                yield C._where(path, line, text, m.start()), name, full


def test_python_names_the_docs_cite_exist():
    names = list(_cited_names())
    assert len(names) > 60, "the extraction finds the names the docs cite"
    bad = [f"{where}: `{name}` ({full}): {problem}" for where, name, full in names
           if (problem := python_name_problem(full))]
    assert not bad, "Python names in the docs that the code does not have:\n" + "\n".join(bad)


def test_python_name_check_tells_a_missing_name():
    assert python_name_problem("eaglenest.featurestore.table.store.check_tag") is None
    assert python_name_problem("eaglenest.featurestore.table.versions._check_tag") == (
        "eaglenest.featurestore.table.versions has no _check_tag")
    assert python_name_problem("eaglenest.nosuchmodule") == "eaglenest has no nosuchmodule"
    assert python_name_problem("eaglenest.featurestore.read.reader.SampleReader.nosuch") == (
        "eaglenest.featurestore.read.reader.SampleReader has no nosuch")
    assert python_name_problem("eaglenest.train.data.FeatureShards.read") is None


# ---- overrides the shell would split -----------------------------------------------------------

#: ``section.key=`` followed by a value that opens a bracket or a quote.
OPEN_VALUE = re.compile(rf"(?<![\w./$=-])((?:{C.STAGE})(?:\.\w+)+)=([\[{{'\"])")
CLOSERS = {"[": "]", "{": "}", "'": "'", '"': '"'}


def unquoted_blank(text: str, start: int, opener: str) -> bool:
    """Whether the value opened by ``opener`` at ``start`` holds a blank before it closes, in a
    ``key=value`` that is not itself inside quotes (the shell then passes it as two arguments)."""
    depth, i = 0, start
    while i < len(text):
        c = text[i]
        if c == opener and opener in "[{":
            depth += 1
        elif c == CLOSERS[opener] and (opener in "[{" or i > start):
            depth -= 1
            if depth <= 0:
                break
        elif c.isspace():
            return True
        i += 1
    return False


def _shell_changed_overrides():
    """(where, override) of every override the shell would not pass as shown: a value holding a blank
    inside brackets (two arguments) not in quotes, or a ``$`` (expanded by the shell: a
    ``${MY_SECRET}`` reference arrives as the secret itself, which the recipe refuses) not in single
    quotes."""
    for path in C.DOCS:
        for line, text, _lang in C._code(path):
            for m in OPEN_VALUE.finditer(text):
                quoted = m.start() > 0 and text[m.start() - 1] in "'\""
                if not quoted and unquoted_blank(text, m.start(2), m.group(2)):
                    yield C._where(path, line, text, m.start()), text[m.start():text.find("\n", m.start())]
            for m in C.OVERRIDE.finditer(text):
                if "$" in m.group(2) and not (m.start() > 0 and text[m.start() - 1] == "'"):
                    yield C._where(path, line, text, m.start()), m.group(0)


def test_overrides_the_shell_would_change_are_quoted():
    bad = [f"{where}: {shown.strip()[:100]}" for where, shown in _shell_changed_overrides()]
    assert not bad, ("overrides the shell would split or expand, shown unquoted (write "
                     "'key={a: 1}', 'key=${VAR}'):\n" + "\n".join(bad))


def test_what_the_shell_makes_of_unquoted_overrides_is_refused():
    """What a newcomer got from the unquoted forms: neither half of a split value loads, and an expanded
    reference is a literal credential; quoted, both load."""
    halves = "ingest.chat_template_kwargs={enable_thinking: true}".split()
    with pytest.raises(ConfigError, match="true}"):
        load_recipe(C.BASE_RECIPE, halves)
    assert load_recipe(C.BASE_RECIPE, [" ".join(halves)]).ingest.chat_template_kwargs == {"enable_thinking": True}
    key = "run.storage_options.aws_secret_access_key"
    with pytest.raises(ConfigError, match=f"^{key}: credentials are not written"):
        load_recipe(C.BASE_RECIPE, [f"{key}=the-secret-the-shell-put-here"])
    assert load_recipe(C.BASE_RECIPE, [f"{key}=${{MY_SECRET}}"]).run.storage_options == {
        "aws_secret_access_key": "${MY_SECRET}"}
    assert unquoted_blank("k={enable_thinking: true}", 2, "{")
    assert not unquoted_blank("k={enable_thinking:true} x", 2, "{")


# ---- keys that look like module paths ----------------------------------------------------------

def _module_like_mentions():
    """The ``section.key`` mentions test_docs_consistent leaves out as module paths (a
    ``<stage>/<first>.py`` or folder exists): ``train.peagle.num_slots``, ``train.state.keep``, ..."""
    for path in C.DOCS:
        for line, text, _lang in C._code(path):
            for m in C.MENTION.finditer(text):
                key = m.group(1)
                stage, first = key.split(".")[:2]
                if key.endswith((".md", ".py", ".yaml")) or first.isupper():
                    continue
                if (ROOT / stage / f"{first}.py").is_file() or (ROOT / stage / first).is_dir():
                    yield C._where(path, line, text, m.start()), key


def test_keys_named_like_modules_resolve_as_keys_or_names():
    mentions = list(_module_like_mentions())
    assert {"train.peagle.num_slots", "train.state.every_steps", "train.track.tracker"} <= {k for _, k in mentions}
    bad = [f"{where}: `{key}`: {msg}" for where, key in mentions
           if (msg := C.unresolved(f"{key}=null")) and python_name_problem(f"eaglenest.{key}")]
    assert not bad, "neither a recipe key nor a Python name:\n" + "\n".join(bad)


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
    monkeypatch.setattr(launch, "execute", lambda prog, cmd, args: parsed.append(args) or 0)
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


# ---- links between pages -----------------------------------------------------------------------

#: ``[text](page.md#anchor)``, ``[text](#anchor)``, ``[text](../BENCHMARKS.md)``.
LINK = re.compile(r"\]\((?!https?:)([^)\s#]*)(?:#([^)\s]+))?\)")


def heading_anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the headings of ``page``: lower case, punctuation dropped (``_`` and
    ``-`` kept), blanks as ``-``, a repeated one numbered ``-1``, ``-2``, ...; fenced blocks skipped."""
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    out: set[str] = set()
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6}\s+(.*?)\s*$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        out.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return out


def test_heading_anchors_are_githubs():
    page = ROOT / "docs" / "featurestore.md"
    assert "concurrent-writers-and-maintenance-featurestoretableleasepy" in heading_anchors(page)
    assert "streaming-bypass-featurestorestreamlocalpy-trainstream_sourcepy" in heading_anchors(page)


def test_links_between_pages_reach_a_file_and_a_heading():
    bad, seen = [], 0
    for path in C.DOCS:
        text = path.read_text(encoding="utf-8")
        for m in LINK.finditer(text):
            target, anchor = m.groups()
            page = (path.parent / target).resolve() if target else path
            where = f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}"
            seen += 1
            if not page.exists():
                bad.append(f"{where}: {target}: no such file")
            elif anchor and page.suffix == ".md" and anchor not in heading_anchors(page):
                bad.append(f"{where}: {target}#{anchor}: no such heading in {page.relative_to(ROOT)}")
    assert seen > 20
    assert not bad, "links in the docs that lead nowhere:\n" + "\n".join(bad)


def test_readme_docs_index_links_every_page():
    """A newcomer finds the pages from README.md's "Docs" section: docs/families.md was not there."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    index = readme.split("\n## Docs\n", 1)[1].split("\n## ", 1)[0]
    linked = {target for target, _anchor in LINK.findall(index)}
    missing = [f"docs/{p.name}" for p in sorted((ROOT / "docs").glob("*.md")) if f"docs/{p.name}" not in linked]
    assert not missing, f"README.md's Docs section does not link {missing}"


def test_design_md_names_every_error_type():
    """docs/design.md's "Errors" lists the hierarchy of common/errors.py: it left out MissingExtraError."""
    text = (ROOT / "docs" / "design.md").read_text(encoding="utf-8").split("\n## Errors\n", 1)[1]
    types = {name for name, obj in vars(errors).items()
             if isinstance(obj, type) and issubclass(obj, errors.EaglenestError) and obj is not errors.EaglenestError}
    named = set(re.findall(r"`(\w+)`", text))
    assert types and types <= named, f"docs/design.md, Errors: not named {sorted(types - named)}"


def test_readme_layout_is_the_package_map():
    """README.md's Layout table: every folder pyproject.toml installs, under the import name it gets."""
    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    rows = dict(re.findall(r"^\| `(\w+)/` \| `([\w.]+)` \|", readme, re.M))
    assert rows == {folder: name for name, folder in package_dir.items()}


# ---- docs/design.md's map of the feature store ----------------------------------------------------

def test_design_md_lists_each_featurestore_room_as_its_folder_holds_it():
    """Each room's line (``table/    names → objects → ...``) names every module of that folder, in the
    order tests/test_layering.py enforces where it orders the room."""
    text = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    rooms = dict(re.findall(r"^  (\w+)/ +([\w ,→]+?)(?:\s{2,}\(.*)?$", text, re.M))
    folders = sorted(p.name for p in (ROOT / "featurestore").iterdir() if (p / "__init__.py").is_file())
    assert sorted(rooms) == folders, "design.md names every room of featurestore/ and no other"
    wrong = []
    for room, listed in rooms.items():
        modules = re.findall(r"\w+", listed)
        held = sorted(p.stem for p in (ROOT / "featurestore" / room).glob("*.py") if p.stem != "__init__")
        if sorted(modules) != held:
            wrong.append(f"{room}/: design.md lists {modules}, the folder holds {held}")
        elif room in L.FS_MODULES and modules != L.FS_MODULES[room]:
            wrong.append(f"{room}/: design.md orders {modules}, test_layering.FS_MODULES {L.FS_MODULES[room]}")
    assert not wrong, "\n".join(wrong)


def test_formats_md_run_directory_names_every_folder_the_commands_write():
    """The folders of ``<workdir>`` the code names (``run.path("logs")``, ``args.out or "parity"``) are in
    docs/formats.md's "Run directory": logs/, serve/ and the evaluate commands' folders were not."""
    named = re.compile(r'(?:run\.path|\br\.path)\("(\w+)"|args\.out or "(\w+)"')
    written = {a or b for p in PROJECT for a, b in named.findall(p.read_text(encoding="utf-8"))}
    text = (ROOT / "docs" / "formats.md").read_text(encoding="utf-8")
    block = text.split("## Run directory", 1)[1].split("```", 2)[1]
    shown = set(re.findall(r"(?:<workdir>/|, )(\w+)/", block))
    assert {"eval", "logs", "parity"} <= written, "the extraction finds the folders the code writes"
    assert written <= shown, f"docs/formats.md's Run directory leaves out {sorted(written - shown)}"
