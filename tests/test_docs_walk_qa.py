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
* a link between pages (``[featurestore.md](featurestore.md#...)``) reaches a file and one of its
  headings: reliability.md linked ``#...-featurestoreleasepy``, a heading from before ``lease.py``
  moved into ``featurestore/table/``;
* README.md's Docs section links every page of docs/ (docs/families.md was missing), its Layout
  table is pyproject.toml's package map, and design.md's "Errors" names every error type
  (``MissingExtraError`` was missing);
* docs/design.md's map of featurestore's rooms names every module of each folder, in the order
  tests/test_layering.py holds them to.

The stated defaults and the tables of keys and columns: tests/test_docs_walk_tables.py.
No engine, no subprocess, no run folder: a few seconds.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from functools import cache
from pathlib import Path

import pytest

from eaglenest import errors
from eaglenest.errors import ConfigError
from eaglenest.recipe import SECTIONS, load_recipe

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


def _shell_sensitive_overrides():
    """(where, override, changed) of every override the shell could change: a value opening a bracket or
    a quote, or holding a ``$``. ``changed``: the shell would not pass it as shown: a value holding a
    blank inside brackets (two arguments) not in quotes, or a ``$`` (expanded by the shell: a
    ``${MY_SECRET}`` reference arrives as the secret itself, which the recipe refuses) not in single
    quotes."""
    for path in C.DOCS:
        for line, text, _lang in C._code(path):
            for m in OPEN_VALUE.finditer(text):
                quoted = m.start() > 0 and text[m.start() - 1] in "'\""
                changed = not quoted and unquoted_blank(text, m.start(2), m.group(2))
                yield C._where(path, line, text, m.start()), text[m.start():text.find("\n", m.start())], changed
            for m in C.OVERRIDE.finditer(text):
                if "$" in m.group(2):
                    changed = not (m.start() > 0 and text[m.start() - 1] == "'")
                    yield C._where(path, line, text, m.start()), m.group(0), changed


def test_overrides_the_shell_would_change_are_quoted():
    scanned = list(_shell_sensitive_overrides())
    # The scan must see the two quoted forms the pages show, or it checks nothing (a loop over no match).
    shown = " ".join(override for _where, override, _changed in scanned)
    assert "ingest.chat_template_kwargs={enable_thinking: true}" in shown, "README.md's quoted template kwargs"
    assert "run.storage_options.aws_secret_access_key=${MY_SECRET}" in shown, "docs/storage.md's quoted secret"
    bad = [f"{where}: {override.strip()[:100]}" for where, override, changed in scanned if changed]
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
