"""One direction of dependency between the stages (docs/design.md), read from the source.

Every ``import`` / ``from ... import`` of an ``eaglenest`` module, at any depth (imports inside
functions count), and every ``"eaglenest.<stage>..."`` string (``importlib`` targets, vLLM's
connector path, ``python -m`` targets) is an edge. A stage may use the shared plumbing
(``eaglenest.*`` outside the stage packages), itself and the stages before it: ``featurestore`` is
the lowest and uses no stage; ``pipeline`` sits above every stage; the shared plumbing uses no
stage, except the recipe naming each section's ``config`` module, and those config modules use no
later stage. Inside ``featurestore`` the rooms (sub-packages) and, inside a room, the modules have
an order of their own (:data:`FS_ROOMS`, :data:`FS_MODULES`), and no package has an import loop.
Imports of the project's modules and of the standard library sit at module top; only heavy
optional libraries (torch, vLLM, Lance, ...) may be imported inside a function.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: Package folder -> its place in the order (lower comes first). tinytarget builds test fixtures
#: and stands beside the stages; it may use only the shared plumbing.
ORDER = {"featurestore": 1, "ingest": 2, "train": 3, "serve": 4, "evaluate": 5, "pipeline": 6}
PACKAGES = {**{name: name for name in ORDER}, "tinytarget": "tinytarget", "common": None}
#: The long-context target's builder (tinytarget/long*.py) trains and measures on the evaluation's
#: own long material (pure generators, no engine): its only use of a stage, named here.
LONG_BUILDER = "tinytarget/long"
LONG_MATERIAL = [["eaglenest", "evaluate"]] + [["eaglenest", "evaluate", m]
                                               for m in ("longctx", "farctx", "buckets", "intervals")]
STRING_REF = re.compile(r"^eaglenest\.([a-z_]+)")


def _layer(module: str) -> str | None:
    """``eaglenest.train.loop`` -> ``train``; shared plumbing (``eaglenest.engine``) -> None."""
    parts = module.split(".")
    if parts[0] != "eaglenest" or len(parts) < 2:
        return None
    return parts[1] if parts[1] in PACKAGES and parts[1] != "common" else None


def edges(folder: str, root: Path = ROOT) -> list[tuple[str, str, str]]:
    """(file, line, referenced eaglenest module) for every reference in ``folder``'s sources."""
    out = []
    for path in sorted((root / folder).rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        rel = path.relative_to(root).as_posix()
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{rel}:{node.lineno}: relative import; use eaglenest.<...>"
                base = node.module or ""
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and STRING_REF.match(node.value):
                names = [node.value.split(":")[0]]
            out += [(rel, str(getattr(node, "lineno", "?")), n) for n in names if n.startswith("eaglenest.")]
    return out


def violations(folder: str, root: Path = ROOT) -> list[str]:
    own = PACKAGES[folder]
    bad = []
    for rel, line, module in edges(folder, root):
        used = _layer(module)
        if used is None or used == own:
            continue
        if folder == "common":
            # The recipe names each section's config dataclass; nothing else in the plumbing may.
            if not (rel == "common/recipe.py" and module.endswith(".config")):
                bad.append(f"{rel}:{line} -> {module}")
        elif folder == "tinytarget":
            if not (rel.startswith(LONG_BUILDER) and module.split(".")[:3] in LONG_MATERIAL):
                bad.append(f"{rel}:{line} -> {module}")
        elif ORDER.get(used, 99) < ORDER[folder]:
            continue
        else:
            bad.append(f"{rel}:{line} -> {module}")
    return bad


def test_scanner_sees_known_edges():
    """The scan is not vacuous: lazy imports inside functions and importlib strings are found."""
    found = {(rel.split("/")[0], _layer(m)) for f in ORDER for rel, _, m in edges(f)}
    assert ("evaluate", "serve") in found and ("serve", "train") in found and ("ingest", "featurestore") in found
    assert ("pipeline", "evaluate") in found and ("pipeline", "train") in found
    recipe = {m for rel, _, m in edges("common") if rel == "common/recipe.py"}
    assert "eaglenest.train.config" in recipe and "eaglenest.evaluate.config" in recipe


def test_each_stage_depends_only_on_earlier_stages():
    bad = [v for folder in ORDER for v in violations(folder)]
    assert not bad, "imports against the stage order:\n" + "\n".join(bad)


def test_shared_plumbing_and_fixture_builder_use_no_stage():
    bad = violations("common") + violations("tinytarget")
    assert not bad, "shared code importing a stage:\n" + "\n".join(bad)


def test_stage_configs_use_no_later_stage():
    """The recipe loads every section's config; a config module must not pull in a later stage."""
    bad = []
    for folder in ORDER:
        cfg = ROOT / folder / "config.py"
        if not cfg.is_file():
            continue
        for rel, line, module in edges(folder):
            used = _layer(module)
            if rel == f"{folder}/config.py" and used not in (None, folder) and ORDER[used] > ORDER[folder]:
                bad.append(f"{rel}:{line} -> {module}")
    assert not bad, "\n".join(bad)


def test_violation_is_reported(tmp_path):
    """A train module importing evaluate lazily is caught; featurestore and plumbing are allowed,
    and featurestore importing any stage (ingest included) is caught."""
    pkg = tmp_path / "train"
    pkg.mkdir()
    (pkg / "x.py").write_text("def f():\n    from eaglenest.evaluate.run import evaluate_al\n")
    (pkg / "y.py").write_text("from eaglenest.featurestore.table import store\nfrom eaglenest.errors import ConfigError\n"
                              "import eaglenest.train.model\n")
    assert violations("train", tmp_path) == ["train/x.py:2 -> eaglenest.evaluate.run",
                                             "train/x.py:2 -> eaglenest.evaluate.run.evaluate_al"]
    fs = tmp_path / "featurestore"
    fs.mkdir()
    (fs / "z.py").write_text("import eaglenest.ingest.build\nfrom eaglenest.featurestore import schema\n")
    assert violations("featurestore", tmp_path) == ["featurestore/z.py:1 -> eaglenest.ingest.build"]


# -- inside featurestore: rooms, and modules inside a room ------------------------------------------

#: Room (sub-package, or top-level module) -> the rooms it may use. A DAG: schema < table < read;
#: table < capture < stream; interop above table, read and capture; config, the command bodies and
#: the CLI on top (the CLI names its command bodies by module path, so ``--help`` loads none of them).
FS_ROOMS = {
    "schema": set(),
    "table": {"schema"},
    "read": {"schema", "table"},
    "capture": {"schema", "table"},
    "stream": {"schema", "table", "capture"},
    "interop": {"schema", "table", "read", "capture"},
    "config": {"table"},
    "commands": {"schema", "table", "read", "capture", "stream", "interop"},
    "cli": {"schema", "table", "read", "capture", "stream", "interop", "commands"},
}
#: Inside a room, bottom to top: a module may use only the modules before it. A module missing
#: from its room's list fails the test (place it).
FS_MODULES = {
    "table": ["names", "objects", "base", "lease", "integrity", "fragments", "versions", "maintenance", "store"],
    "read": ["profile", "window", "pread", "sample", "reader", "query"],
    "capture": ["turns", "identity", "policy", "writer", "publish", "connector", "engine", "build"],
    "stream": ["addr", "producer", "local", "hostcheck", "group", "xhost"],
}
PRODUCT = {folder: ("eaglenest" if folder == "common" else f"eaglenest.{folder}") for folder in PACKAGES}


def modules(root: Path = ROOT) -> dict[str, str]:
    """Dotted module name -> source path (relative to ``root``) of every product module."""
    out = {}
    for folder, prefix in PRODUCT.items():
        for path in (root / folder).rglob("*.py"):
            parts = path.relative_to(root / folder).with_suffix("").parts
            name = ".".join((prefix, *parts[:-1])) if parts[-1] == "__init__" else ".".join((prefix, *parts))
            out[name] = path.relative_to(root).as_posix()
    return out


def module_edges(folder: str, root: Path = ROOT) -> list[tuple[str, str, str, str]]:
    """(file, line, importing module, imported module) for every reference in ``folder``, each
    resolved to the longest product module it names (``pkg.mod.func`` -> ``pkg.mod``); a bare
    package (``from eaglenest.featurestore.table import store`` names ``...table`` too) is left out."""
    mods = modules(root)
    by_path = {path: name for name, path in mods.items()}
    plain = {name for name, path in mods.items() if not path.endswith("__init__.py")}
    out = []
    for rel, line, target in edges(folder, root):
        parts = target.split(".")
        hit = next((".".join(parts[:n]) for n in range(len(parts), 1, -1) if ".".join(parts[:n]) in plain), None)
        if hit is not None and hit != by_path[rel]:
            out.append((rel, line, by_path[rel], hit))
    return out


def _fs_place(module: str) -> tuple[str, str]:
    """``eaglenest.featurestore.table.base`` -> ("table", "base"); ``...schema`` -> ("schema", "")."""
    parts = module.split(".")[2:]
    return parts[0], ".".join(parts[1:])


def featurestore_violations(root: Path = ROOT) -> list[str]:
    bad = []
    for rel, line, src, dst in module_edges("featurestore", root):
        if not dst.startswith("eaglenest.featurestore."):
            continue
        (room, mod), (used_room, used_mod) = _fs_place(src), _fs_place(dst)
        if room not in FS_ROOMS:
            bad.append(f"{rel}: room '{room}' is not in FS_ROOMS (place it)")
        elif room != used_room:
            if used_room not in FS_ROOMS[room]:
                bad.append(f"{rel}:{line} -> {dst} (room {room} may not use {used_room})")
        elif room in FS_MODULES:
            order = FS_MODULES[room]
            if mod not in order or used_mod not in order:
                bad.append(f"{rel}: {room}/{mod if mod not in order else used_mod} is not in FS_MODULES['{room}']")
            elif order.index(used_mod) >= order.index(mod):
                bad.append(f"{rel}:{line} -> {dst} ({room}/{mod} may use only modules below it: "
                           f"{', '.join(order[:order.index(mod)]) or 'none'})")
    return sorted(set(bad))


def test_featurestore_rooms_and_modules_in_order():
    bad = featurestore_violations()
    assert not bad, "imports against featurestore's order:\n" + "\n".join(bad)


def test_featurestore_packages_say_what_they_own():
    """Every room is a package whose __init__ holds a docstring and imports nothing."""
    inits = sorted((ROOT / "featurestore").rglob("__init__.py"))
    rooms = {init.parent.relative_to(ROOT).as_posix() for init in inits}
    assert rooms >= {"featurestore", *(f"featurestore/{r}" for r in (*FS_MODULES, "interop"))}, rooms  # else: no check
    for init in inits:
        tree = ast.parse(init.read_text(encoding="utf-8"))
        assert ast.get_docstring(tree), f"{init.relative_to(ROOT)}: no docstring"
        assert not any(isinstance(n, (ast.Import, ast.ImportFrom)) for n in ast.walk(tree)), init


def test_featurestore_order_violation_is_reported(tmp_path):
    """A lower table module using the facade, and a room using a room above it, are caught, lazily too."""
    for rel, text in {"featurestore/__init__.py": "", "featurestore/schema.py": "",
                      "featurestore/table/__init__.py": "",
                      "featurestore/table/store.py": "from eaglenest.featurestore.table import base\n",
                      "featurestore/table/base.py": "from eaglenest.featurestore import schema as S\n",
                      "featurestore/table/lease.py": "def f():\n    from eaglenest.featurestore.table import store\n",
                      "featurestore/capture/__init__.py": "",
                      "featurestore/capture/engine.py": "C = 'eaglenest.featurestore.capture.connector'\n",
                      "featurestore/capture/connector.py": "",
                      "featurestore/table/fragments.py": "import eaglenest.featurestore.capture.engine\n"}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    for folder in PRODUCT:
        (tmp_path / folder).mkdir(exist_ok=True)
    assert featurestore_violations(tmp_path) == [
        "featurestore/table/fragments.py:1 -> eaglenest.featurestore.capture.engine (room table may not use capture)",
        "featurestore/table/lease.py:2 -> eaglenest.featurestore.table.store (table/lease may use only modules "
        "below it: names, objects, base)"]
    (tmp_path / "featurestore/capture/connector.py").write_text("from eaglenest.featurestore.capture.engine import C\n")
    assert "featurestore/capture/connector.py:1 -> eaglenest.featurestore.capture.engine (capture/connector may use " \
           "only modules below it: turns, identity, policy, writer, publish)" in featurestore_violations(tmp_path)


# -- no import loop in any package; project and standard-library imports at module top ------------

def import_cycles(root: Path = ROOT) -> list[list[str]]:
    """Strongly connected components (more than one module) of the product's import graph."""
    graph: dict[str, set[str]] = {}
    for folder in PRODUCT:
        for _, _, src, dst in module_edges(folder, root):
            graph.setdefault(src, set()).add(dst)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan; the graph is small, recursion is fine
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def test_no_import_loop():
    loops = import_cycles()
    assert not loops, "import loops (modules that reach each other):\n" + "\n".join(" <-> ".join(c) for c in loops)


def local_imports(folder: str, root: Path = ROOT) -> list[str]:
    """``file:line: module`` for every import of a project or standard-library module that is not at
    module top (inside a function, method or class body)."""
    out = []
    for path in sorted((root / folder).rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        top = {id(n) for stmt in tree.body if not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
               for n in ast.walk(stmt)}  # module level, ``if TYPE_CHECKING:`` / ``try:`` blocks included
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)) or id(node) in top:
                continue
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for name in names:
                root_name = name.split(".")[0]
                if root_name == "eaglenest" or root_name in sys.stdlib_module_names:
                    out.append(f"{path.relative_to(root).as_posix()}:{node.lineno}: {name}")
    return out


def test_project_and_stdlib_imports_at_module_top():
    """Function-local imports only for heavy optional libraries (torch, vllm, lance, dask, ...)."""
    bad = [v for folder in PRODUCT for v in local_imports(folder)]
    assert not bad, "imports to move to module top:\n" + "\n".join(bad)


def test_loop_and_local_import_are_reported(tmp_path):
    for folder in PRODUCT:
        (tmp_path / folder).mkdir()
    (tmp_path / "train" / "a.py").write_text("import json\nimport eaglenest.train.b\n\n\ndef f():\n"
                                             "    import os\n    import torch\n    from eaglenest.errors import X\n")
    (tmp_path / "train" / "b.py").write_text("try:\n    import yaml\nexcept ImportError:\n    yaml = None\n\n\n"
                                             "class C:\n    def m(self):\n        from eaglenest.train import a\n")
    assert local_imports("train", tmp_path) == ["train/a.py:6: os", "train/a.py:8: eaglenest.errors",
                                                "train/b.py:9: eaglenest.train"]
    assert import_cycles(tmp_path) == [["eaglenest.train.a", "eaglenest.train.b"]]

