"""A bad manifest exits with code 2 and one line naming the problem, and writes nothing."""

import textwrap

import pytest

from eaglenest.ingest.cli import main
from eaglenest.ingest.manifest import load_manifest

GOOD = """
name: t
licence: CC0-1.0
domains:
  math:
    cap_prompts: 5
    sources:
      - path: {src}
        provenance: test
"""


@pytest.fixture
def src(tmp_path):
    p = tmp_path / "src.jsonl"
    p.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    return p


def _run(tmp_path, capsys, text):
    m = tmp_path / "m.yaml"
    m.write_text(textwrap.dedent(text))
    work = tmp_path / "work"
    code = main(["build", "--manifest", str(m), f"run.workdir={work}"])
    err = capsys.readouterr().err.strip()
    return code, err, work


def test_good_manifest_loads(tmp_path, src):
    m = tmp_path / "m.yaml"
    m.write_text(GOOD.format(src=src))
    man = load_manifest(m)
    assert man.domains["math"].cap_prompts == 5 and man.held_out("math") == 0.2


@pytest.mark.parametrize("edit,expected", [
    (lambda t: t.replace("    cap_prompts: 5\n", ""), "domains.math.cap_prompts: required key is missing"),
    (lambda t: t.replace("cap_prompts: 5", "cap_prompts: 5\n    cap_prompt: 5"), "domains.math.cap_prompt: unknown key"),
    (lambda t: t.replace("src.jsonl", "nope.jsonl"), "domains.math.sources[0].path: file not found"),
    (lambda t: t.replace("        provenance: test\n", ""), "domains.math.sources[0].provenance: required"),
    (lambda t: t.replace("name: t\n", ""), "name: required key is missing"),
    (lambda t: t + "held_out_fraction: 1.5\n", "held_out_fraction: 1.5 is not in [0, 1)"),
    (lambda t: t.replace("domains:", "domain:"), "domain: unknown key"),
])
def test_bad_manifest_exits_2_with_one_line_and_writes_nothing(tmp_path, capsys, src, edit, expected):
    code, err, work = _run(tmp_path, capsys, edit(GOOD.format(src=src)))
    assert code == 2
    assert len(err.splitlines()) == 1, err
    assert expected in err
    assert not work.exists()


def test_missing_manifest_file(tmp_path, capsys):
    work = tmp_path / "work"
    code = main(["build", "--manifest", str(tmp_path / "absent.yaml"), f"run.workdir={work}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "file not found" in err and len(err.splitlines()) == 1
    assert not work.exists()


def test_missing_prompt_column_is_reported(tmp_path, capsys, src):
    src.write_text('{"question": "a"}\n')
    code, err, work = _run(tmp_path, capsys, GOOD.format(src=src))
    assert code == 2 and "domains.math.sources[0].field: row 0" in err and "'prompt'" in err
    assert not work.exists()


def test_yaml_objects_are_not_constructed(tmp_path, capsys, src):
    text = GOOD.format(src=src).replace("name: t", "name: !!python/object/apply:os.system ['true']")
    code, err, _ = _run(tmp_path, capsys, text)
    assert code == 2 and "not valid YAML" in err
