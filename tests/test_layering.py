"""One direction of dependency between the stages (docs/design.md), read from the source.

Every ``import`` / ``from ... import`` of an ``eaglenest`` module, at any depth (lazy imports inside
functions count), and every ``"eaglenest.<stage>..."`` string (``importlib`` targets) is an edge.
A stage may use the shared plumbing (``eaglenest.*`` outside the stage packages), itself,
``featurestore`` and the stages before it; ``pipeline`` sits above every stage; the shared plumbing
uses no stage, except the recipe naming each section's ``config`` module, and those config modules
use no later stage.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: Package folder -> its place in the order (lower comes first). tinytarget builds test fixtures
#: and stands beside the stages; it may use only the shared plumbing.
ORDER = {"ingest": 1, "featurestore": 2, "train": 3, "serve": 4, "evaluate": 5, "pipeline": 6}
PACKAGES = {**{name: name for name in ORDER}, "tinytarget": "tinytarget", "common": None}
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
            bad.append(f"{rel}:{line} -> {module}")
        elif used == "featurestore" or ORDER.get(used, 99) < ORDER[folder]:
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


def test_each_stage_depends_only_on_earlier_stages_and_featurestore():
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
            if rel == f"{folder}/config.py" and used not in (None, folder, "featurestore") \
                    and ORDER[used] > ORDER[folder]:
                bad.append(f"{rel}:{line} -> {module}")
    assert not bad, "\n".join(bad)


def test_violation_is_reported(tmp_path):
    """A train module importing evaluate lazily is caught; featurestore and plumbing are allowed."""
    pkg = tmp_path / "train"
    pkg.mkdir()
    (pkg / "x.py").write_text("def f():\n    from eaglenest.evaluate.run import evaluate_al\n")
    (pkg / "y.py").write_text("from eaglenest.featurestore import store\nfrom eaglenest.errors import ConfigError\n"
                              "import eaglenest.train.model\n")
    assert violations("train", tmp_path) == ["train/x.py:2 -> eaglenest.evaluate.run",
                                             "train/x.py:2 -> eaglenest.evaluate.run.evaluate_al"]
