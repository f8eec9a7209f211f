"""The docs a newcomer copies from (README.md, docs/*.md) and the recipes agree with the code.

Read from the text, checked with the project's own code (no copy of the schema or of a parser):

* every dotted override ``section.key=value`` in a code span or fenced block resolves in the recipe
  schema: applied to recipes/toy.yaml with :func:`eaglenest.recipe.load_recipe`, exactly as a stage
  CLI applies it, it is not refused as an unknown key, a renamed key or an unknown section (a value
  the schema rejects is fine here: docs write placeholders such as ``=N``). Left out, and only
  these: an all-capitals segment (``evaluate.KEY=VALUE`` is a placeholder for any key), and a key
  right after ``=`` (``EAGLENEST_FAULT_DELAY=featurestore.commit_after_check=1.0`` names a fault
  point, not a recipe key). The old flat keys a doc shows as refused (``train.stream_depth:
  renamed to train.stream.depth``, never written with ``=``) are checked the other way round: each
  is refused with exactly the line the doc quotes;
* every ``section.key`` named without a value (``serve.host``, ``train.stream.depth``) resolves the
  same way, save file names, module paths (``evaluate.buckets``) and :data:`NOT_KEYS`;
* every recipe snippet (a fenced ``yaml`` block whose top-level keys are recipe sections) loads as
  a recipe, and the manifest example of docs/manifest.md loads as a manifest, save the
  contamination files it says are the user's own copy;
* every stage command shown (``ingest build ...``, ``featurestore versions | tags ...``) names a
  subcommand of that console script (pyproject.toml) and only options its ``--help`` lists; every
  ``make X`` is a Makefile target; every ``python -m eaglenest.X`` module exists;
* every repository file a doc or a recipe's comment names (``tests/...py``, ``recipes/...yaml``,
  ``docs/...md``) exists, so does every test a doc names (``test_x.py::test_name``,
  ``::test_name``), and every section it cites (``docs/ingest.md, "Long conversations"``) is a
  heading of that page;
* every recipes/*.yaml loads, and so do the manifest it names and every recipes/manifests/*.yaml.

No engine, no subprocess: the ``--help`` texts come from the CLIs' own ``main`` in this process.
About two seconds of test time on a loaded 2-core machine.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import re
import textwrap
import tomllib
from functools import cache
from pathlib import Path

import pytest

from eaglenest.config import parse_yaml
from eaglenest.errors import EaglenestError
from eaglenest.ingest.manifest import ManifestProblems, load_manifest
from eaglenest.recipe import SECTIONS, load_recipe

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
MANIFESTS = sorted((ROOT / "recipes" / "manifests").glob("*.yaml"))
BASE_RECIPE = ROOT / "recipes" / "toy.yaml"

STAGE = "|".join(SECTIONS)
#: Code spans (which may wrap onto the next line, as Markdown's do) and fenced blocks (matched
#: first, so their backticks are not read as spans).
CODE = re.compile(r"```(?P<lang>[\w-]*)\n(?P<block>.*?)```|`(?P<span>(?:[^`\n]|\n(?![ \t]*\n))+)`", re.S)
#: ``section.key=value`` / ``section.sub.key=value``, not inside a longer word, path or assignment.
OVERRIDE = re.compile(rf"(?<![\w./$=-])((?:{STAGE})(?:\.[A-Za-z_]\w*)+)=([^\s`]*)")
#: ``section.key`` named without a value (``serve.host``, ``train.stream.*``).
MENTION = re.compile(rf"(?<![\w./$=<>-])((?:{STAGE})(?:\.[A-Za-z_]\w*)+)(?![\w=(-])")
#: What :func:`eaglenest.config.build` / :func:`load_recipe` say of a key that does not resolve.
UNRESOLVED = re.compile(r"^\S+: (unknown key|renamed to \S+|unknown recipe section)|: \S+ is not a section$")
#: An old key the docs show refused, as the one-line message they quote.
REFUSED = re.compile(rf"`((?:{STAGE})\.\w+): renamed to ((?:{STAGE})(?:\.\w+)+)")
#: A stage command: ``<script> <subcommand>`` (``| other | ...`` alternatives), then its arguments
#: up to a comment or a shell pipe (``a|b``, no blanks, is a list of choices and stays in).
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
COMMAND = re.compile(rf"(?:^|(?<=[\s`$(;&]))({'|'.join(s for s in SCRIPTS if s in SECTIONS)})"
                     r"[ \t]+([a-z][\w-]*)((?:[ \t]*\|[ \t]*[a-z][\w-]*(?![\w-]*[=/.]))*)"
                     r"((?:[^\n#|;&]|(?<=\S)\|(?=\S))*)")
OPTION = re.compile(r"(?<![\w-])(--[a-z][\w-]*|-[a-z])(?![\w-])")
MAKE = re.compile(r"(?<![\w-])make[ \t]+([a-z][\w-]*)")
PY_MODULE = re.compile(r"python[ \t]+-m[ \t]+(eaglenest(?:\.\w+)+)")
#: A repository file: under a top-level folder of the repo, with a file suffix (outputs such as
#: ``<workdir>/ingest/stats.json`` start with ``/`` or ``>`` and are not matched).
REPO_FILE = re.compile(r"(?<![\w./<>~$-])((?:ingest|featurestore|train|serve|evaluate|common|tinytarget|pipeline"
                       r"|tests|bench|recipes|docs|assets)/[\w./-]*\.(?:py|md|yaml|sh|jsonl|json|toml))")
#: A section of a page a doc cites: ``docs/ingest.md, "Long conversations"``, ``BENCHMARKS.md "FP8 draft"``.
SECTION_REF = re.compile(r'([\w-]+\.md)[,)]?\s*(?:#\s*)?"([^"\n]+)"')
#: A test a doc names: ``[tests/.../]test_x.py::test_name``, or ``::test_name`` after such a file.
TEST_REF = re.compile(r"(?<![\w./-])((?:tests/(?:\w+/)*)?test_\w+\.py)?::(test_\w+)")


def _code(path: Path):
    """(line, text, lang) of every code span and fenced block of ``path``; in a block, a line ending
    in a backslash is joined to the next (the shell's continuation), so a command is one line."""
    text = path.read_text(encoding="utf-8")
    for m in CODE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        if m.group("span") is not None:
            yield line, m.group("span").replace("\n", " "), None
        else:
            yield line + 1, re.sub(r"\\\n", " ", m.group("block")), m.group("lang")


def _where(path: Path, line: int, text: str, pos: int) -> str:
    return f"{path.relative_to(ROOT)}:{line + text.count(chr(10), 0, pos)}"


def _overrides():
    for path in DOCS:
        for line, text, _lang in _code(path):
            for m in OVERRIDE.finditer(text):
                key, value = m.groups()
                if any(part.isupper() for part in key.split(".")):
                    continue  # evaluate.KEY=VALUE: a placeholder for any key
                yield _where(path, line, text, m.start()), key, value


def test_the_docs_show_overrides():
    """The extraction finds what it is meant to (else every check below would pass on nothing)."""
    keys = {key for _where_, key, _value in _overrides()}
    assert {"train.num_epochs", "train.state.every_steps", "run.workdir", "featurestore.table"} <= keys


def unresolved(override: str) -> str | None:
    """The refusal line if ``override`` names a key the recipe schema does not have, else None."""
    try:
        load_recipe(BASE_RECIPE, [override])
    except EaglenestError as exc:
        msg = str(exc)
        # ``train.lr.x=1`` makes ``train.lr`` a mapping: refused as a type error of a key above it.
        parts = override.split("=", 1)[0].split(".")
        above = [".".join(parts[:i]) for i in range(1, len(parts))]
        if UNRESOLVED.search(msg) or any(msg.startswith(f"{key}: expected ") for key in above):
            return msg
    return None


def test_unresolved_tells_a_wrong_key_from_a_wrong_value():
    assert unresolved("train.num_epochs=3") is None
    assert unresolved("train.num_epochs=N") is None  # a placeholder value: the key resolves
    assert unresolved("train.num_epoch=3") == "train.num_epoch: unknown key; did you mean train.num_epochs?"
    assert unresolved("train.stream.dept=3") == "train.stream.dept: unknown key; did you mean train.stream.depth?"
    assert unresolved("train.stream_depth=3") == "train.stream_depth: renamed to train.stream.depth"
    assert unresolved("train.zzz=3") == "train.zzz: unknown key"  # nothing close: no guess
    assert unresolved("trainer.lr=1") is not None
    assert unresolved("train.lr.x=1") is not None


def test_every_override_in_the_docs_resolves():
    bad = [f"{where}: `{key}={value}`: {msg}" for where, key, value in _overrides()
           if (msg := unresolved(f"{key}={value}"))]
    assert not bad, "override keys in the docs that the recipe refuses:\n" + "\n".join(bad)


#: Keys in code spans the code prints but the schema does not have, each with why it stays.
NOT_KEYS: dict[str, str] = {"train.workdir": "design.md's example of a key under the wrong section (refused)"}


def _mentions():
    """(where, key) of every dotted ``section.key`` in a code span or block without ``=`` after it
    (``train.stream.*``, ``serve.host``), left out: file names (``featurestore.md``), module paths
    (``evaluate.buckets``, ``train.data.FeatureShards``: a module of that stage's folder), the old
    keys a doc shows refused (checked below) and :data:`NOT_KEYS`."""
    refused = {old for path in DOCS for old, _new in REFUSED.findall(path.read_text(encoding="utf-8"))}
    for path in DOCS:
        for line, text, _lang in _code(path):
            for m in MENTION.finditer(text):
                key = m.group(1)
                stage, first = key.split(".")[:2]
                module = (ROOT / stage / f"{first}.py").is_file() or (ROOT / stage / first).is_dir()
                if (module or key.endswith((".md", ".py", ".yaml")) or key in refused or key in NOT_KEYS
                        or first.isupper()):
                    continue
                yield _where(path, line, text, m.start()), key


def test_every_key_the_docs_name_resolves():
    keys = list(_mentions())
    assert len(keys) > 50
    bad = [f"{where}: `{key}`: {msg}" for where, key in keys if (msg := unresolved(f"{key}=null"))]
    assert not bad, "keys named in the docs that the recipe does not have:\n" + "\n".join(bad)
    docs = "".join(path.read_text(encoding="utf-8") for path in DOCS)
    assert not [key for key in NOT_KEYS if key not in docs], "NOT_KEYS names a key no doc shows any more"


def test_old_keys_the_docs_show_refused_are_refused_so():
    shown = {(old, new) for path in DOCS for old, new in REFUSED.findall(path.read_text(encoding="utf-8"))}
    assert shown, "README.md and docs/training.md show how a renamed key is refused"
    wrong = [f"{old}: docs say 'renamed to {new}', code says {unresolved(f'{old}=1')!r}" for old, new in shown
             if unresolved(f"{old}=1") != f"{old}: renamed to {new}"]
    assert not wrong, "\n".join(wrong)


def _snippets():
    """(where, mapping) of every fenced yaml block whose top-level keys are all recipe sections."""
    for path in DOCS:
        for line, text, lang in _code(path):
            if lang != "yaml":
                continue
            data = parse_yaml(textwrap.dedent(text))
            if isinstance(data, dict) and data and set(data) <= set(SECTIONS):
                yield f"{path.relative_to(ROOT)}:{line}", text


def test_recipe_snippets_in_the_docs_load(tmp_path):
    snippets = list(_snippets())
    assert len(snippets) >= 3  # docs/training.md, docs/trackers.md, docs/storage.md
    for i, (where, text) in enumerate(snippets):
        path = tmp_path / f"snippet{i}.yaml"
        path.write_text(textwrap.dedent(text))
        try:
            load_recipe(path)
        except EaglenestError as exc:
            pytest.fail(f"{where}: the recipe snippet does not load: {exc}")


def test_the_manifest_example_loads(tmp_path):
    example = next(t for _line, t, lang in _code(ROOT / "docs" / "manifest.md") if lang == "yaml")
    assert "domains:" in example
    path = tmp_path / "manifest.yaml"
    path.write_text(example)
    try:
        load_manifest(path, base_dir=ROOT)
        problems = []
    except ManifestProblems as exc:
        problems = exc.problems
    # The example's contamination files are "your copy of MT-Bench": not in the repo, by design.
    problems = [p for p in problems if not re.match(r"contamination\.\w+\[\d+\]: file not found", p)]
    assert not problems, "docs/manifest.md's example manifest:\n" + "\n".join(problems)


@cache
def _help(script: str, sub: str) -> str | None:
    """``<script> <sub> --help`` from the console script's own ``main``, in this process; None when
    ``sub`` is not one of its subcommands."""
    module, func = SCRIPTS[script].split(":")
    main = getattr(importlib.import_module(module), func)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit_:
        main([sub, "--help"])
    return out.getvalue() if exit_.value.code == 0 else None


def _commands():
    for path in DOCS:
        for line, text, _lang in _code(path):
            for m in COMMAND.finditer(text):
                script, sub, alternatives, rest = m.groups()
                subs = [sub, *re.findall(r"[a-z][\w-]*", alternatives)]
                yield _where(path, line, text, m.start()), script, subs, rest


def test_every_stage_command_in_the_docs_exists_with_its_options():
    seen, bad = 0, []
    for where, script, subs, rest in _commands():
        for sub in subs:
            seen += 1
            text = _help(script, sub)
            if text is None:
                bad.append(f"{where}: `{script} {sub}`: no such subcommand")
                continue
            for option in OPTION.findall(rest if sub == subs[-1] else ""):
                if not re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", text):
                    bad.append(f"{where}: `{script} {sub} ... {option}`: not an option of `{script} {sub}`")
    assert seen > 100  # the README and every stage page show commands
    assert not bad, "\n".join(bad)


def test_make_targets_and_modules_in_the_docs_exist():
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    bad, makes, modules = [], [], []
    for path in DOCS:
        for line, text, _lang in _code(path):
            makes += [(_where(path, line, text, m.start()), m.group(1)) for m in MAKE.finditer(text)]
            modules += [(_where(path, line, text, m.start()), m.group(1)) for m in PY_MODULE.finditer(text)]
    # The README and the pages run both (else the checks below would pass on nothing).
    assert len(makes) > 10 and len(modules) > 5, (makes, modules)
    bad += [f"{where}: `make {name}`: no such Makefile target" for where, name in makes if name not in targets]
    bad += [f"{where}: `python -m {name}`: no such module" for where, name in modules
            if importlib.util.find_spec(name) is None]
    assert not bad, "\n".join(bad)


def test_repository_files_named_by_the_docs_exist():
    bad, seen = [], 0
    for path in [*DOCS, *RECIPES]:
        text = path.read_text(encoding="utf-8")
        for m in REPO_FILE.finditer(text):
            seen += 1
            name = m.group(1)
            where = f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}"
            if not (ROOT / name).is_file():
                bad.append(f"{where}: {name}: no such file in the repository")
    assert seen > 50
    assert not bad, "\n".join(bad)


def test_tests_named_by_the_docs_exist():
    """``tests/x/test_y.py::test_z``, ``test_y.py::test_z`` (a file under tests/) and ``::test_z``
    (the file named last before it in the same doc)."""
    bad, seen = [], 0
    for path in DOCS:
        text, file = path.read_text(encoding="utf-8"), None
        for m in TEST_REF.finditer(text):
            name, test = m.groups()
            where = f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}"
            if name:
                found = [ROOT / name] if "/" in name else sorted((ROOT / "tests").rglob(name))
                file = found[0] if len(found) == 1 and found[0].is_file() else None
                if file is None:
                    bad.append(f"{where}: {name}: no such test file (or more than one)")
                    continue
            if file is None:
                bad.append(f"{where}: ::{test}: no test file named before it")
                continue
            seen += 1
            if not re.search(rf"^\s*(?:async )?def {test}\b", file.read_text(encoding="utf-8"), re.M):
                bad.append(f"{where}: {file.relative_to(ROOT)}::{test}: no such test")
    assert seen > 20
    assert not bad, "\n".join(bad)


def test_sections_the_docs_cite_exist():
    """``docs/x.md, "Heading"`` / ``BENCHMARKS.md "Heading"``: a heading of that page contains it."""
    pages = {p.name: p for p in [ROOT / "README.md", ROOT / "BENCHMARKS.md", *(ROOT / "docs").glob("*.md")]}
    bad, seen = [], 0
    for path in [*DOCS, *RECIPES]:
        text = path.read_text(encoding="utf-8")
        for m in SECTION_REF.finditer(text):
            page, section = m.groups()
            if page not in pages:
                continue
            seen += 1
            headings = [h.lstrip("#").strip().lower() for h in pages[page].read_text(encoding="utf-8").splitlines()
                        if h.startswith("#")]
            if not any(section.strip().lower() in h for h in headings):
                bad.append(f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}: {page} has no "
                           f"heading {section!r}")
    assert seen > 20
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_every_recipe_loads_with_its_manifest(recipe):
    loaded = load_recipe(recipe)
    load_manifest(ROOT / loaded.ingest.manifest, base_dir=ROOT)


@pytest.mark.parametrize("manifest", MANIFESTS, ids=lambda p: p.name)
def test_every_manifest_loads(manifest):
    load_manifest(manifest, base_dir=ROOT)
