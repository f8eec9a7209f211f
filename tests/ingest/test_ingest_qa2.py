"""Second QA pass of ``ingest``: manifests and sources a user writes, re-runs after a changed manifest.
Local files, pure functions and ``ingest build`` through its CLI with a scripted backend in place of the
engine (what is tested is the build's bookkeeping, not generation); no vLLM engine, no network."""

from __future__ import annotations

import json

import pytest

from eaglenest.config import build
from eaglenest.errors import ManifestError
from eaglenest.featurestore.table import store
from eaglenest.hf import load_tokenizer
from eaglenest.ingest import build as build_module
from eaglenest.ingest import compose, contamination
from eaglenest.ingest.cli import main
from eaglenest.ingest.manifest import Manifest, Source, check
from eaglenest.ingest.pool import build_pool, load_source

from ingest_helpers import Scripted  # tests/ingest on sys.path via conftest

DEEP = b"[" * 100_000 + b"]" * 100_000
LONG_INT = b"1" + b"0" * 5000  # past Python's 4300-digit limit for int("...")


def _validate(tmp_path, capsys, manifest: str) -> tuple[int, list[str]]:
    (tmp_path / "m.yaml").write_text(manifest)
    rc = main(["validate", "--recipe", "recipes/toy.yaml", "--manifest", str(tmp_path / "m.yaml")])
    return rc, capsys.readouterr().err.strip().splitlines()


# -- sources whose JSON Python's parser refuses with something other than a JSONDecodeError ---------------
@pytest.mark.parametrize("name, data, line", [
    ("deep.jsonl", b'{"prompt": "a"}\n{"prompt": "b", "n": ' + DEEP + b"}\n", 2),
    ("long.jsonl", b'{"prompt": "a", "n": ' + LONG_INT + b"}\n", 1),
    ("deep.json", b'[{"prompt": "b", "n": ' + DEEP + b"}]", None),
    ("long.json", b'[{"prompt": "a", "n": ' + LONG_INT + b"}]", None),
])
def test_json_too_deep_or_with_a_huge_number_is_one_line_naming_the_file(tmp_path, name, data, line):
    # A 5001-digit integer (ValueError) or 100000 nested lists (RecursionError) in a row came out of
    # `ingest validate` and `ingest build` as a traceback, exit 1.
    (tmp_path / name).write_bytes(data)
    with pytest.raises(ManifestError) as exc:
        load_source(Source(path=str(tmp_path / name)), where="domains.a.sources[0]")
    msg = str(exc.value)
    assert msg.startswith("domains.a.sources[0].path: ") and name in msg and "not valid JSON" in msg
    assert (f"line {line} " in msg) if line else "line" not in msg
    assert len(msg.splitlines()) == 1


def test_an_eval_file_too_deep_is_one_line_naming_the_key(tmp_path):
    (tmp_path / "mt.jsonl").write_bytes(b'{"turns": ["a"], "n": ' + DEEP + b"}\n")
    with pytest.raises(ManifestError, match=r"^contamination\.mt_bench\[0\]: .*mt\.jsonl line 1 is not valid JSON"):
        contamination.load_eval_prompts(tmp_path / "mt.jsonl", where="contamination.mt_bench[0]")


def test_validate_reports_a_huge_number_as_a_problem_exit_2(tmp_path, capsys):
    (tmp_path / "s.jsonl").write_bytes(b'{"prompt": "a", "n": ' + LONG_INT + b"}\n")
    rc, err = _validate(tmp_path, capsys, f"name: t\nallow_unlicensed: true\ndomains:\n  a:\n    cap_prompts: 5\n"
                                          f"    sources:\n      - path: {tmp_path / 's.jsonl'}\n")
    assert rc == 2
    assert err[0].startswith("domains.a.sources[0].path: ") and "s.jsonl line 1 is not valid JSON" in err[0]


# -- a long_chat domain that holds prompts out ------------------------------------------------------------
def _words(text: str) -> int:
    return len(text.split())


def _long_chat_manifest(**held) -> Manifest:
    rule = {"rule": "long_chat", "target_tokens": [512, 1024], "per_length": 10, "answer_tokens": 20}
    return build(Manifest, {"name": "t", "licence": "x", **held.pop("top", {}), "domains": {"lc": {
        "cap_prompts": 50, "compose": rule, "sources": [{"path": "x", "provenance": "p"}], **held}}})


@pytest.mark.parametrize("held, key, says", [
    ({}, "held_out_count", "now fraction 0.2"),  # the manifest-wide default fraction applies
    ({"held_out_fraction": 0.1}, "held_out_fraction", "now fraction 0.1"),
    ({"top": {"held_out_count": 3}}, "held_out_count", "now count 3"),
])
def test_a_long_chat_domain_that_holds_prompts_out_is_refused_naming_the_key(held, key, says):
    # Composed chats share their prompts and closing questions: one held out made every other an
    # `exact:heldout` contaminated training chat, dropped with a log line: 19 of 20 chats, no error.
    m = _long_chat_manifest(**held)
    rows = [{"prompt": f"question number {i} about topic {i * 7}", "system": "", "source": "s"} for i in range(40)]
    pool = build_pool(m, compose.apply(m, {"lc": rows}, count_tokens=_words), count_tokens=_words)
    kept, _ = contamination.check(pool, m)
    assert sum(e.split == "train" for e in kept) < sum(e.split == "train" for e in pool) // 2  # what it protects
    problems = [p for p in check(m) if not p.startswith("domains.lc.sources[0].path:")]  # no file "x" here
    assert [p for p in problems if p.startswith(f"domains.lc.{key}: a long_chat domain must hold out nothing")]
    assert says in problems[0] and len(problems) == 1


@pytest.mark.parametrize("held", [{"held_out_count": 0}, {"held_out_fraction": 0.0}])
def test_a_long_chat_domain_holding_nothing_out_keeps_every_chat(held):
    m = _long_chat_manifest(**held)
    rows = [{"prompt": f"question number {i} about topic {i * 7}", "system": "", "source": "s"} for i in range(40)]
    pool = build_pool(m, compose.apply(m, {"lc": rows}, count_tokens=_words), count_tokens=_words)
    kept, report = contamination.check(pool, m)
    assert [p for p in check(m) if "held_out" in p] == []
    assert len(kept) == len(pool) == 20 and report["contaminated"] == 0


def test_a_documents_domain_may_hold_documents_out():
    m = build(Manifest, {"name": "t", "licence": "x", "domains": {"docs": {
        "cap_prompts": 5, "compose": {"rule": "documents", "target_tokens": [1024]}, "sources": []}}})
    assert check(m) == []


# -- a re-run under a changed manifest: the stored split stays, and is respected ----------------------------
@pytest.fixture
def scripted_build(tmp_path, tiny_target, monkeypatch, capsys):
    """``ingest build`` through the CLI with a scripted backend: (run(manifest text) -> (rc, stderr lines),
    the store, the backend)."""
    backend = Scripted(load_tokenizer(str(tiny_target), trust_remote_code=False))
    backend.target = str(tiny_target)
    monkeypatch.setattr(build_module, "make_backend", lambda *args, **kwargs: backend)
    work = tmp_path / "work"

    def run(text: str) -> tuple[int, list[str]]:
        (tmp_path / "m.yaml").write_text(text)
        rc = main(["build", "--recipe", "recipes/toy.yaml", "--manifest", str(tmp_path / "m.yaml"),
                   f"run.workdir={work}", f"run.target={tiny_target}"])
        return rc, capsys.readouterr().err.strip().splitlines()

    return run, str(work / "store"), backend


def test_a_prompt_stored_as_heldout_keeps_its_twins_out_of_training_after_the_manifest_changes(tmp_path,
                                                                                              scripted_build):
    # Run 1 holds "What is two plus two?" out (stored unanswered, evaluated later). Run 2's manifest holds
    # nothing out, so the stored prompt is skipped (its id is stored) and the pool no longer calls it
    # held out: its twin under a system prompt was regenerated and trained on, the evaluation prompt with it.
    run, uri, backend = scripted_build
    src = tmp_path / "s.jsonl"
    src.write_text('{"prompt": "What is two plus two?", "system": null}\n')
    head = "name: t\nlicence: x\nraw_fraction: 0.0\ndomains:\n  a:\n    cap_prompts: 9\n"
    source = f"    sources:\n      - path: {src}\n        system_field: system\n        provenance: p\n"
    assert run(head + "    held_out_count: 1\n" + source)[0] == 0
    heldout = store.read(uri, store.PROMPTS, columns=["sample_id", "split"]).to_pylist()
    assert [r["split"] for r in heldout] == ["heldout"]

    src.write_text('{"prompt": "What is two plus two?"}\n{"prompt": "what is two plus  two?", "system": "Be brief."}\n'
                   '{"prompt": "Name a colour."}\n')
    assert run(head + "    held_out_count: 0\n" + source)[0] == 0
    rows = store.read(uri, store.PROMPTS, columns=["sample_id", "split", "messages_json"]).to_pylist()
    trained = [json.loads(r["messages_json"]) for r in rows if r["split"] == "train"]
    assert [[m["content"] for m in msgs if m["role"] == "user"] for msgs in trained] == [["Name a colour."]]
    assert len(backend.requests) == 1
    stats = json.loads((tmp_path / "work" / "ingest" / "stats.json").read_text())
    assert stats["contamination"]["by_reason"] == {"exact:heldout": 1}


# -- required text given as blanks ---------------------------------------------------------------------------
@pytest.mark.parametrize("top, source, want", [
    ('name: "  "\nlicence: x\n', "        provenance: p\n", "name: required, and blank"),
    ("name: t\n", '        licence: " "\n        provenance: p\n', "domains.a.sources[0].licence: blank; give"),
    ('name: t\nlicence: "\\t"\n', "        provenance: p\n", "licence: blank; give a licence"),
    ("name: t\nlicence: x\n", '        provenance: "  "\n', "domains.a.sources[0].provenance: required"),
])
def test_a_blank_name_licence_or_provenance_is_refused_naming_the_key(tmp_path, capsys, top, source, want):
    # Only the empty string counted as missing: a licence of spaces passed validation and went to the
    # Hub card of `serve push` as the data licence; a blank name went into every commit's lineage.
    (tmp_path / "s.jsonl").write_text('{"prompt": "a"}\n')
    rc, err = _validate(tmp_path, capsys, top + "domains:\n  a:\n    cap_prompts: 5\n    sources:\n"
                                          f"      - path: {tmp_path / 's.jsonl'}\n" + source)
    assert rc == 2 and err[0].startswith(want) and len(err) == 2, err


def _splits(uri: str) -> dict[str, str]:
    rows = store.read(uri, store.PROMPTS, columns=["sample_id", "split"]).to_pylist()
    return {r["sample_id"]: r["split"] for r in rows}


def test_a_rerun_whose_manifest_moves_stored_prompts_to_the_other_split_says_so(tmp_path, scripted_build):
    # Growing a source under held_out_count (or changing a held-out fraction) gives stored prompts the
    # other split in the new pool: they keep their stored one (their ids are skipped), silently, so the
    # table's held-out set was neither the old manifest's nor the new one's without a word.
    run, uri, _ = scripted_build
    src = tmp_path / "s.jsonl"
    src.write_text("".join(f'{{"prompt": "question number {i}"}}\n' for i in range(6)))
    text = (f"name: t\nlicence: x\nraw_fraction: 0.0\nheld_out_fraction: {{f}}\ndomains:\n  a:\n    cap_prompts: 9\n"
            f"    sources:\n      - path: {src}\n        provenance: p\n")
    rc, err = run(text.format(f=0.5))
    before = _splits(uri)
    assert rc == 0 and not [line for line in err if "split" in line]
    assert len(before) == 6 and 0 < list(before.values()).count("heldout") < 6  # some of each
    rc, err = run(text.format(f=0.0))
    after = _splits(uri)
    assert rc == 0 and after == before  # each keeps its stored split
    moved = list(before.values()).count("heldout")
    warned = [line for line in err if line.startswith("ingest: warning: ") and "split" in line]
    assert len(warned) == 1 and f"{moved} stored prompt(s) ({{'a': {moved}}})" in warned[0], err
    stats = json.loads((tmp_path / "work" / "ingest" / "stats.json").read_text())
    assert stats["split_changed"] == {"prompts": moved, "per_domain": {"a": moved}}


# -- a source that is a symlink without a suffix behind it (the Hugging Face cache's layout) -----------------
def _hub_cache_file(tmp_path, name: str, data: bytes):
    """``snapshots/<rev>/<name>`` -> ``blobs/<sha>``, as ``huggingface_hub`` lays its cache out."""
    blob = tmp_path / "blobs" / "5f1e8b2c0d"
    blob.parent.mkdir()
    blob.write_bytes(data)
    link = tmp_path / "snapshots" / "main" / name
    link.parent.mkdir(parents=True)
    link.symlink_to("../../blobs/5f1e8b2c0d")
    return link


@pytest.mark.parametrize("name", ["train.jsonl", "train.json", "train.parquet"])
def test_a_source_symlinked_into_the_hub_cache_is_read_by_its_own_suffix(tmp_path, capsys, name):
    # The suffix was taken after resolving symlinks: every file of a downloaded hub snapshot was refused
    # ("no suffix is not .jsonl, .json or .parquet"), and a .jsonl linked to a blob would be parsed as .json.
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": "first question"}, {"prompt": "second question"}]
    if name.endswith(".parquet"):
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / "t.parquet")
        data = (tmp_path / "t.parquet").read_bytes()
    else:
        data = ("".join(json.dumps(r) + "\n" for r in rows) if name.endswith(".jsonl") else json.dumps(rows)).encode()
    link = _hub_cache_file(tmp_path, name, data)
    assert [r["prompt"] for r in load_source(Source(path=str(link)), where="d")] == ["first question",
                                                                                   "second question"]
    rc, err = _validate(tmp_path, capsys, "name: t\nallow_unlicensed: true\ndomains:\n  a:\n    cap_prompts: 5\n"
                                          f"    sources:\n      - path: {link}\n")
    assert rc == 0 and err == []


def test_a_source_whose_name_and_target_have_no_known_suffix_is_still_refused(tmp_path, capsys):
    link = _hub_cache_file(tmp_path, "train.csv", b"prompt\na\n")
    rc, err = _validate(tmp_path, capsys, "name: t\nallow_unlicensed: true\ndomains:\n  a:\n    cap_prompts: 5\n"
                                          f"    sources:\n      - path: {link}\n")
    assert rc == 2 and err[0] == "domains.a.sources[0].path: .csv is not .jsonl, .json or .parquet"


# -- a file that exists and cannot be read ------------------------------------------------------------------
@pytest.mark.parametrize("key", ["domains.a.sources[0].path", "contamination.mt_bench[0]"])
def test_a_file_that_cannot_be_read_is_one_line_naming_the_key(tmp_path, capsys, key):
    # /proc/self/mem is a regular file whose read fails (EIO), as a file on a failing disk or an
    # unreachable network mount does (or one without read permission, for a user who is not root):
    # the OSError came out of `ingest validate` and `ingest build` as a traceback.
    bad = tmp_path / "eio.jsonl"
    bad.symlink_to("/proc/self/mem")
    good = tmp_path / "s.jsonl"
    good.write_text('{"prompt": "a"}\n')
    src, mt = (bad, None) if key.startswith("domains") else (good, bad)
    rc, err = _validate(tmp_path, capsys, "name: t\nallow_unlicensed: true\n"
                                          + (f"contamination:\n  mt_bench: [{mt}]\n" if mt else "")
                                          + f"domains:\n  a:\n    cap_prompts: 5\n    sources:\n      - path: {src}\n")
    assert rc == 2 and len(err) == 2, err
    # a source is named as the manifest writes it; an evaluation file by the file it resolves to
    named = bad if key.startswith("domains") else bad.resolve()
    assert err[0] == f"{key}: {named} cannot be read (Input/output error)"


# -- evaluation rows whose turns or messages are not lists -------------------------------------------------
@pytest.mark.parametrize("row, says", [
    ('{"turns": "What is 2 + 2?"}', "'turns' is a string, not a list of prompts"),
    ('{"turns": "What is 2 + 2?", "prompt": "Name a colour."}', "'turns' is a string, not a list of prompts"),
    ('{"messages": {"role": "user", "content": "hi"}}', "'messages' is an object, not a list of messages"),
])
def test_an_eval_row_whose_turns_are_not_a_list_names_the_column(tmp_path, row, says):
    # It said the row "has no 'turns', 'messages' or 'prompt'" (it has), or it silently read only the
    # 'prompt' beside them: the questions in 'turns' were never checked against training.
    path = tmp_path / "eval.jsonl"
    path.write_text(row + "\n")
    with pytest.raises(ManifestError) as exc:
        contamination.load_eval_prompts(path, where="contamination.speed_bench[0]")
    assert str(exc.value) == f"contamination.speed_bench[0]: line 1 of {path}: {says}"


def test_an_eval_row_with_null_turns_beside_a_prompt_is_read(tmp_path):
    # a JSONL exported from a table with both columns: the one a row does not use is null
    path = tmp_path / "eval.jsonl"
    path.write_text('{"turns": null, "messages": null, "prompt": "Name a colour."}\n{"turns": ["a", "b"]}\n')
    assert contamination.load_eval_prompts(path, where="w") == ["Name a colour.", "a", "b"]


# -- a system_field no row has --------------------------------------------------------------------------------
@pytest.mark.parametrize("ext", ["jsonl", "parquet"])
def test_a_system_field_that_no_row_has_is_refused_naming_the_key(tmp_path, ext):
    # A null or missing system prompt means none, row by row: so `system_field: sytem` (a typo) dropped
    # every system prompt of the source without a word, and the pool held other conversations than asked.
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": "a", "system": "Be brief."}, {"prompt": "b", "system": None}]
    path = tmp_path / f"s.{ext}"
    if ext == "parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ManifestError) as exc:
        load_source(Source(path=str(path), system_field="sytem"), where="domains.a.sources[0]")
    assert str(exc.value) == (f"domains.a.sources[0].system_field: no row of {path} has a column 'sytem' "
                              "(columns: prompt, system)")
    got = load_source(Source(path=str(path), system_field="system"), where="domains.a.sources[0]")
    assert [r["system"] for r in got] == ["Be brief.", ""]  # some rows without one: fine


def test_an_eval_set_added_after_a_run_that_matches_stored_training_prompts_is_refused(tmp_path, scripted_build):
    # The stored training prompt that the new evaluation file holds was "dropped" from the pool (stats:
    # contaminated 1) but stays in the table, already answered: captured and trained on all the same.
    run, uri, backend = scripted_build
    src = tmp_path / "s.jsonl"
    src.write_text('{"prompt": "What is two plus two?"}\n{"prompt": "Name a colour."}\n')
    text = (f"name: t\nlicence: x\nraw_fraction: 0.0\nheld_out_fraction: 0.0\n{{contamination}}domains:\n  a:\n"
            f"    cap_prompts: 9\n    sources:\n      - path: {src}\n        provenance: p\n")
    assert run(text.format(contamination=""))[0] == 0
    version = store.latest_version(uri, store.PROMPTS)
    (tmp_path / "speed.jsonl").write_text('{"prompt": "what is two plus two?"}\n')
    rc, err = run(text.format(contamination=f"contamination:\n  speed_bench: [{tmp_path / 'speed.jsonl'}]\n"))
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("ingest: error: contamination: 1 training prompt(s) stored already in the prompts "
                             "table match evaluation sets or held-out prompts (first: a-")
    assert "exact:eval" in err[0] and "run.store" in err[0]
    assert store.latest_version(uri, store.PROMPTS) == version
    # the same manifest into a new store: the prompt is dropped before anything is stored
    fresh = tmp_path / "work" / "store2"
    assert main(["build", "--recipe", "recipes/toy.yaml", "--manifest", str(tmp_path / "m.yaml"),
                 f"run.workdir={tmp_path / 'work'}", f"run.store={fresh}", f"run.target={backend.target}"]) == 0
    rows = store.read(str(fresh), store.PROMPTS, columns=["messages_json"]).to_pylist()
    assert [json.loads(r["messages_json"])[0]["content"] for r in rows] == ["Name a colour."]


def test_stored_training_twins_are_not_refused_when_the_new_manifest_would_hold_one_out(tmp_path, scripted_build):
    # The other direction: both twins are stored as training prompts; a new held-out fraction puts one
    # of them in the pool's held-out split. It stays a training prompt (stored), so it holds nothing out.
    run, uri, backend = scripted_build
    src = tmp_path / "s.jsonl"
    src.write_text("".join(f'{{"prompt": "question number {i}", "system": null}}\n'
                           f'{{"prompt": "Question number {i}", "system": "Be brief."}}\n' for i in range(4)))
    text = (f"name: t\nlicence: x\nraw_fraction: 0.0\nheld_out_fraction: {{f}}\ndomains:\n  a:\n    cap_prompts: 9\n"
            f"    sources:\n      - path: {src}\n        system_field: system\n        provenance: p\n")
    assert run(text.format(f=0.0))[0] == 0
    before = _splits(uri)
    assert len(before) == 8 and set(before.values()) == {"train"}
    rc, err = run(text.format(f=0.5))
    assert rc == 0, err
    assert _splits(uri) == before and len(backend.requests) == 8  # nothing new, nothing refused
    assert [line for line in err if "fall in the other split" in line]


def test_a_second_manifest_into_the_same_store_is_reported(tmp_path, scripted_build):
    # Another manifest (another name) into a store that holds one's pool already mixed the two pools (their
    # caps, held-out splits and evaluation files) without a word.
    run, uri, _ = scripted_build
    src = tmp_path / "s.jsonl"
    src.write_text('{"prompt": "What is two plus two?"}\n{"prompt": "Name a colour."}\n')
    text = (f"name: {{name}}\nlicence: x\nheld_out_fraction: 0.0\ndomains:\n  {{domain}}:\n    cap_prompts: 9\n"
            f"    sources:\n      - path: {src}\n        provenance: p\n")
    for _ in range(2):  # a re-run of the same manifest is no mix
        rc, err = run(text.format(name="first", domain="a"))
        assert rc == 0 and not [line for line in err if "manifests" in line], err
    src.write_text('{"prompt": "Name a fruit."}\n')
    rc, err = run(text.format(name="second", domain="b"))
    warned = [line for line in err if line.startswith("ingest: warning: the prompts table holds the pools of 2 "
                                                      "manifests (first, second; this run: second)")]
    assert rc == 0 and len(warned) == 1, err
    stats = json.loads((tmp_path / "work" / "ingest" / "stats.json").read_text())
    assert stats["manifests"] == ["first", "second"]


# -- `ingest build` names the manifest file of a bad key ------------------------------------------------------
@pytest.mark.parametrize("edit, says", [
    (lambda t: t.replace("cap_prompts: 5", "cap_prompt: 5"), "domains.a.cap_prompt: unknown key"),
    (lambda t: t.replace("cap_prompts: 5", "cap_prompts: five"), "domains.a.cap_prompts: expected int or null"),
    (lambda t: t + "held_out_fraction: 2\n", "held_out_fraction: 2.0 is not in [0, 1)"),
])
def test_build_names_the_manifest_file_of_a_bad_key(tmp_path, capsys, edit, says):
    # `ingest build` reads a recipe and a manifest; its line named the key alone ("domains.a.cap_prompt:
    # unknown key"), not which file holds it (`ingest validate` names it on its summary line).
    (tmp_path / "s.jsonl").write_text('{"prompt": "a"}\n')
    manifest = tmp_path / "my manifest.yaml"
    manifest.write_text(edit(f"name: t\nlicence: x\ndomains:\n  a:\n    cap_prompts: 5\n    sources:\n"
                             f"      - path: {tmp_path / 's.jsonl'}\n        provenance: p\n"))
    work = tmp_path / "work"
    assert main(["build", "--recipe", "recipes/toy.yaml", "--manifest", str(manifest), f"run.workdir={work}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"ingest: error: {manifest}: {says}"), err
    assert not work.exists()


# -- a held_out_count that takes a whole domain ------------------------------------------------------------
@pytest.mark.parametrize("held, warned", [("held_out_count: 5", True), ("held_out_count: 3", True),
                                          ("held_out_count: 2", False)])
def test_a_held_out_count_that_takes_every_prompt_of_a_domain_is_warned_of(tmp_path, scripted_build, held, warned):
    # held_out_count 5 over a domain of 3 prompts held all three out: nothing of the domain was trained on
    # and nothing said so (a held_out_fraction is under 1, so never takes a whole domain on purpose).
    run, uri, _ = scripted_build
    src = tmp_path / "s.jsonl"
    src.write_text("".join(f'{{"prompt": "question number {i}"}}\n' for i in range(3)))
    rc, err = run(f"name: t\nlicence: x\nraw_fraction: 0.0\ndomains:\n  a:\n    cap_prompts: 9\n    {held}\n"
                  f"    sources:\n      - path: {src}\n        provenance: p\n")
    assert rc == 0, err
    lines = [line for line in err if "none of them is trained on" in line]
    assert len(lines) == int(warned), err
    if warned:
        assert lines[0].startswith("ingest: warning: domain a: held_out_count ") and "all 3 of its prompts" in lines[0]
    stats = json.loads((tmp_path / "work" / "ingest" / "stats.json").read_text())
    splits = list(_splits(uri).values())
    assert stats["pool"]["domains"]["a"]["held_out"] == splits.count("heldout") == min(3, int(held.split()[-1]))


def test_a_drops_file_nested_past_the_parsers_depth_is_read_as_unreadable(tmp_path, caplog):
    # json.loads raises RecursionError (not ValueError) on it: `ingest build` died with a traceback.
    path = tmp_path / "thinking_truncated.json"
    path.write_bytes(DEEP)
    assert build_module._read_dropped(path) == {}
    assert "is not valid JSON" in caplog.text and str(path) in caplog.text
