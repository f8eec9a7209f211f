"""QA repros for ``evaluate`` (fifth pass): what the log alone said (context buckets merged on a
short-context target, published questions skipped for an empty first turn) is in report.json and
report.md; a draft of another family than ``train.family`` is refused; compare names reports whose
groups or buckets differ. Only the merged-bucket test starts an engine (the tiny target, a few tokens)."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest

from eaglenest.engine import EngineConfig
from eaglenest.errors import ConfigError
from eaglenest.evaluate.cli import main as evaluate_main
from eaglenest.evaluate.compare import differences, side_by_side
from eaglenest.evaluate.config import EvaluateConfig
from eaglenest.evaluate.plan import plan
from eaglenest.evaluate.prompts import load_prompt_set
from eaglenest.evaluate.report import markdown
from eaglenest.evaluate.run import evaluate_al


def _jsonl(path, *rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _row(al=1.5):
    return {"prompts": 1, "acceptance_length": al, "acceptance_length_per_request": al, "acceptance_rate": 0.25,
            "acceptance_by_position": [0.5, 0.0]}


def _report(**over):
    rep = {"target": "t", "draft": "d", "split": "heldout", "num_speculative_tokens": 2, "temperature": 0.0,
           "max_tokens": 8, "bucket_max_tokens": 8, "chat_template_kwargs": {}, "al_average": "pooled",
           "overall": _row(), "domains": {"a": _row()}, "context_buckets": {}}
    return {**rep, **over}


def test_questions_skipped_for_an_empty_first_turn_are_in_the_report(tmp_path, prompts_store):
    """Published questions with an empty first turn were skipped with a log line only: report.json's
    prompt counts and report.md said nothing of them."""
    path = _jsonl(tmp_path / "question.jsonl", {"question_id": 1, "category": "writing", "turns": ["Hi there."]},
                  {"question_id": 7, "category": "writing", "turns": ["", "Then?"]},
                  {"question_id": "q9", "category": "coding", "turns": [" \n"]})
    groups, info = load_prompt_set(EvaluateConfig(prompt_set="mt_bench", prompt_path=path), prompts_store)
    assert list(groups) == ["writing"]
    assert (info["empty_first_turn"], info["empty_first_turn_ids"]) == (2, ["7", "q9"])
    line = next(ln for ln in markdown(_report(prompts=info)).splitlines() if ln.startswith("- Prompts loaded"))
    assert "skipped for an empty first turn: 2 (question_id 7, q9)" in line


def test_a_report_without_skipped_questions_says_nothing_of_them(prompts_store):
    _, info = load_prompt_set(EvaluateConfig(), prompts_store)
    assert info["empty_first_turn"] == 0
    assert "empty first turn" not in markdown(_report(prompts=info))


@pytest.fixture
def short_target(tmp_path, tiny_target):
    """The tiny target with 1032 positions: buckets 1024 and 2048 both shorten to 1024 prompt tokens
    beside 8 output tokens."""
    dst = tmp_path / "short-target"
    shutil.copytree(tiny_target, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["max_position_embeddings"] = 1032
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_buckets_merged_on_a_short_target_are_in_the_report(short_target, random_draft, prompts_store):
    """``evaluate.context_buckets=[256,1024,2048]`` on a 1032-position target: 2048 was decoded as 1024
    and dropped from report.json with a warning in the log only; a reader saw two buckets of three. The
    long-context path end to end on a short target: per-bucket AL, the lossless pass, far context."""
    cfg = EvaluateConfig(num_speculative_tokens=2, max_tokens=4, bucket_max_tokens=8, max_prompts_per_domain=1,
                         context_buckets=(256, 1024, 2048), bucket_material=("records",), ngram_order=0,
                         engine=EngineConfig(max_model_len=1032))
    report = evaluate_al(target=str(short_target), draft=str(random_draft), store_uri=prompts_store, cfg=cfg)
    assert sorted(report["context_buckets"], key=int) == ["256", "1024"]
    assert report["context_buckets"]["1024"]["prompt_tokens"] == 1024
    assert report["context_buckets_merged"] == {"1024": [2048]}
    assert json.loads(json.dumps(report))["context_buckets_merged"] == {"1024": [2048]}  # as report.json holds it
    md = markdown(report).splitlines()
    assert ("- Buckets 2048 shorten to the prompt tokens of bucket 1024 (the target's positions less 8 output "
            "tokens): decoded once, reported as bucket 1024.") in md
    # The records answer has no room after a 1024-token prompt within 1032 positions: its value was left
    # unscored with a log line only, the bucket's far_context silent about it.
    far = report["context_buckets"]["1024"]["far_context"]
    assert far["answers_unscored"] == ["ctx1024-0"] and "answer_prompts" not in far
    why = report["context_buckets"]["1024"]["per_prompt"][0]["answer_unscored"]
    assert why.startswith("its answer's ") and "do not fit the engine's 1032 positions after its 1024 prompt" in why
    assert ("- Bucket 1024: answer value not scored for ctx1024-0: no room for the answer after the prompt within "
            "the engine's max_model_len.") in md


def test_the_default_max_model_len_fits_a_target_of_fewer_positions(short_target, prompts_store):
    """The engine's default max_model_len (4096) on a 1032-position target: every `evaluate al` failed at
    the engine's start ("engine.max_model_len: 4096 is more than ... has positions for") though the user
    set nothing. The default is the target's positions there; a value given explicitly is kept, and one
    past the positions is refused before any engine, naming the key and the limit."""
    cfg = EvaluateConfig(num_speculative_tokens=2, max_tokens=4, max_prompts_per_domain=1, context_buckets=())
    assert plan(cfg, target=str(short_target), store_uri=prompts_store).engine.max_model_len == 1032
    explicit = dataclasses.replace(cfg, engine=EngineConfig(max_model_len=1024))
    assert plan(explicit, target=str(short_target), store_uri=prompts_store).engine.max_model_len == 1024
    too_long = dataclasses.replace(cfg, engine=EngineConfig(max_model_len=2048))
    with pytest.raises(ConfigError, match=r"^evaluate\.engine\.max_model_len: 2048 is more than .* has positions "
                                          r"for \(max_position_embeddings=1032\); set evaluate\.engine\."
                                          r"max_model_len=1032"):
        plan(too_long, target=str(short_target), store_uri=prompts_store)


def _family_argv(root, tmp_path, tiny_target, draft, family):
    return ["al", f"--recipe={root / 'recipes' / 'toy.yaml'}", f"run.workdir={tmp_path / 'w'}",
            f"run.target={tiny_target}", f"evaluate.draft={draft}", f"train.family={family}",
            "evaluate.chat_template_kwargs={}"]


@pytest.mark.parametrize("command", ["al", "throughput", "offline", "parity"])
def test_a_draft_of_another_family_is_refused(tmp_path, root, tiny_target, toy_export, capsys, command):
    """``evaluate al train.family=dflash`` with an EAGLE-3 export measured the EAGLE-3 draft without a word
    (and ``serve export`` refuses the same mismatch)."""
    argv = _family_argv(root, tmp_path, tiny_target, toy_export, "dflash")
    assert evaluate_main([command, *argv[1:]]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert f"train.family=dflash: the draft {toy_export} is a eagle3 draft" in err


def test_a_peagle_export_is_named_as_such(tmp_path, root, tiny_target, toy_export, capsys):
    draft = tmp_path / "peagle"
    shutil.copytree(toy_export, draft)
    cfg = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps({**cfg, "parallel_drafting": True}))
    assert evaluate_main(_family_argv(root, tmp_path, tiny_target, draft, "dflash")) == 2
    assert f"train.family=dflash: the draft {draft} is a peagle draft" in capsys.readouterr().err


def test_compare_names_reports_with_different_groups_and_buckets():
    """Two reports over different domains (and buckets): the overall delta compared unlike prompt sets and
    compare.md did not say so."""
    a = _report(domains={"a": _row(), "b": _row()}, context_buckets={"1024": _row()})
    b = _report(domains={"a": _row(2.0)}, context_buckets={"1024": _row(), "2048": _row()})
    diff = differences(a, b)
    assert diff["groups"] == [["a", "b"], ["a"]]
    assert diff["context_buckets"] == [["1024"], ["1024", "2048"]]
    md = side_by_side(a, b)
    assert "groups A `['a', 'b']`, B `['a']`" in md and "context_buckets A `['1024']`, B `['1024', '2048']`" in md
    assert differences(a, _report(domains={"b": _row(2.0), "a": _row()}, context_buckets={"1024": _row(9)})) == {}


@pytest.mark.parametrize("edit", [lambda r: r.pop("num_speculative_tokens"),
                                  lambda r: r["overall"].pop("acceptance_length"),
                                  lambda r: r.update(domains=["a"])])
def test_a_hand_edited_report_under_the_same_key_is_measured_again(tmp_path, root, tiny_target, monkeypatch,
                                                                   capsys, edit):
    """report.json edited by hand (a key removed, a group list for the groups) kept its cache_key: the next
    ``evaluate al`` took it as this run's measurement and died with a KeyError traceback while showing it."""
    import eaglenest.evaluate.commands as commands

    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text("{}")
    calls = []
    monkeypatch.setattr(commands, "evaluate_al", lambda **kw: calls.append(kw) or _report())
    argv = ["al", f"--recipe={root / 'recipes' / 'toy.yaml'}", f"run.workdir={tmp_path / 'work'}",
            f"run.target={tiny_target}", f"evaluate.draft={draft}", "evaluate.num_speculative_tokens=2",
            "evaluate.chat_template_kwargs={}", "evaluate.context_buckets=[]"]
    assert evaluate_main(argv) == 0 and len(calls) == 1
    path = tmp_path / "work" / "eval" / "report.json"
    report = json.loads(path.read_text())
    edit(report)
    path.write_text(json.dumps(report))
    assert evaluate_main(argv) == 0
    assert len(calls) == 2  # measured again, not shown
    assert "already measures this draft" not in capsys.readouterr().err
    assert json.loads(path.read_text()) == {**_report(), "cache_key": report["cache_key"]}


@pytest.mark.parametrize("as_file", [False, True])
def test_compare_does_not_write_into_a_compared_reports_folder(tmp_path, root, tiny_target, capsys, as_file):
    """``evaluate compare --a runs/x/eval --b other.json --out runs/x/eval``: compare.md, compare.json and
    its provenance.json went into the `evaluate al` folder, replacing that run's provenance.json (the
    docs: no `evaluate` command writes its provenance.json over another's)."""
    ev = tmp_path / "eval"
    ev.mkdir()
    (ev / "report.json").write_text(json.dumps(_report()))
    (ev / "provenance.json").write_text('{"argv": ["evaluate", "al"]}')
    other = tmp_path / "other.json"
    other.write_text(json.dumps(_report(draft="e")))
    a = ev / "report.json" if as_file else ev
    assert evaluate_main(["compare", f"--recipe={root / 'recipes' / 'toy.yaml'}", f"run.workdir={tmp_path / 'w'}",
                          f"run.target={tiny_target}", "evaluate.chat_template_kwargs={}", "--a", str(a),
                          "--b", str(other), "--out", str(ev)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"evaluate: error: --out: {ev} is the --a draft or report folder: this command's provenance.json "
                   "and report would replace its own; write the output elsewhere")
    assert (ev / "provenance.json").read_text() == '{"argv": ["evaluate", "al"]}'
    assert sorted(p.name for p in ev.iterdir()) == ["provenance.json", "report.json"]
    # Into a folder of two plain report files (no provenance.json there): allowed.
    assert evaluate_main(["compare", f"--recipe={root / 'recipes' / 'toy.yaml'}", f"run.workdir={tmp_path / 'w'}",
                          f"run.target={tiny_target}", "evaluate.chat_template_kwargs={}", "--a", str(other),
                          "--b", str(other), "--out", str(tmp_path)]) == 0
    assert (tmp_path / "compare.md").is_file()


def _prompts_store(path, rows) -> str:
    import pyarrow as pa

    from eaglenest.featurestore import schema as S
    from eaglenest.featurestore.table import store

    uri = str(path / "store")
    table = [dict(sample_id=sid, domain=domain, source="test", split=split, mode="chat",
                  messages_json=json.dumps([{"role": "user", "content": text}]), prompt_token_ids=[],
                  response_token_ids=[], finish_reason="", gen_params_id="g") for sid, domain, split, text in rows]
    store.append(uri, store.PROMPTS, pa.Table.from_pylist(table, schema=S.PROMPTS_SCHEMA))
    return uri


def test_domains_without_heldout_prompts_are_named_in_the_report(tmp_path):
    """A manifest domain too small to hold a prompt out (``tiny``: train rows only), and one whose every
    held-out prompt repeats a training prompt (``twin``): both vanished from the report's groups without
    a word, as if the manifest had not named them."""
    uri = _prompts_store(tmp_path, [("a0", "arith", "heldout", "What is 2 + 2?"),
                                    ("t0", "tiny", "train", "Say hi."),
                                    ("w0", "twin", "train", "Name a colour."),
                                    ("w1", "twin", "heldout", "name a  colour.")])
    groups, info = load_prompt_set(EvaluateConfig(), uri)
    assert list(groups) == ["arith"]
    assert info["domains_not_evaluated"] == {"tiny": "no 'heldout' prompts",
                                             "twin": "every prompt overlaps the training pool"}
    line = next(ln for ln in markdown(_report(prompts=info)).splitlines() if ln.startswith("- Prompts loaded"))
    assert line.endswith("; not evaluated: tiny (no 'heldout' prompts), twin (every prompt overlaps the training "
                         "pool).")
    _, info = load_prompt_set(EvaluateConfig(exclude_overlap=False), uri)
    assert info["domains_not_evaluated"] == {"tiny": "no 'heldout' prompts"}


def test_overall_has_the_target_confidence_of_every_group():
    """``target_confidence`` was set per group and bucket but not overall: report.md's overall row read
    ``-`` beside the overall ngram_al."""
    from eaglenest.evaluate.run import predictability

    report = _report(domains={"a": _row(), "b": _row()})
    groups = {"a": [{"sample_id": "a0"}], "b": [{"sample_id": "b0"}, {"sample_id": "b1"}]}
    probs = {"a0": [1.0, 0.5], "b0": [0.25], "b1": [0.25, 0.5, 0.5]}
    report["predictability"] = predictability(report, groups, {}, probs)
    assert (report["domains"]["a"]["target_confidence"], report["domains"]["b"]["target_confidence"]) == (0.75, 0.375)
    assert report["overall"]["target_confidence"] == 0.5  # 3.0 over 6 tokens, not the mean of the groups' means
    overall = next(ln for ln in markdown(report).splitlines() if ln.startswith("| **overall**"))
    assert overall.startswith("| **overall** | 0.500 |")


def test_compare_refuses_a_draft_of_another_family(tmp_path, root, tiny_target, toy_export, capsys, monkeypatch):
    import eaglenest.evaluate.compare as compare_mod

    evaluated = []
    monkeypatch.setattr(compare_mod, "evaluate_al", lambda **kw: evaluated.append(kw) or _report())
    argv = _family_argv(root, tmp_path, tiny_target, toy_export, "peagle")[1:]
    assert evaluate_main(["compare", *argv, "--a", str(toy_export), "--b", str(toy_export)]) == 2
    assert f"train.family=peagle: the draft {toy_export} is a eagle3 draft" in capsys.readouterr().err
    assert evaluated == []  # refused before either draft was served
