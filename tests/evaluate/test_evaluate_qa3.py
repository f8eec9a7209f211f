"""QA repros, third pass, for ``evaluate`` (no engine started): what the report says it measured,
when a cached report is reused, and what an interrupted write leaves behind.

Each test reproduces a bug a user met; it fails without the fix in the module it names.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from eaglenest.evaluate.cli import main as evaluate_main
from eaglenest.evaluate.config import EvaluateConfig
from eaglenest.evaluate.prompts import load_prompt_set
from eaglenest.evaluate.report import markdown


def _row(prompts: int = 1) -> dict:
    return {"prompts": prompts, "acceptance_length": 1.5, "acceptance_length_per_request": 1.5, "acceptance_rate": 0.25,
            "acceptance_by_position": [0.5, 0.0]}


def _report(**kwargs) -> dict:
    return {"target": "t", "draft": "d", "split": "heldout", "temperature": 0.0, "num_speculative_tokens": 2,
            "al_average": "pooled", "domains": {"g": _row()}, "overall": _row(), "context_buckets": {}, **kwargs}


def test_prompts_line_counts_the_per_domain_cap(prompts_store):
    """``evaluate.max_prompts_per_domain=1``: report.md said "Prompts loaded: 7" and nothing of the cut,
    so a reader took the table's 2 prompts for 7 (the count was taken before the cap)."""
    groups, info = load_prompt_set(EvaluateConfig(max_prompts_per_domain=1), prompts_store)
    assert sum(map(len, groups.values())) == 2
    # 7 loaded, 1 overlapping, 6 left over 2 domains of 3: 4 beyond the cap of 1 per domain
    assert (info["loaded"], info["overlap_excluded"], info["over_cap"], info["evaluated"]) == (7, 1, 4, 2)
    line = next(ln for ln in markdown(_report(prompts=info)).splitlines() if ln.startswith("- Prompts loaded"))
    assert "beyond evaluate.max_prompts_per_domain=1: 4" in line and line.endswith("; evaluated: 2."), line
    _, uncapped = load_prompt_set(EvaluateConfig(), prompts_store)
    assert (uncapped["over_cap"], uncapped["evaluated"]) == (0, 6)
    assert "max_prompts_per_domain" not in markdown(_report(prompts=uncapped))


@pytest.fixture
def cached_al(tmp_path, root, tiny_target, monkeypatch):
    """``evaluate al`` through its CLI with the measurement stubbed (no engine), on a copy of the tiny
    target that a test may edit: returns (run, calls, target, argv)."""
    import eaglenest.evaluate.commands as commands
    from eaglenest.evaluate.cli import main as evaluate_main

    target = tmp_path / "target"
    shutil.copytree(tiny_target, target)
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text("{}")
    calls = []
    monkeypatch.setattr(commands, "evaluate_al", lambda **kw: calls.append(kw) or _report())
    argv = ["al", f"--recipe={root / 'recipes' / 'toy.yaml'}", f"run.workdir={tmp_path / 'work'}",
            f"run.target={target}", f"evaluate.draft={draft}", "evaluate.num_speculative_tokens=2",
            "evaluate.chat_template_kwargs={}"]
    return (lambda *more: evaluate_main(argv + list(more))), calls, target


@pytest.mark.parametrize("name", ["chat_template.jinja", "tokenizer.model", "merges.txt"])
def test_a_new_chat_template_or_tokenizer_file_is_measured_again(cached_al, capsys, name):
    """The cache key read the target's ``*.json`` only: a chat template kept in ``chat_template.jinja``
    (transformers' own layout since 4.47) or a sentencepiece ``tokenizer.model`` changed what the
    prompts render to, and `evaluate al` still showed the old report as "already measures this draft"."""
    run, calls, target = cached_al
    (target / name).write_text("first version")
    assert run() == 0 and run() == 0 and len(calls) == 1  # unchanged: the cached report
    assert "already measures this draft" in capsys.readouterr().err
    (target / name).write_text("second version")
    assert run() == 0 and len(calls) == 2
    assert "already measures this draft" not in capsys.readouterr().err


def test_an_edited_prompt_file_is_measured_again(cached_al, tmp_path, capsys):
    """``evaluate.prompt_set=mt_bench``: the key held the prompt file's path, not what it holds, so
    questions added to question.jsonl were never decoded: the old report was shown."""
    run, calls, _ = cached_al
    questions = tmp_path / "question.jsonl"
    first = {"question_id": 1, "category": "writing", "turns": ["Write two lines about tea."]}
    questions.write_text(json.dumps(first) + "\n")
    args = ("evaluate.prompt_set=mt_bench", f"evaluate.prompt_path={questions}")
    assert run(*args) == 0 and run(*args) == 0 and len(calls) == 1
    assert "already measures this draft" in capsys.readouterr().err
    second = {"question_id": 2, "category": "math", "turns": ["What is 3 + 4?"]}
    questions.write_text(json.dumps(first) + "\n" + json.dumps(second) + "\n")
    assert run(*args) == 0 and len(calls) == 2
    assert "already measures this draft" not in capsys.readouterr().err


def test_a_plot_interrupted_while_saved_leaves_no_temporary_file(tmp_path, monkeypatch):
    """A run stopped (Ctrl-C) while matplotlib wrote a PNG left ``.al_by_domain.tmp<pid>.png`` in the
    output folder for good: every later run wrote a new one under its own pid beside it."""
    from matplotlib.figure import Figure

    from eaglenest.evaluate.report import write_report

    def interrupted(self, fname, **kwargs):
        open(fname, "wb").write(b"\x89PNG half")  # noqa: SIM115 - a half-written file, as a kill leaves it
        raise KeyboardInterrupt

    monkeypatch.setattr(Figure, "savefig", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_report(tmp_path, _report())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.md"]  # no report.json: not marked done


def _draft(path):
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"recommended_num_speculative_tokens": 3}))
    return path


def test_compare_fits_the_ngram_reference_on_the_recipes_features_table(tmp_path, root, tiny_target, monkeypatch):
    """``evaluate compare --a DRAFT --b DRAFT featurestore.table=features_v2``: each draft was evaluated
    with its n-gram reference fitted on the default ``features`` table (another feature set, or none:
    "ngram_skipped"), while `evaluate al` with the same recipe fits it on ``features_v2``."""
    import eaglenest.evaluate.compare as compare_mod

    tables = []
    monkeypatch.setattr(compare_mod, "evaluate_al", lambda *, draft, features_table="features", **kw:
                        tables.append(features_table) or _report(draft=draft))
    a, b = _draft(tmp_path / "a"), _draft(tmp_path / "b")
    assert evaluate_main(["compare", f"--recipe={root / 'recipes' / 'toy.yaml'}", f"run.workdir={tmp_path / 'w'}",
                          f"run.target={tiny_target}", "evaluate.chat_template_kwargs={}",
                          "featurestore.table=features_v2", "--a", str(a), "--b", str(b)]) == 0
    assert tables == ["features_v2", "features_v2"]


def test_offline_reports_record_the_chat_mode_compare_checks(tmp_path, root, tiny_target, monkeypatch, capsys):
    """Two ``evaluate offline`` reports, one rendered with ``{enable_thinking: true}`` and one without:
    offline_report.json recorded neither the kwargs nor the split, so `evaluate compare` put the two
    side by side as measured alike."""
    import eaglenest.evaluate.commands as commands

    monkeypatch.setattr(commands, "offline_al", lambda **kw: {"draft": "d", "overall": _row(), "domains": {}})
    monkeypatch.setattr(commands, "load_prompt_set", lambda cfg, uri: ({}, {"prompt_set": "heldout"}))
    _draft(tmp_path / "w" / "draft")
    base = ["offline", f"--recipe={root / 'recipes' / 'toy.yaml'}", f"run.workdir={tmp_path / 'w'}",
            f"run.target={tiny_target}"]
    monkeypatch.chdir(tmp_path)  # --out as given: relative to the current folder, as every --out
    assert evaluate_main([*base, "evaluate.chat_template_kwargs={enable_thinking: true}", "--out", "w/a"]) == 0
    assert evaluate_main([*base, "evaluate.chat_template_kwargs={}", "evaluate.split=dev", "--out", "w/b"]) == 0
    a = json.loads((tmp_path / "w" / "a" / "offline_report.json").read_text())
    assert (a["chat_template_kwargs"], a["split"]) == ({"enable_thinking": True}, "heldout")
    capsys.readouterr()
    assert evaluate_main(["compare", f"--recipe={root / 'recipes' / 'toy.yaml'}", f"run.workdir={tmp_path / 'w'}",
                          f"run.target={tiny_target}", "--a", str(tmp_path / "w" / "a"),
                          "--b", str(tmp_path / "w" / "b")]) == 0
    differ = json.loads((tmp_path / "w" / "compare" / "compare.json").read_text())["settings_differ"]
    assert differ == {"chat_template_kwargs": [{"enable_thinking": True}, {}], "split": ["heldout", "dev"]}


def test_another_features_table_at_the_same_version_is_measured_again(cached_al, tmp_path, capsys, monkeypatch):
    """``featurestore.table=features_v2`` (a second feature set in the same store, the n-gram
    reference's table): the key held the table's version number but not its name, so with both tables
    at version 1 the report fitted on ``features`` was shown as "already measures this draft"."""
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "featurestore"))  # the feature-store helpers
    import fs_helpers as H

    from eaglenest.featurestore.table import store

    run, calls, _ = cached_al
    uri, m = str(tmp_path / "work" / "store"), H.meta()
    for table in ("features", "features_v2"):
        store.append(uri, table, H.table(["a0"], m, domain="a"), meta=m)
    assert store.latest_version(uri, "features") == store.latest_version(uri, "features_v2")
    assert run() == 0 and run() == 0 and len(calls) == 1
    assert run("featurestore.table=features_v2") == 0 and len(calls) == 2
    assert "already measures this draft" not in capsys.readouterr().err.split("\n", 1)[-1]
    inputs = json.loads((tmp_path / "work" / "eval" / "provenance.json").read_text())["inputs"]
    assert inputs["features_table"] == "features_v2"


class StubStarted(Exception):
    """Raised by a stubbed server or engine: every check before it passed."""


def test_throughput_does_not_refuse_a_prompt_its_sweep_never_sends(tmp_path, tiny_target, toy_export, monkeypatch):
    """``evaluate throughput`` with ``evaluate.throughput_prompts=2`` on a prompt set of three: the sweep
    sends the first two, yet the third, too long for ``throughput_max_tokens``, refused the whole run
    ("leave it out of the prompt set") before any server started."""
    import pyarrow as pa

    from eaglenest.engine import EngineConfig
    from eaglenest.errors import ConfigError
    from eaglenest.evaluate import throughput
    from eaglenest.featurestore import schema as S
    from eaglenest.featurestore.table import store

    def server(*args, **kwargs):
        raise StubStarted()

    monkeypatch.setattr(throughput, "Server", server)
    texts = {"a": "Hello there.", "b": "Good morning.", "z-long": "word " * 100}
    rows = [dict(sample_id=sid, domain="d", source="test", split="heldout", mode="chat",
                 messages_json=json.dumps([{"role": "user", "content": text}]), prompt_token_ids=[],
                 response_token_ids=[], finish_reason="", gen_params_id="g") for sid, text in texts.items()]
    uri = str(tmp_path / "store")
    store.append(uri, store.PROMPTS, pa.Table.from_pylist(rows, schema=S.PROMPTS_SCHEMA))

    def sweep(**cfg):
        cfg = EvaluateConfig(num_speculative_tokens=2, throughput_max_tokens=48, exclude_overlap=False,
                             engine=EngineConfig(max_model_len=256, memory_fraction=0.1), **cfg)
        throughput.run_sweep(target=str(tiny_target), draft=str(toy_export), store_uri=uri, cfg=cfg,
                             serve_cfg=None, log_dir=tmp_path)

    with pytest.raises(StubStarted):  # a, b sent; z-long never
        sweep(throughput_prompts=2, concurrency=(1, 2))
    with pytest.raises(ConfigError, match="prompt z-long has"):  # 3 concurrent requests: z-long is sent
        sweep(throughput_prompts=2, concurrency=(1, 3))


def test_context_plot_places_a_shortened_bucket_at_its_prompt_length():
    """A target of 4096 positions with the default buckets: the 8K..32K buckets are shortened to 4032
    prompt tokens (``prompt_tokens`` says so in report.json), but al_by_context.png, whose x axis
    reads "prompt tokens", drew them at 8K, 16K and 32K: an AL "measured" at lengths never decoded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from eaglenest.evaluate.plots import context_axes

    def row(tokens):
        return {**_row(), "prompt_tokens": tokens, "measurement": False}

    buckets = {"1024": row(1024), "4096": row(4032), "8192": row(4032), "32768": row(4032)}
    fig, ax = plt.subplots()
    try:
        context_axes(ax, buckets)
        assert list(ax.get_xticks()) == [1024, 4032, 4032, 4032]
        assert [t.get_text() for t in ax.get_xticklabels()] == ["1K", "3.9K", "3.9K", "3.9K"]
        rings = [c for c in ax.collections if c.get_label().startswith("<")]  # too few prompts: ringed
        assert [tuple(xy) for xy in rings[0].get_offsets()] == [(1024, 1.5), (4032, 1.5), (4032, 1.5), (4032, 1.5)]
    finally:
        plt.close(fig)


def test_an_edited_prompt_folder_is_measured_again(cached_al, speed_bench_dir, tmp_path, capsys):
    """The same with ``evaluate.prompt_set=speed_bench`` and a local ``<dir>/<config>/*.parquet``."""
    run, calls, _ = cached_al
    folder = tmp_path / "speed"
    shutil.copytree(speed_bench_dir, folder)
    args = ("evaluate.prompt_set=speed_bench", f"evaluate.prompt_path={folder}")
    assert run(*args) == 0 and run(*args) == 0 and len(calls) == 1
    (folder / "qualitative" / "notes.txt").write_text("not read by the loader")  # not a prompt file: cached
    assert run(*args) == 0 and len(calls) == 1
    assert "already measures this draft" in capsys.readouterr().err
    parquet = next((folder / "qualitative").glob("*.parquet"))
    shutil.copy(parquet, folder / "qualitative" / "test-00001-of-00001.parquet")  # another shard: new prompts
    assert run(*args) == 0 and len(calls) == 2
    assert "already measures this draft" not in capsys.readouterr().err


#: A chat template that renders the last message only (some single-turn and completion-style templates).
LAST_MESSAGE_ONLY = ("{{ bos_token }}<|user|>\n{{ messages[-1]['content'] }}<|end|>\n"
                     "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@pytest.fixture
def last_message_target(tmp_path, tiny_target):
    target = tmp_path / "target"
    shutil.copytree(tiny_target, target)
    path = target / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "chat_template": LAST_MESSAGE_ONLY}))
    return target


@pytest.mark.timeout(120)  # without the fix: an endless loop
def test_chat_buckets_with_a_template_that_drops_earlier_turns_are_refused_not_endless(last_message_target):
    """``evaluate.bucket_material`` with ``chat`` on a target whose template renders the last message only:
    the history grew by a pass of held-out turns per loop and never rendered a token longer, so the chat
    bucket prompt was built forever (memory growing), after every group had been decoded."""
    from transformers import AutoTokenizer

    from eaglenest.errors import ConfigError
    from eaglenest.evaluate.buckets import build_bucket_prompts

    tok = AutoTokenizer.from_pretrained(last_message_target)
    material = [([{"role": "user", "content": "What is 2 + 2?"}], "4.")]
    with pytest.raises(ConfigError) as err:
        build_bucket_prompts(tok, material, (64,), per_bucket=1, max_positions=4096, max_tokens=16, kinds=("chat",))
    assert str(err.value).startswith("evaluate.bucket_material: chat: the target's chat template renders no "
                                     "earlier turn"), str(err.value)


def test_chat_buckets_with_a_template_that_drops_earlier_turns_are_refused_before_the_engine(
        tmp_path, last_message_target, toy_export, monkeypatch):
    """The same, refused by ``evaluate al`` before its engine starts (generated kinds still pass)."""
    import pyarrow as pa

    from eaglenest.errors import ConfigError
    from eaglenest.evaluate import run as run_mod
    from eaglenest.featurestore import schema as S
    from eaglenest.featurestore.table import store

    def make_llm(*args, **kwargs):
        raise StubStarted()  # the engine: every check before it passed

    monkeypatch.setattr(run_mod, "make_llm", make_llm)
    uri = str(tmp_path / "store")
    row = dict(sample_id="a", domain="d", source="test", split="heldout", mode="chat",
               messages_json=json.dumps([{"role": "user", "content": "Hello there."}]), prompt_token_ids=[],
               response_token_ids=[], finish_reason="", gen_params_id="g")
    store.append(uri, store.PROMPTS, pa.Table.from_pylist([row], schema=S.PROMPTS_SCHEMA))

    def evaluate(material):
        cfg = EvaluateConfig(num_speculative_tokens=2, context_buckets=(256,), bucket_prompts=2,
                             bucket_material=material)
        run_mod.evaluate_al(target=str(last_message_target), draft=str(toy_export), store_uri=uri, cfg=cfg)

    with pytest.raises(ConfigError, match="evaluate.bucket_material: chat: the target's chat template renders no"):
        evaluate(("records", "chat"))
    with pytest.raises(StubStarted):
        evaluate(("records", "code"))


def test_offline_stopped_while_writing_leaves_no_report_beside_the_earlier_provenance(tmp_path, root, tiny_target,
                                                                                     monkeypatch):
    """``evaluate offline --draft A`` then ``--draft B`` stopped (SIGTERM, Ctrl-C) after its
    offline_report.json was written: the folder held B's report beside A's provenance.json, and
    ``evaluate compare`` read it as a finished run. The result file is now removed first and written last."""
    import eaglenest.evaluate.commands as commands

    monkeypatch.setattr(commands, "load_prompt_set", lambda cfg, uri: ({}, {"prompt_set": "heldout"}))
    monkeypatch.setattr(commands, "offline_al", lambda *, draft, **kw: {"draft": draft, "overall": _row(),
                                                                       "domains": {}})
    a, b = _draft(tmp_path / "a"), _draft(tmp_path / "b")
    out = tmp_path / "w" / "eval_offline"

    def run(draft) -> int:
        return evaluate_main(["offline", f"--recipe={root / 'recipes' / 'toy.yaml'}", f"run.workdir={tmp_path / 'w'}",
                              f"run.target={tiny_target}", "evaluate.chat_template_kwargs={}", "--draft", str(draft)])

    assert run(a) == 0 and json.loads((out / "offline_report.json").read_text())["draft"] == str(a)
    real = commands.write_provenance

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(commands, "write_provenance", stopped)
    assert run(b) == 130
    assert not (out / "offline_report.json").exists()  # not B's report under A's provenance
    monkeypatch.setattr(commands, "write_provenance", real)
    assert run(b) == 0
    assert json.loads((out / "offline_report.json").read_text())["draft"] == str(b)
    assert json.loads((out / "provenance.json").read_text())["inputs"]["draft"] == str(b)


def test_throughput_stopped_while_writing_leaves_no_result_beside_the_earlier_files(tmp_path, root, tiny_target,
                                                                                     monkeypatch):
    """The same for ``evaluate throughput``: throughput.json was written first, then the table, the plot
    and provenance.json; a run stopped while drawing the plot left its figures beside the earlier
    run's throughput.md, throughput.png and provenance.json."""
    import eaglenest.evaluate.commands as commands
    from eaglenest.evaluate.throughput import summarise

    point = {"output_tokens": 32, "requests": 4, "wall_s": 1.0, "output_tokens_per_s": 32.0, "median_ttft_s": 0.1,
             "median_e2e_s": 0.5}
    modes, speedup = summarise({"baseline": {1: [point]}, "speculative": {1: [point]}})

    def result(draft):
        return {"target": "t", "draft": draft, "num_speculative_tokens": 3, "max_tokens": 8, "seeds": [0],
                "modes": modes, "speedup": speedup, "spread": "s"}

    monkeypatch.setattr(commands, "run_sweep", lambda *, draft, **kw: result(draft))
    work = tmp_path / "w"
    _draft(work / "draft")
    out = work / "throughput"
    argv = ["throughput", f"--recipe={root / 'recipes' / 'toy.yaml'}", f"run.workdir={work}",
            f"run.target={tiny_target}", "evaluate.chat_template_kwargs={}"]
    assert evaluate_main(argv) == 0 and (out / "throughput.json").is_file()
    real = commands.throughput_plot

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(commands, "throughput_plot", stopped)
    assert evaluate_main(argv) == 130
    assert not (out / "throughput.json").exists()
    monkeypatch.setattr(commands, "throughput_plot", real)
    assert evaluate_main(argv) == 0
    assert {p.name for p in out.iterdir()} >= {"throughput.json", "throughput.md", "throughput.png", "provenance.json"}
