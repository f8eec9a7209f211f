"""What a second newcomer's walk of the remaining pages checks (docs/manifest.md, docs/ingest.md and
bench/README.md), beside tests/test_docs_consistent.py and tests/test_docs_walk_qa.py:

* every YAML snippet of docs/manifest.md loads as a manifest, not only the first: the composition
  rules' domain snippets (``long_chat``, ``long_docs``) are put under ``domains:`` of a one-domain
  manifest, ``sources: [...]`` (a placeholder) given a real source file;
* the one-line refusal docs/manifest.md quotes for a composed length is the code's, word for word;
* the ranges the manifest example's comments state (``0 to 2``, ``8..1024``, ``0 to 2**63 - 1``)
  are the validator's: each edge loads, one step past it is one problem naming the key;
* the ``stats.<key>`` names docs/ingest.md and docs/manifest.md tell a reader to look for are keys the
  ingest stage writes;
* bench/README.md's table lists every bench script, and a row's thresholds say ``--check`` exactly
  when that script has a ``--check`` (the header promised "--check exits 1 if missed" for rows whose
  scripts had none, and featurestore_write.py's row left out its third threshold).

No engine, no subprocess, no run folder: about a second.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
import textwrap
from pathlib import Path

import pytest

from eaglenest.config import parse_yaml
from eaglenest.ingest.manifest import ManifestProblems, load_manifest

ROOT = Path(__file__).resolve().parent.parent
MANIFEST_MD = ROOT / "docs" / "manifest.md"
BENCH = ROOT / "bench"

sys.path.insert(0, str(Path(__file__).parent))
import test_docs_consistent as C  # noqa: E402  (its extraction of code blocks)


# ---- docs/manifest.md's snippets load --------------------------------------------------------------

def _yaml_blocks(path: Path) -> list[tuple[int, str]]:
    return [(line, text) for line, text, lang in C._code(path) if lang == "yaml"]


@pytest.fixture
def source_dir(tmp_path) -> Path:
    rows = [{"prompt": f"What is {i} plus {i + 1}?"} for i in range(40)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


SOURCE = {"path": "prompts.jsonl", "field": "prompt", "provenance": "made by the test"}


def as_manifest(domain_snippet: str) -> dict:
    """A one-domain manifest holding a doc's domain snippet (``  name:`` and its keys), its ``[...]``
    placeholder sources replaced by a real one."""
    domains = parse_yaml(textwrap.dedent(domain_snippet).replace("sources: [...]", "sources: []"))
    for domain in domains.values():
        if domain.get("compose", {}).get("rule") != "documents":
            domain["sources"] = [SOURCE]
    return {"name": "walk", "licence": "CC0-1.0", "domains": domains}


def load(data: dict, folder: Path) -> list[str]:
    """The problems ``load_manifest`` finds in ``data`` (written to ``folder``), [] when it loads."""
    path = folder / "manifest.yaml"
    path.write_text(json.dumps(data))  # JSON is YAML
    try:
        load_manifest(path, base_dir=folder)
    except ManifestProblems as exc:
        return exc.problems
    return []


def test_every_manifest_snippet_loads(source_dir):
    blocks = _yaml_blocks(MANIFEST_MD)
    assert len(blocks) >= 3, "the example and the two composition rules"
    domain_snippets = [(line, text) for line, text in blocks[1:] if "domains:" not in text]
    assert {next(iter(parse_yaml(textwrap.dedent(t).replace("[...]", "[]")))) for _, t in domain_snippets} \
        >= {"long_chat", "long_docs"}
    bad = [f"docs/manifest.md:{line}: {problems}" for line, text in domain_snippets
           if (problems := load(as_manifest(text), source_dir))]
    assert not bad, "\n".join(bad)


def test_as_manifest_sees_a_bad_snippet(source_dir):
    snippet = "  long_chat:\n    cap_prompts: 4\n    compose: {rule: long_chat, target_tokens: [2048]}\n"
    problems = load(as_manifest(snippet), source_dir)
    assert problems and problems[0].startswith("domains.long_chat.held_out_count: ")


def test_the_refusal_the_doc_quotes_is_the_codes(source_dir):
    text = MANIFEST_MD.read_text(encoding="utf-8")
    quoted = re.search(r"`(domains\.long_chat\.compose\.target_tokens\[0\]: (\d+) is not in [^`]+)`", text)
    assert quoted, "docs/manifest.md quotes the line a bad composed length gets"
    line, value = quoted.group(1), int(quoted.group(2))
    snippet = next(t for _l, t in _yaml_blocks(MANIFEST_MD) if t.lstrip().startswith("long_chat:"))
    data = as_manifest(snippet)
    data["domains"]["long_chat"]["compose"]["target_tokens"] = [value]
    assert load(data, source_dir) == [line]


# ---- ranges in the example's comments ----------------------------------------------------------

def _example_comment(key: str) -> str:
    example = _yaml_blocks(MANIFEST_MD)[0][1]
    return next(line.split("#", 1)[1] for line in example.splitlines() if line.strip().startswith(f"{key}:"))


#: (section, key, the range as the comment writes it, (low, high) it means, a step past each edge).
RANGES = [("generation", "temperature", "0 to 2", (0.0, 2.0), 0.1),
          ("generation", "seed", "0 to 2**63 - 1", (0, 2**63 - 1), 1),
          ("dedup", "num_perm", "(8..1024)", (8, 1024), 1)]


@pytest.mark.parametrize("section, key, shown, edges, step", RANGES, ids=[f"{s}.{k}" for s, k, *_ in RANGES])
def test_ranges_the_example_states_are_the_validators(source_dir, section, key, shown, edges, step):
    assert shown in _example_comment(key), f"docs/manifest.md no longer writes {key}'s range as {shown!r}"
    base = as_manifest("  plain:\n    cap_prompts: 4\n")
    low, high = edges
    for value in (low, high):
        assert load({**base, section: {key: value}}, source_dir) == [], f"{section}.{key}: {value} refused"
    for value in (low - step, high + step):
        problems = load({**base, section: {key: value}}, source_dir)
        assert len(problems) == 1 and problems[0].startswith(f"{section}.{key}: "), (value, problems)


# ---- stats keys ----------------------------------------------------------------------------------

def test_stats_keys_the_ingest_docs_name_are_written():
    text = "".join((ROOT / "docs" / f"{page}.md").read_text(encoding="utf-8") for page in ("ingest", "manifest"))
    named = set(re.findall(r"`stats\.(?!json`)([a-z_]+(?:\.[a-z_]+)*)`", text))  # stats.json: the file
    named |= {f"pool.domains.{k}" for k in re.findall(r"`(rows|empty|exact_duplicates|near_duplicates|kept)`", text)}
    assert {"prompt_too_long", "thinking_truncated", "split_changed"} <= named
    code = "".join(p.read_text(encoding="utf-8") for p in (ROOT / "ingest").glob("*.py"))
    missing = [key for key in sorted(named) for part in key.split(".")
               if part not in ("pool", "domains") and not re.search(rf"[\"']{part}[\"']", code)]
    assert not missing, f"stats keys the docs name that no ingest module writes: {missing}"


# ---- bench/README.md -------------------------------------------------------------------------------

def _readme_rows() -> dict[str, list[str]]:
    rows = {}
    for line in (BENCH / "README.md").read_text(encoding="utf-8").splitlines():
        m = re.match(r"\| `([\w.]+\.py)`", line)
        if m:
            rows[m.group(1)] = [c.strip() for c in line.strip().strip("|").split("|")]
    return rows


def _help(name: str, monkeypatch, capsys) -> str:
    spec = importlib.util.spec_from_file_location(f"_walk_{name[:-3]}", BENCH / name)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(sys, "argv", [name, "--help"])
    with pytest.raises(SystemExit):
        mod.main()
    return capsys.readouterr().out


def test_bench_readme_lists_every_script():
    scripts = {p.name for p in BENCH.glob("*.py")} - {"arms.py", "ingest_common.py"}  # helpers, named in prose
    assert set(_readme_rows()) == scripts


CHECKERS = ["featurestore_write.py", "featurestore_read.py", "featurestore_blob_layout.py",
            "featurestore_query_memory.py", "ingest_regen.py", "ingest_capture.py", "train_throughput.py"]


@pytest.mark.parametrize("name", CHECKERS)
def test_bench_readme_says_check_where_the_script_has_one(name, monkeypatch, capsys):
    """The rows that state a threshold: ``--check`` in the cell exactly when the script takes it."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    thresholds = _readme_rows()[name][2]
    has_check = re.search(r"^\s+--check\b", _help(name, monkeypatch, capsys), re.M) is not None
    assert ("`--check`" in thresholds and "no `--check`" not in thresholds) == has_check, (name, thresholds)


def test_featurestore_write_row_names_every_threshold_its_check_applies():
    doc = (BENCH / "featurestore_write.py").read_text(encoding="utf-8")
    assert "the size ratio exceeds 1.05" in doc
    assert "1.05" in _readme_rows()["featurestore_write.py"][2]


# ---- options of bench scripts and ``python -m`` modules the pages run ------------------------------

#: ``bench/<script>.py ...`` / ``python -m eaglenest.<module> ...`` and its arguments, up to a comment or
#: a shell operator. tests/test_docs_consistent.py checks only that such a module exists, and
#: tests/bench/test_bench_scripts.py only bench/README.md's and the scripts' own command lines.
RUN = re.compile(r"(?:bench/(\w+\.py)|python -m (eaglenest(?:\.\w+)+))((?:[^\n#|;&`])*)")
PAGES = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]


def _runs():
    for path in PAGES:
        for line, text, _lang in C._code(path):
            for m in RUN.finditer(text):
                script, module, rest = m.groups()
                if options := set(C.OPTION.findall(rest)):
                    yield f"{path.relative_to(ROOT)}:{line}", script, module, options


def _module_help(module: str, monkeypatch, capsys) -> str:
    import runpy

    monkeypatch.setattr(sys, "argv", [module, "--help"])
    with pytest.raises(SystemExit):
        runpy.run_module(module, run_name="__main__", alter_sys=False)
    return capsys.readouterr().out


def test_options_of_the_scripts_and_modules_the_docs_run_exist(monkeypatch, capsys):
    monkeypatch.setattr(sys, "path", list(sys.path))  # families.py puts bench/ first
    runs = list(_runs())
    assert {s for _w, s, _m, _o in runs} >= {"families.py", "train_long.py", "featurestore_read.py"}
    assert {m for _w, _s, m, _o in runs} >= {"eaglenest.tinytarget.long", "eaglenest.tinytarget.engine_check"}
    helps: dict[str, str] = {}
    bad = []
    for where, script, module, options in runs:
        key = script or module
        if key not in helps:
            helps[key] = _help(script, monkeypatch, capsys) if script else _module_help(module, monkeypatch, capsys)
        assert helps[key].startswith("usage:"), key
        bad += [f"{where}: {key} {option}: not an option of it" for option in sorted(options)
                if not re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", helps[key])]
    assert not bad, "\n".join(bad)


# ---- docs/tiny-target.md against the committed fixture ----------------------------------------------

def _shape_table() -> dict[str, str]:
    text = (ROOT / "docs" / "tiny-target.md").read_text(encoding="utf-8")
    body = text.split("## Shape", 1)[1].split("\n#", 1)[0]
    rows = [line.strip().strip("|").split("|") for line in body.splitlines() if line.startswith("| ")]
    return {cells[0].strip(): cells[1].strip() for cells in rows[1:]}


def test_tiny_target_shape_table_is_the_committed_config():
    config = json.loads((ROOT / "assets" / "tiny-target" / "config.json").read_text())
    table = _shape_table()
    numbers = {key: [int(n) for n in re.findall(r"\b\d+\b", value.split("(")[0].split(";")[0])]
               for key, value in table.items()}
    assert config["architectures"] == [re.search(r"`(\w+)`", table["architecture"]).group(1)]
    assert numbers["layers"] == [config["num_hidden_layers"]]
    assert numbers["hidden / intermediate"] == [config["hidden_size"], config["intermediate_size"]]
    assert numbers["heads / kv heads / head dim"] == [config["num_attention_heads"], config["num_key_value_heads"],
                                                      config["head_dim"]]
    assert numbers["vocab"] == [config["vocab_size"]]
    assert numbers["max positions"] == [config["max_position_embeddings"]]
    assert table["dtype"].startswith(config["torch_dtype"])
    assert ("untied" in table["dtype"]) == (config.get("tie_word_embeddings") is False)


def test_tiny_target_prompt_files_hold_what_the_page_says():
    text = (ROOT / "docs" / "tiny-target.md").read_text(encoding="utf-8")
    per_domain = int(re.search(r"hold (\d+) prompts per domain", text).group(1))
    dialogues = int(re.search(r"holds (\d+) multi-turn conversations", text).group(1))
    domains = re.findall(r"^\| `(\w+)` \|", text.split("## Domains", 1)[1].split("\n#", 1)[0], re.M)
    assert len(domains) == 4
    data = ROOT / "recipes" / "data"
    for domain in domains:
        assert len((data / f"{domain}.jsonl").read_text().splitlines()) == per_domain, domain
    assert len((data / "dialogue.jsonl").read_text().splitlines()) == dialogues


# ---- values the Python snippets show in comments -------------------------------------------------------

#: ``name.attr  # <a Python literal>``: a snippet line showing what a name holds.
SHOWN = re.compile(r"^([A-Za-z_][\w.]*)\s+#\s*(\(.*\)|\[.*\]|\{.*\}|'[^']*'|\"[^\"]*\"|-?\d[\d_.]*)\s*$")


def _shown_values():
    for path in sorted((ROOT / "docs").glob("*.md")):
        for line, text, lang in C._code(path):
            if lang != "python":
                continue
            imports = "\n".join(x for x in text.splitlines() if x.startswith(("import ", "from ")))
            for n, row in enumerate(text.splitlines()):
                if m := SHOWN.match(row.strip()):
                    yield f"{path.relative_to(ROOT)}:{line + n}", imports, m.group(1), m.group(2)


def test_values_python_snippets_show_are_the_codes():
    import ast

    shown = list(_shown_values())
    assert any(name == "archs.ARCHS" for _w, _i, name, _v in shown), "docs/targets.md shows archs.ARCHS"
    bad = []
    for where, imports, name, value in shown:
        namespace: dict = {}
        exec(imports, namespace)  # the snippet's own imports (eaglenest modules)
        if eval(name, namespace) != ast.literal_eval(value):
            bad.append(f"{where}: {name} is {eval(name, namespace)!r}, the doc shows {value}")
    assert not bad, "\n".join(bad)
