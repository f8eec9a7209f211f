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
    assert man.domains["math"].cap_prompts == 5 and man.held_out("math") == ("fraction", 0.2)


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


def test_validate_lists_every_problem_key_first(tmp_path, capsys, src):
    text = GOOD.format(src=src) + textwrap.dedent("""\
        held_out_fraction: 1.5
        generation:
          max_tokens: 0
          reasoning: maybe
        bogus: 1
    """).replace("domains:", "domains:")
    text = text.replace("        provenance: test\n", "        provenance: test\n      - path: nope.jsonl\n")
    text = text.replace("cap_prompts: 5", "cap_prompts: 5\n    weight: -1\n    held_out_count: 3\n"
                        "    held_out_fraction: 0.1")
    m = tmp_path / "m.yaml"
    m.write_text(text)
    code = main(["validate", "--manifest", str(m)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    # structural problems (unknown keys, wrong literals) are all reported in one pass ...
    assert "bogus: unknown key" in lines
    assert any(line.startswith("generation.reasoning: 'maybe' is not one of") for line in lines)
    # ... and once the structure is valid, every semantic problem is too
    text = text.replace("bogus: 1\n", "").replace("reasoning: maybe", "reasoning: off")
    m.write_text(text)
    code = main(["validate", "--manifest", str(m)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    for want in ("held_out_fraction: 1.5 is not in [0, 1)", "generation.max_tokens: must be at least 1",
                 "domains.math.weight: -1.0 is negative",
                 "domains.math.held_out_count: give held_out_fraction or held_out_count, not both",
                 "domains.math.sources[1].provenance: required",
                 "domains.math.sources[1].path: file not found: nope.jsonl"):
        assert any(line.startswith(want) for line in lines), (want, lines)
    assert lines[-1].endswith("6 problem(s)")


def test_token_cap_and_heldout_count(tmp_path, src):
    from eaglenest.ingest.pool import build_pool

    m = tmp_path / "m.yaml"
    m.write_text(GOOD.format(src=src).replace("cap_prompts: 5", "cap_tokens: 10\n    held_out_count: 2"))
    man = load_manifest(m)
    rows = [{"prompt": f"p {i}", "system": "", "source": "s"} for i in range(20)]
    pool = build_pool(man, {"math": rows}, count_tokens=lambda t: 3)  # 3 tokens each: 3 fit in 10
    assert len(pool) == 3 and sum(e.split == "heldout" for e in pool) == 2


@pytest.mark.parametrize("edit,expected", [
    (lambda t: t + "held_out_fraction: 0.5\nheld_out_count: 1\n",  # the count silently won
     "held_out_count: give held_out_fraction or held_out_count, not both"),
    (lambda t: t + "generation:\n  temperature: 3.0\n", "generation.temperature: 3.0 is not in [0, 2]"),
    (lambda t: t.replace("  math:", "  é:"), "domains.é: domain names use ASCII letters, digits, '-' and '_'"),
    (lambda t: t.replace("  math:", "  ١٢٣:"), "domains.١٢٣: domain names use ASCII letters"),
    (lambda t: t.replace("  math:", "  ａｂ:"), "domains.ａｂ: domain names use ASCII letters"),
    (lambda t: t.replace("  math:", '  "a\\nb":'), "domains.a\\nb: domain names use ASCII letters"),
])
def test_rules_that_were_too_loose_are_refused(tmp_path, capsys, src, edit, expected):
    code, err, work = _run(tmp_path, capsys, edit(GOOD.format(src=src)))
    assert code == 2 and len(err.splitlines()) == 1 and expected in err, err
    assert not work.exists()


def _awkward_paths(tmp_path):
    (tmp_path / "loop1").symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(tmp_path / "loop1")
    (tmp_path / "adir").mkdir()
    return [(str(tmp_path / "loop1"), "symlink loop"), ("/tmp/a\\0b.jsonl", "contains a NUL byte"),
            ("~nosuchuser_eaglenest/a.jsonl", "unknown user in ~"), ("/tmp/" + "a" * 5000 + ".jsonl", "name too long"),
            (str(tmp_path / "adir"), "is a directory, not a file")]


@pytest.mark.parametrize("verb", ["validate", "build"])
def test_awkward_paths_are_one_line_naming_the_key(tmp_path, capsys, src, verb):
    # Before: tracebacks (RuntimeError "Symlink loop", ValueError "embedded null byte", RuntimeError
    # "Could not determine home directory", OSError ENAMETOOLONG) and "file not found" for a directory.
    for path, why in _awkward_paths(tmp_path):
        quoted = '"' + path + '"'  # YAML double quotes: \0 is a NUL
        contaminated = GOOD.format(src=src) + f"contamination:\n  mt_bench: [{quoted}]\n"
        for text, key in ((GOOD.format(src=quoted), "domains.math.sources[0].path"),
                          (contaminated, "contamination.mt_bench[0]")):
            m = tmp_path / "m.yaml"
            m.write_text(text)
            work = tmp_path / "work"
            assert main([verb, "--manifest", str(m), f"run.workdir={work}"]) == 2
            lines = capsys.readouterr().err.strip().splitlines()
            assert len(lines) == (2 if verb == "validate" else 1), lines
            # build reads a recipe too: its line names the manifest file first
            head = f"{key}: " if verb == "validate" else f"ingest: error: {m}: {key}: "
            assert lines[0].startswith(head), lines
            assert lines[0].endswith(why) and len(lines[0]) - len(head) < 200 and "\0" not in lines[0], lines
            assert not work.exists()
