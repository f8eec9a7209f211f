"""Sample ids by structure (``text.conversation_key``, scheme 2): conversations that differ in roles or
turn boundaries are different samples; a single prompt keeps its id; a table written before keeps its
scheme (docs/manifest.md "Sample ids"). Scripted backend (ingest_helpers.py): no engine."""

from __future__ import annotations

import hashlib
import json
import re
import unicodedata

import pytest

from eaglenest.config import build as build_cfg
from eaglenest.errors import ConfigError, StoreError
from eaglenest.featurestore.table import maintenance, store, versions
from eaglenest.featurestore.table.fragments import commit_fragments
from eaglenest.hf import load_tokenizer
from eaglenest.evaluate.prompts import exclude_overlap, training_keys
from eaglenest.ingest import contamination
from eaglenest.ingest.build import build, stored_id_scheme
from eaglenest.ingest.cli import main as ingest_main
from eaglenest.ingest.config import IngestConfig
from eaglenest.ingest.manifest import Manifest, load_manifest
from eaglenest.ingest.pool import PoolEntry, build_pool, load_pool
from eaglenest.ingest.regen import gen_params_id, heldout_row, regenerate
from eaglenest.ingest.shard import write_rows

from ingest_helpers import Scripted  # tests/ingest on sys.path via conftest


def _manifest(**top) -> Manifest:
    return build_cfg(Manifest, {"name": "t", "licence": "x", "held_out_fraction": 0.0, "raw_fraction": 0.0,
                                "generation": {"max_tokens": 4}, **top,
                                "domains": {"d": {"cap_prompts": 100, "sources": [{"path": "x", "provenance": "p"}]}}})


def _row(system: str, *turns: str) -> dict:
    return {"prompt": turns[0], "later_turns": list(turns[1:]), "system": system, "source": "s"}


def _squashed_hash(text: str) -> str:
    """docs/manifest.md step 2: sha256 of the text NFKC-normalised, lower-cased, whitespace squashed."""
    return hashlib.sha256(re.sub(r"\s+", " ", unicodedata.normalize("NFKC", text).strip().lower()).encode()).hexdigest()


#: Pairs of conversations ``(system, *user turns)`` that scheme 1 gave one id (the second dropped as an
#: exact duplicate): every way a role or a turn boundary was lost in "\n".join([system, *turns]).
COLLISIONS = {
    "two turns vs one turn with a newline": (("", "Hi", "there"), ("", "Hi\nthere")),
    "two turns vs one turn with a space": (("", "Hi", "there"), ("", "Hi there")),
    "system vs the first line of the prompt": (("Be brief.", "Hi"), ("", "Be brief.\nHi")),
    "system vs a first user turn": (("Be brief.", "Hi"), ("", "Be brief.", "Hi")),
    "system/user boundary moved": (("A", "B\nC"), ("A\nB", "C")),
    "turn boundary moved": (("", "A\nB", "C"), ("", "A", "B\nC")),
}


@pytest.mark.parametrize("case", sorted(COLLISIONS))
def test_conversations_that_differ_in_structure_are_different_samples(case):
    one, other = COLLISIONS[case]
    report: dict = {}
    pool = build_pool(_manifest(), {"d": [_row(*one), _row(*other)]}, report=report)
    assert report["domains"]["d"]["exact_duplicates"] == 0 and len({e.sample_id for e in pool}) == 2, case
    got = {(e.system, e.prompt, *e.later_turns) for e in pool}
    assert got == {one, other}


def test_case_and_whitespace_inside_a_part_still_make_a_duplicate():
    # The parts keep content_key's folding: only roles and boundaries were added to the identity.
    report: dict = {}
    pool = build_pool(_manifest(), {"d": [_row("Be brief.", "What is  2+2?", "And 3+3?"),
                                          _row("be BRIEF. ", "what is 2+2?", "and\t3+3?")]}, report=report)
    assert len(pool) == 1 and report["domains"]["d"]["exact_duplicates"] == 1


def test_a_single_prompt_without_system_keeps_its_id():
    # (a) Most stored rows: one user turn, no system prompt: the id docs/manifest.md spells out, unchanged.
    prompts = ["Compute 50 + 76.", "  Écris un   poème\n sur la mer ", "ＦＵＬＬ width ½"]
    pool = build_pool(_manifest(), {"d": [_row("", p) for p in prompts]})
    assert sorted(e.sample_id for e in pool) == sorted(f"d-{_squashed_hash(p)[:16]}" for p in prompts)


def test_a_conversation_id_is_the_documented_hash_of_its_parts():
    # docs/manifest.md item 5: sha256 of "eaglenest.sample_id/2", a newline, and the JSON of each part's key.
    pool = build_pool(_manifest(), {"d": [_row("Be  brief.", "Hi", "There"), _row("", "Hi", "there")]})
    for system, user in (("Be  brief.", ["Hi", "There"]), ("", ["Hi", "there"])):
        parts = {"system": _squashed_hash(system) if system else None, "user": [_squashed_hash(t) for t in user]}
        key = hashlib.sha256(f"eaglenest.sample_id/2\n{json.dumps(parts, sort_keys=True)}".encode()).hexdigest()
        assert f"d-{key[:16]}" in {e.sample_id for e in pool}


def test_scheme_1_reproduces_the_ids_written_before():
    # A table written before keeps scheme 1: its pool is keyed as then, joined text and all.
    rows = [_row("Be brief.", "Hi"), _row("", "Hi", "there"), _row("", "Compute 50 + 76.")]
    pool = build_pool(_manifest(), {"d": rows}, id_scheme=1)
    want = {f"d-{_squashed_hash(chr(10).join([r['system'], r['prompt'], *r['later_turns']]))[:16]}" for r in rows}
    assert {e.sample_id for e in pool} == want
    # the collisions of scheme 1 are its own: kept in a table written under it
    assert len(build_pool(_manifest(), {"d": [_row("", "Hi", "there"), _row("", "Hi\nthere")]}, id_scheme=1)) == 1


def _legacy_store(uri: str, manifest: Manifest, rows: list[dict], target) -> list:
    """A prompts table as eaglenest wrote it before the scheme was recorded: scheme-1 ids, and a lineage
    without ``sample_id_scheme``; every prompt of the pool stored (answered or held out)."""
    tok = load_tokenizer(str(target), trust_remote_code=False)
    pool = build_pool(manifest, {"d": rows}, id_scheme=1)
    gen_id = gen_params_id(manifest.generation, tok.chat_template or "")
    answered, failures = regenerate(Scripted(tok), [e for e in pool if e.split == "train"], manifest.generation, gen_id)
    assert not failures
    lineage = {"stage": "ingest", "manifest": manifest.name, "manifest_hash": manifest.content_hash(),
               "gen_params_id": gen_id, "reasoning": "default", "chat_template_kwargs": {}}
    commit_fragments(uri, store.PROMPTS, write_rows(uri, answered + [heldout_row(e, gen_id) for e in pool
                                                                      if e.split == "heldout"]), lineage=lineage)
    return pool


def _stored(uri: str) -> dict[str, str]:
    t = store.read(uri, store.PROMPTS, columns=["sample_id", "split"])
    return dict(zip(t.column("sample_id").to_pylist(), t.column("split").to_pylist()))


ROWS = [_row("Be brief.", f"Question {i}?") for i in range(12)] + [_row("", f"Plain {i}", "and more")
                                                                    for i in range(12)]


def test_a_rerun_on_a_table_written_before_keeps_its_ids_and_splits(tmp_path, tiny_target):
    # (b) The table's rows carry scheme-1 ids: a re-run reads the scheme and keys its pool so; nothing is
    # stored twice or answered again, and a held-out prompt stays held out.
    manifest = _manifest(held_out_fraction=0.4)
    uri = str(tmp_path / "store")
    legacy = _legacy_store(uri, manifest, ROWS, tiny_target)
    before = _stored(uri)
    assert "heldout" in before.values() and "train" in before.values()
    assert stored_id_scheme(uri) == 1
    pool = build_pool(manifest, {"d": ROWS}, id_scheme=stored_id_scheme(uri))
    assert {e.sample_id: e.split for e in pool} == {e.sample_id: e.split for e in legacy} == before
    backend = Scripted(load_tokenizer(str(tiny_target), trust_remote_code=False))
    stats = build(manifest, pool, target=str(tiny_target), store_uri=uri, cfg=IngestConfig(), backend=backend,
                  id_scheme=stored_id_scheme(uri))
    assert stats["regenerated"] == stats["heldout_written"] == 0 and not backend.requests
    assert _stored(uri) == before and stats["split_changed"]["prompts"] == 0


def test_a_pool_of_another_scheme_is_refused_by_a_table_written_before(tmp_path, tiny_target):
    # Scheme-2 ids on a scheme-1 table: the system-prompt rows would be stored a second time.
    manifest = _manifest(held_out_fraction=0.4)
    uri = str(tmp_path / "store")
    _legacy_store(uri, manifest, ROWS, tiny_target)
    before = store.latest_version(uri, store.PROMPTS)
    backend = Scripted(load_tokenizer(str(tiny_target), trust_remote_code=False))
    with pytest.raises(ConfigError, match="holds sample ids of scheme 1, and this pool's are of scheme 2"):
        build(manifest, build_pool(manifest, {"d": ROWS}), target=str(tiny_target), store_uri=uri,
              cfg=IngestConfig(), backend=backend)
    assert store.latest_version(uri, store.PROMPTS) == before and not backend.requests


def test_ingest_build_reruns_on_a_table_written_before_without_storing_a_row_twice(tmp_path, root, tiny_target,
                                                                                    capsys):
    # (b) through the command: every prompt is stored already, under its scheme-1 id: nothing to do, no engine.
    src = tmp_path / "my data" / "rows.jsonl"
    src.parent.mkdir()
    src.write_text("".join(json.dumps({"prompt": r["prompt"], "system": r["system"]}) + "\n" for r in ROWS[:12]))
    mpath = tmp_path / "m.yaml"
    mpath.write_text(f"name: t\nlicence: x\nheld_out_fraction: 0.4\nraw_fraction: 0.0\ngeneration: {{max_tokens: 4}}\n"
                     f"domains:\n  d:\n    cap_prompts: 100\n    sources:\n      - path: '{src}'\n"
                     f"        system_field: system\n        provenance: p\n")
    manifest = load_manifest(mpath)
    work = tmp_path / "work"
    uri = str(work / "store")
    rows = [dict(r, source=str(src)) for r in ROWS[:12]]
    _legacy_store(uri, manifest, rows, tiny_target)
    before = _stored(uri)
    argv = ["build", f"--recipe={root / 'recipes' / 'toy.yaml'}", f"--manifest={mpath}", f"run.workdir={work}",
            f"run.store={uri}", f"run.target={tiny_target}"]
    assert ingest_main(argv) == 0
    stats = json.loads((work / "ingest" / "stats.json").read_text())
    assert stats["skipped_existing"] == stats["pool_size"] == len(before) and stats["regenerated"] == 0
    assert stats["sample_id_scheme"] == 1 and _stored(uri) == before


def test_the_scheme_is_recorded_with_every_commit_and_read_back(tmp_path, tiny_target):
    # (c) A new table: scheme 2 in each ingest commit's lineage (held-out shard too) and in the stats; a
    # re-run reads it back and finds everything stored.
    manifest = _manifest(held_out_fraction=0.4)
    uri = str(tmp_path / "store")
    tok = load_tokenizer(str(tiny_target), trust_remote_code=False)
    assert stored_id_scheme(uri) == 2  # no table yet: this eaglenest's scheme
    pool = build_pool(manifest, {"d": ROWS})
    stats = build(manifest, pool, target=str(tiny_target), store_uri=uri, cfg=IngestConfig(), backend=Scripted(tok))
    assert stats["sample_id_scheme"] == 2 and stats["heldout_written"] and stats["regenerated"]
    lineages = [v["lineage"] for v in versions.list_versions(uri, store.PROMPTS) if v["lineage"]]
    assert len(lineages) >= 2 and all(lin["sample_id_scheme"] == 2 for lin in lineages)
    assert stored_id_scheme(uri) == 2
    again = build(manifest, build_pool(manifest, {"d": ROWS}, id_scheme=stored_id_scheme(uri)),
                  target=str(tiny_target), store_uri=uri, cfg=IngestConfig(), backend=Scripted(tok))
    assert again["regenerated"] == again["heldout_written"] == 0 and again["skipped_existing"] == len(pool)


def test_the_scheme_outlives_compact_and_gc(tmp_path, tiny_target):
    # (c) The versions whose lineage records the scheme go with gc (the latest is compact's, which records
    # none): the scheme is read from the lineage gc keeps, not guessed as 1 for rows with no record.
    manifest = _manifest(held_out_fraction=0.4)
    uri = str(tmp_path / "store")
    tok = load_tokenizer(str(tiny_target), trust_remote_code=False)
    build(manifest, build_pool(manifest, {"d": ROWS}), target=str(tiny_target), store_uri=uri, cfg=IngestConfig(),
          backend=Scripted(tok))
    maintenance.compact(uri, store.PROMPTS)
    report = maintenance.gc(uri, store.PROMPTS, older_than_hours=0, grace_hours=0)
    assert report["old_versions_removed"] and len(report["versions_after"]) == 1
    assert stored_id_scheme(uri) == 2


def test_a_scheme_this_eaglenest_does_not_know_is_one_line(tmp_path, tiny_target):
    manifest = _manifest(held_out_fraction=0.4)
    uri = str(tmp_path / "store")
    tok = load_tokenizer(str(tiny_target), trust_remote_code=False)
    pool = build_pool(manifest, {"d": ROWS[:3]})
    gen_id = gen_params_id(manifest.generation, tok.chat_template or "")
    commit_fragments(uri, store.PROMPTS, write_rows(uri, [heldout_row(e, gen_id) for e in pool]),
                     lineage={"stage": "ingest", "sample_id_scheme": 7})
    with pytest.raises(StoreError, match="records sample-id scheme 7, which this eaglenest does not know"):
        stored_id_scheme(uri)


def test_contamination_still_matches_user_text_under_a_system_prompt(tmp_path):
    # (d) The check compares user turns, as before: a training chat under a system prompt, or a later turn of
    # one, equal to an evaluation prompt or to a held-out question is dropped.
    evals = tmp_path / "question.jsonl"
    evals.write_text(json.dumps({"turns": ["What is the capital of France?"]}) + "\n")
    src = {"sources": [{"path": "x", "provenance": "p"}]}
    manifest = build_cfg(Manifest, {"name": "t", "licence": "x", "raw_fraction": 0.0,
                                    "contamination": {"mt_bench": [str(evals)]},
                                    "domains": {"h": {"cap_prompts": 5, "held_out_count": 1, **src},
                                                "d": {"cap_prompts": 100, "held_out_count": 0, **src}}})
    rows = [_row("Be brief.", "what is the capital of  FRANCE?"), _row("", "Hello", "WHAT is the capital of France?"),
            _row("Answer in French.", "Name a colour."), _row("", "Hello", "name a COLOUR."), _row("", "Unrelated.")]
    pool = build_pool(manifest, {"h": [_row("", "name a colour.")], "d": rows})
    assert [e.prompt for e in pool if e.split == "heldout"] == ["name a colour."]
    kept, report = contamination.check(pool, manifest)
    assert [(e.system, e.prompt, *e.later_turns) for e in kept] == [("", "name a colour."), ("", "Unrelated.")]
    assert report["by_reason"] == {"exact:eval": 2, "exact:heldout": 2}


def test_evaluation_excludes_a_prompt_trained_on_under_a_system_prompt(tmp_path, tiny_target):
    # (d) evaluate's overlap check reads the stored messages (user text alone and with the system prompt),
    # not the ids: a scheme-2 table's training chat under a system prompt still excludes its question.
    manifest = _manifest()
    uri = str(tmp_path / "store")
    tok = load_tokenizer(str(tiny_target), trust_remote_code=False)
    pool = build_pool(manifest, {"d": [_row("Be brief.", "What is 2 + 2?"), _row("", "Name a colour.")]})
    build(manifest, pool, target=str(tiny_target), store_uri=uri, cfg=IngestConfig(), backend=Scripted(tok))
    groups = {"g": [{"sample_id": "q1", "messages": [{"role": "user", "content": "what is 2 + 2?"}]},
                    {"sample_id": "q2", "messages": [{"role": "system", "content": "be brief."},
                                                     {"role": "user", "content": "What is 2 + 2?"}]},
                    {"sample_id": "q3", "messages": [{"role": "user", "content": "Something new."}]}]}
    kept, dropped = exclude_overlap(groups, training_keys(uri))
    assert sorted(dropped) == ["q1", "q2"] and [p["sample_id"] for p in kept["g"]] == ["q3"]


def test_load_pool_keys_a_pool_with_the_scheme_given(tmp_path):
    src = tmp_path / "rows.jsonl"
    src.write_text(json.dumps({"prompt": "Hi", "system": "Be brief."}) + "\n")
    manifest = build_cfg(Manifest, {"name": "t", "licence": "x", "held_out_fraction": 0.0, "domains": {
        "d": {"cap_prompts": 5, "sources": [{"path": str(src), "system_field": "system", "provenance": "p"}]}}})
    old, new = (load_pool(manifest, id_scheme=s)[0].sample_id for s in (1, 2))
    assert old == f"d-{_squashed_hash('Be brief.' + chr(10) + 'Hi')[:16]}" and new != old


def test_the_manifests_of_a_table_are_named_after_gc_too(tmp_path, tiny_target):
    # stats.json's "manifests" (and the warning that two manifests' pools are mixed) read the commits' lineage:
    # after gc removed the first manifest's versions, the table seemed to hold the second's pool alone.
    uri = str(tmp_path / "store")
    tok = load_tokenizer(str(tiny_target), trust_remote_code=False)
    for name, rows in (("first", ROWS[:6]), ("second", ROWS[6:])):
        manifest = _manifest(name=name)
        build(manifest, build_pool(manifest, {"d": rows}), target=str(tiny_target), store_uri=uri,
              cfg=IngestConfig(), backend=Scripted(tok))
    maintenance.gc(uri, store.PROMPTS, older_than_hours=0, grace_hours=0)
    manifest = _manifest(name="third")
    stats = build(manifest, build_pool(manifest, {"d": ROWS[:6]}), target=str(tiny_target), store_uri=uri,
                  cfg=IngestConfig(), backend=Scripted(tok))
    assert stats["manifests"] == ["first", "second"]  # the third added nothing: no commit of its own


def test_evaluation_excludes_a_question_asked_in_a_training_chat(tmp_path, tiny_target):
    # A multi-turn training row trains on the target's answer to its last turn: an evaluation question equal to
    # that turn (or to any turn, or to a long chat's prompt after its fact preamble: the turns ingest's
    # contamination check compares) was measured on data the draft was trained on.
    uri = str(tmp_path / "store")
    tok = load_tokenizer(str(tiny_target), trust_remote_code=False)
    chat = PoolEntry(sample_id="d-chat", domain="d", source="s", split="train", mode="chat", system="Be brief.",
                     prompt="Hello there.", later_turns=("What is 2 + 2?",))
    long_chat = PoolEntry(sample_id="d-long", domain="d", source="compose:long_chat:2048", split="train",
                          mode="chat", system="", prompt="Please remember this for later: my room number is 12."
                          "\n\nName a colour.", later_turns=("At the very start of this chat I told you my room "
                                                             "number. What is it? Answer in one sentence.",))
    build(_manifest(), [chat, long_chat], target=str(tiny_target), store_uri=uri, cfg=IngestConfig(),
          backend=Scripted(tok))
    asked = {"q1": "what is 2 + 2?", "q2": "Hello there.", "q3": "Name a colour.", "q4": "Something new."}
    groups = {"g": [{"sample_id": q, "messages": [{"role": "user", "content": t}]} for q, t in asked.items()]}
    kept, dropped = exclude_overlap(groups, training_keys(uri))
    assert sorted(dropped) == ["q1", "q2", "q3"] and [p["sample_id"] for p in kept["g"]] == ["q4"]
