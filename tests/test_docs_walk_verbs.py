"""What walking README.md and docs/featurestore.md with bad input found in the store's verbs: each is one
line, exit 2, and nothing written.

* `featurestore tags --create A --delete B` with no tag B created A and then failed;
* `featurestore query --attach ev=a.csv --attach ev=b.csv` silently read only b.csv;
* `featurestore query --out` inside the store wrote the result into a Lance table's folder.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from eaglenest.featurestore import cli
from eaglenest.featurestore.table import store

sys.path.insert(0, str(Path(__file__).parent / "featurestore"))
import fs_helpers as H  # noqa: E402

RECIPE = str(Path(__file__).resolve().parents[1] / "recipes" / "toy.yaml")


@pytest.fixture()
def uri(tmp_path) -> str:
    uri, m = str(tmp_path / "store"), H.meta()
    store.append(uri, store.FEATURES, H.table(["s0", "s1", "s2"], m), meta=m)
    return uri


def _cli(capsys, uri: str, *argv: str) -> tuple[int, list[str]]:
    code = cli.main([*argv, "--recipe", RECIPE, f"run.store={uri}", f"run.workdir={Path(uri).parent}"])
    return code, capsys.readouterr().err.strip().splitlines()


def _one_line(code: int, err: list[str], *says: str) -> None:
    assert code == 2 and len(err) == 1 and err[0].startswith("featurestore: error:"), err
    assert all(s in err[0] for s in says), err


def test_tags_create_and_delete_together_is_refused_before_either(capsys, uri):
    code, err = _cli(capsys, uri, "tags", "--create", "keep", "--delete", "nosuch")
    _one_line(code, err, "--create", "--delete")
    assert store.dataset(uri, store.FEATURES).tags.list() == {}


def test_query_attach_name_given_twice_is_refused(capsys, uri, tmp_path):
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    a.write_text("sample_id,al\ns0,1\n")
    b.write_text("sample_id,al\ns1,2\n")
    code, err = _cli(capsys, uri, "query", "--attach", f"ev={a}", "--attach", f"ev={b}", "--sql", "SELECT * FROM ev")
    _one_line(code, err, "--attach", "'ev'", "twice")


@pytest.mark.parametrize("inside", ["q.csv", "features.lance/q.csv", "features.lance/data/q.parquet"])
def test_query_out_inside_the_store_is_refused(capsys, uri, inside):
    out = Path(uri, inside)
    before = sorted(str(p) for p in Path(uri).rglob("*"))
    code, err = _cli(capsys, uri, "query", "--sql", "SELECT sample_id FROM features", "--out", str(out))
    _one_line(code, err, f"--out {out}", "feature store")
    assert sorted(str(p) for p in Path(uri).rglob("*")) == before
