"""QA of the prompt pool after the manifest is parsed: sources in odd shapes, composed chats with blank
rows, held-out leakage. Pure functions and local files; no
engine, no network."""

from __future__ import annotations

import json
import random
import tracemalloc
import zlib

import numpy as np
import pytest

from eaglenest.config import build
from eaglenest.errors import ManifestError
from eaglenest.ingest import compose, contamination
from eaglenest.ingest.cli import main
from eaglenest.ingest.manifest import Manifest, Source
from eaglenest.ingest.neardup import NearDupIndex
from eaglenest.ingest.pool import build_pool, load_source

BOM = b"\xef\xbb\xbf"


def _manifest(domains: dict, **top) -> Manifest:
    return build(Manifest, {"name": "t", "licence": "x", "raw_fraction": 0.0, **top, "domains": domains})


def _domain(**kw) -> dict:
    return {"cap_prompts": 100, "sources": [{"path": "x", "provenance": "p"}], **kw}


# -- sources in odd shapes -----------------------------------------------------------------------------
def test_a_jsonl_source_with_a_byte_order_mark_and_crlf_lines_is_read(tmp_path):
    # Windows editors and PowerShell write UTF-8 with a BOM: the first row was refused as "not valid JSON".
    path = tmp_path / "bom.jsonl"
    path.write_bytes(BOM + b'{"prompt": "first"}\r\n\r\n{"prompt": "second"}\r\n')
    rows = load_source(Source(path=str(path)), where="d")
    assert [r["prompt"] for r in rows] == ["first", "second"]


def test_a_json_source_with_a_byte_order_mark_is_read(tmp_path):
    path = tmp_path / "bom.json"
    path.write_bytes(BOM + json.dumps([{"prompt": "only"}]).encode())
    assert [r["prompt"] for r in load_source(Source(path=str(path)), where="d")] == ["only"]


def test_an_eval_file_with_a_byte_order_mark_is_read(tmp_path):
    path = tmp_path / "question.jsonl"
    path.write_bytes(BOM + b'{"turns": ["What is 2 + 2?"]}\n')
    assert contamination.load_eval_prompts(path, where="contamination.mt_bench[0]") == ["What is 2 + 2?"]


def test_a_bom_inside_the_file_is_still_a_bad_line(tmp_path):
    # Two files concatenated: only a mark at the very start is taken off.
    path = tmp_path / "cat.jsonl"
    path.write_bytes(b'{"prompt": "a"}\n' + BOM + b'{"prompt": "b"}\n')
    with pytest.raises(ManifestError) as exc:
        load_source(Source(path=str(path)), where="d")
    assert str(exc.value).startswith(f"d.path: {path} line 2 is not valid JSON")


@pytest.mark.parametrize("message, keys", [({"from": "human", "value": "hi"}, "from, value"),
                                           ({"role": None, "content": "hi"}, "content, role"),
                                           ({"role": 1, "content": "hi"}, "content, role")])
def test_a_message_without_a_role_is_refused_not_counted_as_empty(tmp_path, message, keys):
    # A ShareGPT-style conversation ({from, value}) had every row silently counted as "empty"; the
    # build then said only that the pool was empty.
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"m": [{"role": "user", "content": "ok"}]}) + "\n"
                    + json.dumps({"m": [message, {"role": "user", "content": "ok"}]}) + "\n")
    with pytest.raises(ManifestError) as exc:
        load_source(Source(path=str(path), messages_field="m"), where="d")
    assert str(exc.value) == (f"d.messages_field: row 1 of {path}: message 0 has no 'role' string "
                              f"(its keys: {keys}); messages are {{role, content}} objects")


def test_roles_out_of_order_tool_and_system_only_chats_are_read(tmp_path):
    path = tmp_path / "chats.jsonl"
    chats = [[{"role": "user", "content": "one"}, {"role": "user", "content": "two"}],  # two user turns in a row
             [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "three"},
              {"role": "tool", "content": "{\"x\": 1}"}, {"role": "user", "content": "four"}],
             [{"role": "system", "content": "only a system prompt"}]]
    path.write_text("".join(json.dumps({"m": c}) + "\n" for c in chats))
    rows = load_source(Source(path=str(path), messages_field="m"), where="d")
    assert [(r["prompt"], r["later_turns"], r["system"]) for r in rows] == [
        ("one", ["two"], ""), ("three", ["four"], ""), ("", [], "only a system prompt")]
    report: dict = {}
    pool = build_pool(_manifest({"a": _domain()}, held_out_fraction=0.0), {"a": rows}, report=report)
    assert sorted(e.user_turns() for e in pool) == [["one", "two"], ["three", "four"]]
    assert report["domains"]["a"]["empty"] == 1


def test_a_hub_dataset_that_cannot_be_loaded_is_one_line_naming_the_key(tmp_path, monkeypatch):
    # datasets raised FileNotFoundError / ConnectionError / ValueError (unknown split): a traceback.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    missing = tmp_path / "no-such-dataset"
    with pytest.raises(ManifestError) as exc:
        load_source(Source(hf_id=str(missing)), where="domains.d.sources[0]")
    line = str(exc.value)
    assert line.startswith(f"domains.d.sources[0].hf_id: cannot load hf:{missing}/default/train (")
    assert "\n" not in line and len(line) < 400


# -- composed long chats -------------------------------------------------------------------------------
def words(text: str) -> int:
    return len(text.split())


def _compose_manifest(**kw):
    return _manifest({"long": _domain(held_out_count=0, compose={"target_tokens": [512, 1024], "per_length": 3,
                                                                   "answer_tokens": 30, **kw})})


@pytest.mark.parametrize("blank", [{"prompt": "   "}, {"prompt": "real question", "later_turns": ["\n"]},
                                   {"prompt": "\u200b\ufeff\u2060"}])
def test_a_blank_row_never_empties_the_composed_chats(blank):
    # A blank row went into the chats as a turn, and the pool drops a conversation with a blank turn as
    # "empty": one such row in a source cost 5 of the 6 composed conversations.
    rows = [{"prompt": f"prompt number {i} about things", "system": "", "source": "s"} for i in range(20)]
    rows.append({"system": "", "source": "s", **blank})
    m = _compose_manifest()
    report: dict = {}
    pool = build_pool(m, compose.apply(m, {"long": rows}, count_tokens=words), report=report)
    assert len(pool) == 6 and report["domains"]["long"]["empty"] == 0
    assert all(t.strip() for e in pool for t in e.user_turns())


def test_a_prompt_of_zero_width_characters_is_empty_not_sent():
    """U+200B, U+FEFF and U+2060 are format characters, not whitespace: such a prompt was kept and sent."""
    rows = [{"prompt": p, "later_turns": later, "system": "", "source": "s"}
            for p, later in [("\u200b\ufeff", []), ("real one", ["\u2060 \u200b"]), ("a\u200bb", [])]]
    report: dict = {}
    pool = build_pool(_manifest({"a": _domain()}, held_out_fraction=0.0), {"a": rows}, report=report)
    assert [e.user_turns() for e in pool] == [["a\u200bb"]] and report["domains"]["a"]["empty"] == 2


def test_only_blank_rows_name_the_domain():
    with pytest.raises(ManifestError, match=r"^domains\.long\.compose: domain 'long' has no prompts"):
        compose.apply(_compose_manifest(), {"long": [{"prompt": " \n ", "system": "", "source": "s"}]},
                      count_tokens=words)


def test_a_target_longer_than_every_source_repeats_a_one_turn_source():
    m = _compose_manifest()
    convs = compose.apply(m, {"long": [{"prompt": "the only prompt", "system": "", "source": "s"}]},
                          count_tokens=words)["long"]
    assert len(convs) == 6
    for c in convs:
        middle = [c["prompt"].split("\n\n", 1)[1], *c["later_turns"][:-1]]
        assert set(middle) == {"the only prompt"} and len(middle) > 5


# -- held-out leakage ----------------------------------------------------------------------------------
def test_a_heldout_prompt_is_never_trained_on_under_another_system_prompt():
    # The pool's identity is system + prompt, so the same question with two system prompts is two
    # entries; one held out and the other trained on leaked the evaluation prompt (the toy manifest:
    # 23 training prompts). The contamination check drops the training twin.
    rows = [{"prompt": f"question number {i}?", "system": sys_, "source": "s"}
            for i in range(60) for sys_ in ("", "Answer briefly.")]
    m = _manifest({"a": _domain(cap_prompts=1000)}, held_out_fraction=0.3)
    pool = build_pool(m, {"a": rows})
    held = {e.prompt for e in pool if e.split == "heldout"}
    twins = {e.sample_id for e in pool if e.split == "train" and e.prompt in held}
    assert twins  # the data has the case this test is about
    kept, report = contamination.check(pool, m)
    assert not {e.prompt for e in kept if e.split == "train"} & held
    assert set(report["sample_ids"]) == twins and report["by_reason"] == {"exact:heldout": len(twins)}
    assert {e.sample_id for e in kept} == {e.sample_id for e in pool} - twins


def test_a_heldout_prompt_is_never_trained_on_as_a_turn_of_a_conversation():
    single = [{"prompt": f"standalone question {i}?", "system": "", "source": "s"} for i in range(40)]
    m = _manifest({"a": _domain(), "chats": _domain(held_out_fraction=0.0)}, held_out_fraction=0.3)
    pool = build_pool(m, {"a": single})
    held = [e.prompt for e in pool if e.split == "heldout"]
    assert held
    chats = [{"prompt": "hello there", "later_turns": [q], "system": "", "source": "c"} for q in held]
    chats.append({"prompt": "hello again", "later_turns": ["an unrelated question"], "system": "", "source": "c"})
    pool = build_pool(m, {"a": single, "chats": chats})
    kept, report = contamination.check(pool, m)
    assert report["by_reason"] == {"exact:heldout": len(held)}
    assert [e.later_turns for e in kept if e.domain == "chats"] == [("an unrelated question",)]


# -- near-duplicate removal ------------------------------------------------------------------------------
def test_prompts_without_words_are_not_near_duplicates_of_each_other():
    # A text with no word has no shingles, and the Jaccard of two empty sets is 1: every emoji- or
    # punctuation-only prompt was dropped as a near duplicate of the first one kept.
    m = _manifest({"a": _domain()}, held_out_fraction=0.0, dedup={"near_duplicate_threshold": 0.8})
    prompts = ["👋", "🎉🎉", "?!", "¿¡", "what is the capital of France today my friend"]
    report: dict = {}
    pool = build_pool(m, {"a": [{"prompt": p, "system": "", "source": "s"} for p in prompts]}, report=report)
    assert sorted(e.prompt for e in pool) == sorted(prompts)
    assert report["domains"]["a"]["near_duplicates"] == 0
    twins = ["what is the capital of France today my friend", "What is the capital of France today, my friend?"]
    assert len(build_pool(m, {"a": [{"prompt": p, "system": "", "source": "s"} for p in twins]})) == 1


# -- generation values ---------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [2**70, -1])
def test_a_seed_vllm_cannot_take_is_refused_by_validate(tmp_path, capsys, seed):
    # 2**70 passed the manifest check and raised "Overflow when unpacking long long" out of the
    # engine's step (a traceback, after the engine had started); -1 is vLLM's "no seed".
    src = tmp_path / "s.jsonl"
    src.write_text('{"prompt": "a"}\n')
    m = tmp_path / "m.yaml"
    m.write_text(f"name: t\nlicence: x\ngeneration:\n  temperature: 0.7\n  seed: {seed}\ndomains:\n  d:\n"
                 f"    cap_prompts: 5\n    sources:\n      - path: {src}\n        provenance: p\n")
    assert main(["validate", "--manifest", str(m), f"run.workdir={tmp_path / 'work'}"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0] == f"generation.seed: {seed} is not in [0, {2**63 - 1}]" and len(lines) == 2


# -- odd paths -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("data, says", [(b'{"prompt": 1 2}\n', "line 1 is not valid JSON"),
                                        (b"\xff\n", "line 1 is not UTF-8"),
                                        (b"", "has no rows"),
                                        (b'{"prompt": 5}\n', "row 0 of "),
                                        (b'{"m": [{"from": "human"}]}\n', "message 0 has no 'role'")])
def test_an_error_about_a_file_with_a_newline_in_its_name_stays_one_line(tmp_path, data, says):
    # The file's name went into the error as it was: a name with a newline split the one error line.
    path = tmp_path / "odd\nname.jsonl"
    path.write_bytes(data)
    src = Source(path=str(path), messages_field="m" if b'"m"' in data else "")
    with pytest.raises(ManifestError) as exc:
        load_source(src, where="d")
    line = str(exc.value)
    assert "\n" not in line and says in line and "odd\\nname.jsonl" in line, line


def test_an_eval_file_with_a_newline_in_its_name_stays_one_line(tmp_path):
    path = tmp_path / "eval\n.jsonl"
    path.write_bytes(b'{"turns": [3]}\n')
    with pytest.raises(ManifestError) as exc:
        contamination.load_eval_prompts(path, where="contamination.mt_bench[0]")
    assert "\n" not in str(exc.value) and "eval\\n.jsonl" in str(exc.value), str(exc.value)


def test_a_composed_length_past_the_engine_is_refused_before_composing(tmp_path, tiny_target, capsys, monkeypatch):
    # The length check came after the pool: 200 chats of 2**20 tokens were composed first (4 min,
    # 1.9 GB on the 2-core machine) only to be refused by a check that needs the manifest alone.
    def composed(*args, **kwargs):
        raise AssertionError("conversations were composed before the length check")

    monkeypatch.setattr(compose, "apply", composed)
    src = tmp_path / "s.jsonl"
    src.write_text('{"prompt": "what is one plus one"}\n')
    m = tmp_path / "m.yaml"
    m.write_text(f"name: t\nlicence: x\ndomains:\n  long:\n    cap_prompts: 10\n    held_out_count: 0\n"
                 f"    compose: {{target_tokens: [1048576], per_length: 200, answer_tokens: 1}}\n"
                 f"    sources:\n      - path: {src}\n        provenance: p\n")
    work = tmp_path / "work"
    code = main(["build", "--manifest", str(m), f"run.workdir={work}", f"run.target={tiny_target}",
                 "ingest.engine.max_model_len=4096"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("ingest: error: ingest.engine.max_model_len: 4096 is shorter than the longest "
                               "composed conversation (1048736 tokens")
    assert not work.exists()


def _words(n: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return " ".join(f"w{rng.randrange(10**6)}" for _ in range(n))


def test_a_gigantic_prompt_is_signed_in_bounded_memory():
    # The signature took num_perm x shingles products at once: an 8 MB prompt peaked at 2.2 GB RSS,
    # a 40 MB one would not fit most machines. Signed in chunks now.
    idx = NearDupIndex(0.8)
    text = _words(200_000)  # ~200k shingles: 128 x 200k x 8 bytes = 195 MiB for each temporary at once
    tracemalloc.start()
    try:
        idx.sketch(text)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 100 * 2**20, f"{peak / 2**20:.0f} MiB"


def test_a_signature_signed_in_chunks_is_the_plain_one():
    idx = NearDupIndex(0.8)
    sh, sig = idx.sketch(_words(20_000, seed=1))  # several chunks
    x = np.array([zlib.crc32(s.encode()) for s in sh], dtype=np.uint64)
    plain = ((idx._a[:, None] * x[None, :] + idx._b[:, None]) % np.uint64((1 << 32) + 15)).min(axis=1)
    assert len(sh) > 10_000 and np.array_equal(sig, plain)
