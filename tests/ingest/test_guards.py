"""Contamination checks (MT-Bench read at run time, SPEED-Bench style files, the held-out split) and a
write that fails (file-size limit = disk full) leaving no partial version. No engine is started."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from eaglenest.config import build
from eaglenest.errors import ManifestError
from eaglenest.ingest import contamination
from eaglenest.ingest.manifest import Manifest
from eaglenest.ingest.pool import build_pool

#: MT-Bench questions in the published ``question.jsonl`` format (question_id, category, turns), written
#: by the test: the real file is not part of a clone.
MT_BENCH_QUESTIONS = [
    {"question_id": 81, "category": "writing",
     "turns": ["Compose an engaging travel blog post about a recent trip to Hawaii.", "Rewrite it in one line."]},
    {"question_id": 101, "category": "reasoning",
     "turns": ["You overtake the second person in a race. What is your position now?", "And the last one?"]},
    {"question_id": 111, "category": "math",
     "turns": ["The vertices of a triangle are at (0, 0), (-1, 1) and (3, 3). What is its area?",
               "What is the area of the circle around it?"]},
    {"question_id": 121, "category": "coding",
     "turns": ["Write a program that finds the five most common words in a set of text files.",
               "Can you parallelise it with threads?"]},
]


@pytest.fixture
def mt_bench(tmp_path) -> str:
    path = tmp_path / "mt_bench" / "question.jsonl"
    path.parent.mkdir()
    path.write_text("".join(json.dumps(q) + "\n" for q in MT_BENCH_QUESTIONS))
    return str(path)


def _manifest(tmp_path, held_out_fraction=0.3, **contam):
    return build(Manifest, {"name": "t", "licence": "x", "held_out_fraction": held_out_fraction, "raw_fraction": 0.0,
                            "contamination": contam,
                            "domains": {"a": {"cap_prompts": 100, "sources": [{"path": "x", "provenance": "p"}]}}})


def test_mt_bench_and_speed_bench_prompts_are_dropped_from_training(tmp_path, mt_bench):
    mt = [json.loads(line) for line in open(mt_bench)]
    speed = tmp_path / "speed.jsonl"
    speed.write_text(json.dumps({"prompt": "Summarise the speed bench passage about rivers."}) + "\n")
    rows = [{"prompt": f"ordinary prompt number {i} about nothing in particular", "system": "", "source": "s"}
            for i in range(40)]
    rows.append({"prompt": "  " + mt[0]["turns"][0].upper() + " ", "system": "", "source": "s"})  # same, reformatted
    rows.append({"prompt": "x", "later_turns": [mt[3]["turns"][1]], "system": "", "source": "s"})  # a later turn
    rows.append({"prompt": "summarise the SPEED bench passage about rivers.", "system": "", "source": "s"})
    # No held-out split: every planted row is a training prompt, so each of the three checks (MT-Bench first
    # turn, MT-Bench later turn, SPEED-Bench) must catch its own row.
    m = _manifest(tmp_path, held_out_fraction=0.0, mt_bench=[mt_bench], speed_bench=[str(speed)])
    pool = build_pool(m, {"a": rows})
    planted = {e.sample_id for e in pool if not e.prompt.startswith("ordinary")}
    assert len(planted) == 3 and all(e.split == "train" for e in pool)
    kept, report = contamination.check(pool, m)
    assert report["eval_prompts"] == sum(len(q["turns"]) for q in mt) + 1
    assert report["contaminated"] == 3 and report["by_reason"] == {"exact:eval": 3}
    assert set(report["sample_ids"]) == planted
    assert {e.sample_id for e in pool} - {e.sample_id for e in kept} == planted
    assert len(kept) == len(pool) - 3
    with pytest.raises(ManifestError, match="^contamination: "):
        contamination.check(pool, _manifest(tmp_path, held_out_fraction=0.0, mt_bench=[mt_bench],
                                            speed_bench=[str(speed)], action="error"))


def test_near_duplicates_of_heldout_prompts_are_flagged(tmp_path):
    base = "please write a short poem about the quiet harbour at dawn with gulls"
    rows = [{"prompt": f"{base} variant {i}", "system": "", "source": "s"} for i in range(30)]
    m = _manifest(tmp_path, near_duplicate_threshold=0.6)
    pool = build_pool(m, {"a": rows})
    kept, report = contamination.check(pool, m)
    n_train = sum(e.split == "train" for e in pool)
    assert n_train and report["by_reason"] == {"near:heldout": n_train}  # (0 == 0 passed with no training prompt)
    assert kept and all(e.split == "heldout" for e in kept)
    off = build_pool(_manifest(tmp_path), {"a": rows})
    assert contamination.check(off, _manifest(tmp_path))[1]["contaminated"] == 0


@pytest.mark.parametrize("data, says", [
    (b'{"turns": ["caf\xe9"]}\n', "line 1 is not UTF-8 text"),
    (b'{"prompt": "a"}\n[1, 2]\n', "line 2 of {f} is a list, not an object"),
    (b'{"messages": ["x"]}\n', "line 1 of {f}: 'messages' is not a list of messages"),
    (b'{"turns": ["a", null]}\n', "line 1 of {f}: turn 1 is null, not a string"),  # was the prompt "None"
    (b'{"turns": [1]}\n', "line 1 of {f}: turn 0 is a number, not a string"),
    (b'{"messages": [{"role": "user", "content": 7}]}\n', "message 0 (user) content is a number"),
    (b'{"prompt": "\\ud800"}\n', "line 1 of {f}: column 'prompt' is not valid Unicode text (a lone surrogate)"),
])
def test_an_eval_file_that_is_not_prompts_is_refused_by_validate_and_build_alike(tmp_path, capsys, data, says):
    # Before: `ingest validate` said ok, `ingest build` crashed (UnicodeDecodeError, AttributeError,
    # UnicodeEncodeError) or turned a null turn into the prompt "None".
    from eaglenest.ingest.cli import main

    bad = tmp_path / "eval.jsonl"
    bad.write_bytes(data)
    with pytest.raises(ManifestError, match=r"^contamination\.mt_bench\[0\]: "):
        contamination.load_eval_prompts(bad, where="contamination.mt_bench[0]")
    src = tmp_path / "src.jsonl"
    src.write_text('{"prompt": "a"}\n')
    m = tmp_path / "m.yaml"
    m.write_text(f"name: t\nlicence: x\ncontamination:\n  mt_bench: [{bad}]\ndomains:\n  d:\n    cap_prompts: 5\n"
                 f"    sources:\n      - path: {src}\n        provenance: p\n")
    work = tmp_path / "work"
    want = f"contamination.mt_bench[0]: {says.format(f=bad)}" if "{f}" in says else says
    assert main(["validate", "--manifest", str(m), f"run.workdir={work}"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("contamination.mt_bench[0]: ") and want in lines[0], lines
    assert main(["build", "--manifest", str(m), f"run.workdir={work}"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ingest: error: contamination.mt_bench[0]: ") and want in lines[0]
    assert not work.exists()


def test_a_line_separator_inside_an_eval_prompt_is_not_a_line_break(tmp_path):
    path = tmp_path / "eval.jsonl"
    path.write_text('{"prompt": "a\u2028b"}\n{"turns": ["c\u0085d"]}\n', encoding="utf-8")  # JSON allows both raw
    assert contamination.load_eval_prompts(path, where="w") == ["a\u2028b", "c\u0085d"]


DISK_FULL = textwrap.dedent("""
    import random, resource, signal, sys
    from eaglenest.config import build as b
    from eaglenest.errors import StoreError
    from eaglenest.featurestore.table import store
    from eaglenest.featurestore.table.fragments import ensure_table
    from eaglenest.ingest.build import build
    from eaglenest.ingest.config import IngestConfig
    from eaglenest.ingest.manifest import Manifest
    from eaglenest.ingest.pool import build_pool
    uri, target = sys.argv[1], sys.argv[2]
    m = b(Manifest, {"name": "t", "licence": "x", "held_out_count": 400,
                     "domains": {"a": {"cap_prompts": 400, "sources": [{"path": "x", "provenance": "p"}]}}})
    pool = build_pool(m, {"a": [{"prompt": f"prompt {i} " + random.Random(i).randbytes(600).hex(), "system": "", "source": "s"}
                                for i in range(400)]})
    v0 = ensure_table(uri, store.PROMPTS)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))  # any file > 64 KiB: EFBIG
    try:
        build(m, pool, target=target, store_uri=uri, cfg=IngestConfig())
    except StoreError as exc:
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        print("ERR", exc)
        print("VERSIONS", v0, store.latest_version(uri, store.PROMPTS), len(store.sample_ids(uri, store.PROMPTS)))
""")


@pytest.mark.slow
def test_disk_full_is_a_clear_error_and_commits_nothing(tmp_path, tiny_target):
    p = subprocess.run([sys.executable, "-c", DISK_FULL, str(tmp_path / "store"), str(tiny_target)],
                       capture_output=True, text=True, timeout=120)
    out = p.stdout.splitlines()
    assert p.returncode == 0 and out, p.stderr[-2000:]
    assert out[0].startswith("ERR run.store: cannot write the prompts table") and len(out[0]) < 600
    assert "no partial version was committed" in out[0]
    _, v0, v1, n = out[1].split()
    assert v0 == v1 and n == "0"
