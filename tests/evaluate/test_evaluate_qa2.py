"""Second QA pass over ``evaluate`` (no engine started: the measurement is stubbed where one would run).

Each test names the input that went wrong; see the docstrings for the symptom before the fix.
"""

from __future__ import annotations

import json

import pytest

from eaglenest.evaluate.cli import main as evaluate_main


def _draft(path, k: int):
    """A draft folder whose config.json records ``k`` as its recommended tokens a round (a P-EAGLE or
    DFlash export records another K than EAGLE-3's 3)."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"recommended_num_speculative_tokens": k}))
    return path


def _row(al: float = 2.5) -> dict:
    return {"prompts": 2, "acceptance_length": al, "acceptance_length_per_request": al,
            "acceptance_rate": 0.5, "acceptance_by_position": [0.5]}


def _report(draft: str = "d", **extra) -> dict:
    return {"draft": draft, "target": "t", "num_speculative_tokens": 3, "temperature": 0.0, "split": "heldout",
            "domains": {"code": _row()}, "overall": _row(), "context_buckets": {}, **extra}


def test_compare_serves_each_draft_at_its_own_k(tmp_path, root, tiny_target, monkeypatch):
    """``evaluate compare --a EAGLE3 --b DFLASH``: both drafts were served at the K of the recipe's
    draft (``<workdir>/draft``, or the train family's best), not at the K each draft records."""
    import eaglenest.evaluate.compare as compare_mod

    served = []

    def stub_evaluate_al(*, draft, cfg, **kwargs):  # stands in for the engine: records the K it got
        served.append((draft, cfg.num_speculative_tokens))
        return _report(draft)

    monkeypatch.setattr(compare_mod, "evaluate_al", stub_evaluate_al)
    a, b = _draft(tmp_path / "a", 2), _draft(tmp_path / "b", 7)
    code = evaluate_main(["compare", f"--recipe={root / 'recipes' / 'toy.yaml'}", f"run.workdir={tmp_path / 'w'}",
                          f"run.target={tiny_target}", "evaluate.chat_template_kwargs={}",
                          "--a", str(a), "--b", str(b)])
    assert code == 0
    assert served == [(str(a), 2), (str(b), 7)]


def test_compare_keeps_a_k_the_recipe_sets(tmp_path, root, tiny_target, monkeypatch):
    import eaglenest.evaluate.compare as compare_mod

    served = []
    monkeypatch.setattr(compare_mod, "evaluate_al",
                        lambda *, draft, cfg, **kw: served.append(cfg.num_speculative_tokens) or _report(draft))
    a, b = _draft(tmp_path / "a", 2), _draft(tmp_path / "b", 7)
    assert evaluate_main(["compare", f"--recipe={root / 'recipes' / 'toy.yaml'}", f"run.workdir={tmp_path / 'w'}",
                          f"run.target={tiny_target}", "evaluate.chat_template_kwargs={}",
                          "evaluate.num_speculative_tokens=4", "--a", str(a), "--b", str(b)]) == 0
    assert served == [4, 4]


def test_offline_serves_the_given_draft_at_its_own_k(tmp_path, root, tiny_target, monkeypatch):
    """``evaluate offline --draft D``: D was replayed at the K of ``<workdir>/draft`` (here another
    draft recording 2), not at the K D records (5)."""
    import eaglenest.evaluate.commands as commands

    got = {}

    def stub_offline_al(*, num_speculative_tokens, **kwargs):  # stands in for the HF decode
        got["k"] = num_speculative_tokens
        return {"overall": _row(), "domains": {}}

    monkeypatch.setattr(commands, "offline_al", stub_offline_al)
    monkeypatch.setattr(commands, "load_prompt_set", lambda cfg, uri: ({}, {}))
    work = tmp_path / "w"
    _draft(work / "draft", 2)
    given = _draft(tmp_path / "given", 5)
    assert evaluate_main(["offline", f"--recipe={root / 'recipes' / 'toy.yaml'}", f"run.workdir={work}",
                          f"run.target={tiny_target}", "evaluate.chat_template_kwargs={}",
                          "--draft", str(given)]) == 0
    assert got["k"] == 5


def test_offline_replays_a_dflash_checkpoint_at_its_family_k(tmp_path, root, tiny_target, monkeypatch):
    """``evaluate offline --draft CKPT`` with a DFlash train checkpoint (no config.json to record a K):
    it was replayed at the recipe's family's K (EAGLE-3: 3), not at DFlash's (7)."""
    import eaglenest.evaluate.commands as commands

    got = {}
    monkeypatch.setattr(commands, "offline_al",  # stands in for the HF decode: records the K it got
                        lambda *, num_speculative_tokens, **kw: got.update(k=num_speculative_tokens)
                        or {"overall": _row(), "domains": {}})
    monkeypatch.setattr(commands, "load_prompt_set", lambda cfg, uri: ({}, {}))
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "checkpoint.json").write_text(json.dumps({"train_config": {"family": "dflash"}}))
    assert evaluate_main(["offline", f"--recipe={root / 'recipes' / 'toy.yaml'}", f"run.workdir={tmp_path / 'w'}",
                          f"run.target={tiny_target}", "evaluate.chat_template_kwargs={}",
                          "--draft", str(ckpt)]) == 0
    assert got["k"] == 7


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "1" + "0" * 400])
def test_compare_refuses_a_non_finite_al_naming_the_key(capsys, tmp_path, root, value):
    """A report edited by hand (or written by a NaN draft) with ``"acceptance_length": NaN``: Python's
    json reads it, compare printed ``nan`` deltas and wrote compare.json with a bare NaN, which no
    strict JSON reader (jq, JavaScript, Go) accepts; an integer past every float raised OverflowError
    (a traceback) when the table formatted it."""
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps(_report()))
    bad.write_text(json.dumps(_report()).replace('"overall": {"prompts": 2, "acceptance_length": 2.5',
                                                   f'"overall": {{"prompts": 2, "acceptance_length": {value}'))
    assert f'"acceptance_length": {value}' in bad.read_text()
    work = tmp_path / "work"
    code = evaluate_main(["compare", f"--recipe={root / 'recipes' / 'toy.yaml'}", f"run.workdir={work}",
                          "--a", str(good), "--b", str(bad)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert f"{bad}: overall.acceptance_length: not a finite number" in lines[0], lines[0]
    assert not work.exists()


def _al_report(buckets: dict) -> dict:
    row = {**_row(), "prompt_tokens": 1024}
    return {**_report(), "al_average": "pooled", "context_buckets": {b: dict(row) for b in buckets}}


def test_a_rerun_without_buckets_leaves_no_context_plot_behind(tmp_path):
    """``evaluate al --force evaluate.context_buckets=[]`` into a folder measured with buckets: the new
    report.json has no buckets, but the old run's al_by_context.png stayed beside it, a plot of another
    measurement."""
    from eaglenest.evaluate.report import write_report

    write_report(tmp_path, _al_report(["1024"]))
    assert (tmp_path / "al_by_context.png").is_file()
    pngs = write_report(tmp_path, _al_report([]))
    assert sorted(p.name for p in tmp_path.glob("*.png")) == sorted(p.name for p in pngs) \
        == ["acceptance_by_position.png", "al_by_domain.png"]


def test_offline_refuses_a_prompt_past_the_targets_positions(tmp_path, root, tiny_target, toy_export, capfd):
    """``evaluate offline`` on a question longer than the target's positions: vLLM (``evaluate al``)
    refuses it before its engine starts, the offline replay decoded it past the positions the target
    was built for and reported an AL for it (exit 0)."""
    import shutil

    target = tmp_path / "target"
    shutil.copytree(tiny_target, target)
    cfg = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 64}))
    questions = tmp_path / "question.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "c", "turns": ["Hello."]}) + "\n"
                         + json.dumps({"question_id": 2, "category": "c", "turns": ["word " * 80]}) + "\n")
    work = tmp_path / "w"
    code = evaluate_main(["offline", f"--recipe={root / 'recipes' / 'toy.yaml'}", f"run.workdir={work}",
                          f"run.target={target}", "evaluate.chat_template_kwargs={}", "--draft", str(toy_export),
                          "evaluate.prompt_set=mt_bench", f"evaluate.prompt_path={questions}",
                          "evaluate.max_tokens=4", "evaluate.num_speculative_tokens=2"])
    err = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1, err
    assert "prompt mt_bench-2 has" in err[0] and "within the target's 64 positions" in err[0], err[0]
    assert not work.exists()


def _heldout(work, **prompts: str) -> None:
    """``<work>/store``'s prompts table: one held-out prompt per ``sample_id=text``."""
    import pyarrow as pa

    from eaglenest.featurestore import schema as S
    from eaglenest.featurestore.table import store

    rows = [dict(sample_id=sid, domain="d", source="test", split="heldout", mode="chat",
                 messages_json=json.dumps([{"role": "user", "content": text}]), prompt_token_ids=[],
                 response_token_ids=[], finish_reason="", gen_params_id="g") for sid, text in prompts.items()]
    store.append(str(work / "store"), store.PROMPTS, pa.Table.from_pylist(rows, schema=S.PROMPTS_SCHEMA))


def test_parity_refuses_a_prompt_past_max_model_len_before_the_engine(tmp_path, root, tiny_target, toy_export,
                                                                      toy_checkpoint, monkeypatch, capfd):
    """``evaluate parity`` on a held-out prompt longer than ``evaluate.engine.max_model_len``: vLLM
    refuses it only once its engine has started (its ValueError, not one line); ``evaluate al`` and
    ``throughput`` refuse such a prompt first, naming the key to raise."""
    import eaglenest.evaluate.commands as commands

    def never(**kwargs):
        raise AssertionError("the parity engine started on a prompt it cannot take")

    monkeypatch.setattr(commands, "parity_check", never)
    work = tmp_path / "w"
    _heldout(work, short="Hello.", long="word " * 600)
    code = evaluate_main(["parity", f"--recipe={root / 'recipes' / 'toy.yaml'}", f"run.workdir={work}",
                          f"run.target={tiny_target}", "evaluate.chat_template_kwargs={}",
                          f"evaluate.draft={toy_export}", "--checkpoint", str(toy_checkpoint),
                          "evaluate.engine.max_model_len=256", "evaluate.num_speculative_tokens=2"])
    err = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1, err
    assert "evaluate.engine.max_model_len: prompt long has" in err[0], err[0]
    assert not (work / "parity").exists()


@pytest.mark.parametrize("command", ["al", "offline"])
def test_out_into_the_draft_folder_is_refused_keeping_its_provenance(tmp_path, root, tiny_target, toy_export,
                                                                     monkeypatch, capsys, command):
    """``evaluate al --out runs/toy/draft`` (the report kept beside the draft): the export's
    provenance.json, which ``serve push`` publishes, was replaced by the evaluation's."""
    import shutil

    import eaglenest.evaluate.commands as commands

    monkeypatch.setattr(commands, "evaluate_al", lambda **kw: pytest.fail("measured into the draft folder"))
    monkeypatch.setattr(commands, "offline_al", lambda **kw: pytest.fail("measured into the draft folder"))
    draft = tmp_path / "draft"
    shutil.copytree(toy_export, draft)
    before = {p.name: p.read_bytes() for p in draft.iterdir()}
    code = evaluate_main([command, f"--recipe={root / 'recipes' / 'toy.yaml'}", f"run.workdir={tmp_path / 'w'}",
                          f"run.target={tiny_target}", f"evaluate.draft={draft}", "evaluate.chat_template_kwargs={}",
                          "--out", str(draft)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert f"--out: {draft} is the draft folder" in lines[0], lines[0]
    assert {p.name: p.read_bytes() for p in draft.iterdir()} == before


def test_out_into_the_train_folder_is_refused(tmp_path, root, tiny_target, toy_export, toy_checkpoint, monkeypatch,
                                              capsys):
    """``evaluate al --out <workdir>/train``: the train run's own report.json and provenance.json were
    replaced by the evaluation's."""
    import shutil

    import eaglenest.evaluate.commands as commands

    monkeypatch.setattr(commands, "evaluate_al", lambda **kw: pytest.fail("measured into the train folder"))
    train = tmp_path / "w" / "train"
    shutil.copytree(toy_checkpoint, train)
    code = evaluate_main(["al", f"--recipe={root / 'recipes' / 'toy.yaml'}", f"run.workdir={tmp_path / 'w'}",
                          f"run.target={tiny_target}", f"evaluate.draft={toy_export}",
                          "evaluate.chat_template_kwargs={}", "--out", str(train)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert f"--out: {train} is the checkpoint folder" in lines[0], lines[0]


def test_compare_says_when_the_reports_were_not_measured_alike(tmp_path, root, capsys):
    """Two reports of different targets and K (or temperature, prompt set, ...): compare printed their
    deltas as if the drafts alone differed."""
    a, b, same = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "same.json"
    a.write_text(json.dumps(_report("d1")))
    b.write_text(json.dumps(_report("d2", target="other", num_speculative_tokens=7)))
    same.write_text(json.dumps(_report("d3")))
    work = tmp_path / "w"
    argv = ["compare", f"--recipe={root / 'recipes' / 'toy.yaml'}", f"run.workdir={work}", "--a", str(a)]
    assert evaluate_main([*argv, "--b", str(b)]) == 0
    out = capsys.readouterr().out
    assert "**Not measured alike**, the deltas mix in: target A `t`, B `other`; num_speculative_tokens A `3`, " \
           "B `7`." in out, out
    assert json.loads((work / "compare" / "compare.json").read_text())["settings_differ"] == \
        {"target": ["t", "other"], "num_speculative_tokens": [3, 7]}
    assert evaluate_main([*argv, "--b", str(same)]) == 0
    assert "Not measured alike" not in capsys.readouterr().out
    assert json.loads((work / "compare" / "compare.json").read_text())["settings_differ"] == {}


def test_a_rerun_killed_while_writing_does_not_leave_the_old_report_marking_it_done(tmp_path, root, tiny_target,
                                                                                    monkeypatch, capsys):
    """Measured with K=2 (complete), then K=3 killed while its plots were written: report.md,
    provenance.json and the plots were K=3's but the K=2 report.json stayed, so a third run with K=2
    said "already measures this draft" over a folder describing another measurement."""
    import eaglenest.evaluate.commands as commands
    import eaglenest.evaluate.report as report_mod

    calls = []

    def stub_evaluate_al(*, cfg, **kwargs):  # stands in for the engine
        calls.append(cfg.num_speculative_tokens)
        return {**_al_report([]), "num_speculative_tokens": cfg.num_speculative_tokens}

    monkeypatch.setattr(commands, "evaluate_al", stub_evaluate_al)
    draft = _draft(tmp_path / "draft", 2)
    out = tmp_path / "work" / "eval"

    def run(k: int) -> int:
        return evaluate_main(["al", f"--recipe={root / 'recipes' / 'toy.yaml'}", f"run.workdir={tmp_path / 'work'}",
                              f"run.target={tiny_target}", f"evaluate.draft={draft}",
                              f"evaluate.num_speculative_tokens={k}", "evaluate.chat_template_kwargs={}"])

    assert run(2) == 0 and calls == [2]
    real_plots = report_mod.al_plots
    monkeypatch.setattr(report_mod, "al_plots", lambda *a, **kw: (_ for _ in ()).throw(KeyboardInterrupt))
    assert run(3) == 130 and calls == [2, 3]
    assert "`t`, 3 speculative tokens" in (out / "report.md").read_text()  # K=3's, beside K=2's report.json
    monkeypatch.setattr(report_mod, "al_plots", real_plots)
    capsys.readouterr()
    assert run(2) == 0 and calls == [2, 3, 2], calls  # measured again: the folder no longer holds K=2's run
    assert "already measures" not in capsys.readouterr().err
    assert json.loads((out / "report.json").read_text())["num_speculative_tokens"] == 2


def test_a_category_with_dollar_signs_does_not_lose_the_report(tmp_path):
    """A question file whose category holds two ``$`` (``costs $x^$ more``): matplotlib read the tick
    label as TeX and raised while drawing al_by_domain.png, after every group was decoded, so
    report.json (written last) was never written and the measurement was lost."""
    from eaglenest.evaluate.report import write_report

    report = _al_report([])
    report["domains"] = {"costs $x^$ more": _row(), "plain": _row()}
    pngs = write_report(tmp_path, report)
    assert "al_by_domain.png" in [p.name for p in pngs]
    assert set(json.loads((tmp_path / "report.json").read_text())["domains"]) == {"costs $x^$ more", "plain"}


def test_parity_refuses_an_export_as_the_checkpoint(tmp_path, root, tiny_target, toy_export, monkeypatch, capsys):
    """``evaluate parity --checkpoint runs/toy/draft`` (the export, not the train folder): the export
    was loaded as "the trained checkpoint" and compared with itself served, which passes whatever
    the export got wrong (a flag dropped from config.json is read the same wrong way on both sides)."""
    import eaglenest.evaluate.commands as commands

    monkeypatch.setattr(commands, "parity_check", lambda **kw: pytest.fail("an export was checked against itself"))
    work = tmp_path / "w"
    _heldout(work, h0="Hello.")
    code = evaluate_main(["parity", f"--recipe={root / 'recipes' / 'toy.yaml'}", f"run.workdir={work}",
                          f"run.target={tiny_target}", "evaluate.chat_template_kwargs={}",
                          f"evaluate.draft={toy_export}", "--checkpoint", str(toy_export)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"evaluate: error: --checkpoint: {toy_export} is not a train checkpoint "
                               "(no checkpoint.json"), lines[0]
    assert not (work / "parity").exists()
