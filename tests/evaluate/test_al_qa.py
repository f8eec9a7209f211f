"""QA repros for ``evaluate al`` / ``throughput`` inputs and the served-AL selection, no engine started.

Each test names the bad input; the refusal must be one :class:`ConfigError` line naming the file,
key or value (exit 2 from the CLI), never a traceback from ``datasets``, Lance or a division.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest

from eaglenest.errors import ConfigError, StoreError
from eaglenest.evaluate.config import EvaluateConfig
from eaglenest.evaluate.prompts import load_prompt_set, published


def _row(sample_id: str, split: str, text: str) -> dict:
    """A prompts-table row of one user turn."""
    return dict(sample_id=sample_id, domain="d", source="test", split=split, mode="chat",
                messages_json=json.dumps([{"role": "user", "content": text}]), prompt_token_ids=[],
                response_token_ids=[], finish_reason="", gen_params_id="g")


def _jsonl(path, *rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("turns, says", [
    ("Write a poem.", "turns must be a list of strings, got str 'Write a poem.'"),  # read letter by letter before
    ([{"content": "Hi"}], "the first turn must be text, got dict"),
    ([None], "the first turn must be text, got NoneType"),
])
def test_mt_bench_turns_that_are_not_text(tmp_path, turns, says):
    path = _jsonl(tmp_path / "question.jsonl", {"question_id": 7, "category": "writing", "turns": turns})
    with pytest.raises(ConfigError) as err:
        published(path, name="mt_bench", split="train")
    assert f"row 0 (question_id 7) of {path}: {says}" in str(err.value)


def test_duplicate_question_ids_are_refused(tmp_path):
    """Outputs, per-prompt counts and the lossless check are keyed by sample id: two questions under
    one id would overwrite each other's output and read as a lossless failure."""
    path = _jsonl(tmp_path / "question.jsonl", {"question_id": 3, "category": "math", "turns": ["What is 1 + 1?"]},
                  {"question_id": 3, "category": "writing", "turns": ["Write a line."]})
    with pytest.raises(ConfigError) as err:
        published(path, name="mt_bench", split="train")
    assert str(err.value) == f"evaluate.prompt_path: question_id 3 occurs twice in {path} (row 1)"


@pytest.mark.parametrize("name, content, says", [
    ("question.jsonl", '{"question_id": 1, "category": "c", "turns": ["a"]}\n{"question_id": 2, "cat',
     "as json (JSON parse error"),
    ("question.jsonl", "", "is empty"),
    ("question.csv", "question_id,category,turns\n1,c,a\n", "is not a .jsonl, .json or .parquet file"),
    ("bench.parquet", "PAR1 not really", "as parquet (Parquet magic bytes not found"),
])
def test_unreadable_prompt_files(tmp_path, prompts_store, name, content, says):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(ConfigError) as err:
        load_prompt_set(EvaluateConfig(prompt_set="mt_bench", prompt_path=str(path)), prompts_store)
    msg = str(err.value)
    assert msg.startswith("evaluate.prompt_path: ")
    assert str(path) in msg and says in msg and "\n" not in msg, msg


def test_split_names_are_sql_text_not_syntax(tmp_path):
    """``evaluate.split`` goes into a Lance filter: a quote must not end the literal (a parse error with
    a traceback) nor widen the filter (``x' OR '1'='1`` read every split as held out)."""
    from eaglenest.featurestore import schema as S
    from eaglenest.featurestore.table import store
    uri = str(tmp_path / "store")
    rows = [_row("a", "heldout", "hello"), _row("b", "train", "yo"), _row("c", "it's", "quoted")]
    store.append(uri, store.PROMPTS, pa.Table.from_pylist(rows, schema=S.PROMPTS_SCHEMA))
    groups, _ = load_prompt_set(EvaluateConfig(split="it's"), uri)
    assert [p["sample_id"] for p in groups["d"]] == ["c"]
    with pytest.raises(StoreError) as err:
        load_prompt_set(EvaluateConfig(split="x' OR '1'='1"), uri)
    assert str(err.value) == f"no 'x' OR '1'='1' prompts in {uri}"


def _point(tok_s: float) -> dict:
    return {"output_tokens": int(tok_s), "requests": 1, "wall_s": 1.0, "output_tokens_per_s": tok_s,
            "median_ttft_s": 0.1, "median_e2e_s": 1.0}


def test_throughput_baseline_without_tokens_has_no_speedup():
    """A server whose stream reports no usage counts 0 tokens: the speed-up over it is undefined, not a
    ZeroDivisionError that loses the whole sweep before throughput.json is written."""
    from eaglenest.evaluate.throughput import markdown, summarise

    points = {"baseline": {1: [_point(0.0), _point(50.0)], 4: [_point(0.0)]},
              "speculative": {1: [_point(80.0), _point(100.0)], 4: [_point(30.0)]}}
    modes, speedup = summarise(points)
    assert speedup[0]["speedup"] == round(90.0 / 25.0, 3)  # the means: one seed's baseline still counted
    assert speedup[0]["speedup_per_seed"]["n"] == 1 and speedup[0]["speedup_per_seed"]["median"] == 2.0
    assert speedup[1] == {"concurrency": 4, "speedup": None, "speedup_per_seed": None}
    md = markdown({"target": "t", "draft": "d", "num_speculative_tokens": 3, "max_tokens": 8, "seeds": [0],
                   "modes": modes, "speedup": speedup, "spread": "s"})
    assert "| 4 | speculative | 30.0 | 30.0 | 30.0 | 0.100 | 1.000 | - | - |" in md, md


@pytest.mark.parametrize("key, value, says", [
    ("throughput_seeds", (), "evaluate.throughput_seeds: at least one seed"),
    ("context_buckets", (2048, 1024, 2048), "evaluate.context_buckets: [2048] given more than once"),
    ("concurrency", (4, 1, 4), "evaluate.concurrency: [4] given more than once"),
])
def test_sweep_and_bucket_lists(key, value, says):
    with pytest.raises(ConfigError) as err:
        EvaluateConfig(**{key: value})
    assert str(err.value).startswith(says), str(err.value)
    assert EvaluateConfig(context_buckets=(4096, 1024)).context_buckets == (4096, 1024)  # unsorted is fine


def test_ngram_with_an_empty_training_pool_is_skipped_not_a_floor(tmp_path):
    """A features table with no training rows fits an empty table; its replay accepts nothing and
    reported ``ngram_al`` 1.0 "fitted on 0 loss tokens" as if measured. The report says why it is missing."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "featurestore"))
    import fs_helpers as H

    from eaglenest.evaluate.run import ngram_predictability
    from eaglenest.featurestore import schema as S
    from eaglenest.featurestore.table import store

    m = H.meta()
    rows = H.rows(["a"], m, num_tokens=4)
    rows[0].update(input_ids=[1, 2, 3, 4], loss_mask=[0, 1, 1, 1], split="heldout")
    store.append(str(tmp_path), "features", pa.Table.from_pylist(rows, schema=S.features_schema(m)), meta=m)
    report = {"domains": {"g": {}}, "overall": {}, "context_buckets": {}}
    pred = ngram_predictability(report, {"g": [{"sample_id": "g0"}]}, {}, {"g0": [2, 3, 4]}, {"g0": [1]},
                                EvaluateConfig(num_speculative_tokens=2), store_uri=str(tmp_path), table="features")
    version = store.latest_version(str(tmp_path), "features")
    assert pred == {"ngram": None, "ngram_skipped": f"no loss tokens in the training split of 'features' v{version} "
                                                    f"in {tmp_path} to fit on"}
    assert report["domains"]["g"] == {} and report["overall"] == {}


def test_served_al_selection_serves_the_select_split_whatever_the_prompt_set(tmp_path):
    """``train.select`` scores snapshots on ``train.select.split`` of the store (docs/training.md); with
    ``evaluate.prompt_set=mt_bench`` the selection used to serve the MT-Bench file and ignore the split."""
    from eaglenest.pipeline.served_al import selection_config
    from eaglenest.train.config import SelectConfig, TrainConfig

    train_cfg = TrainConfig(select=SelectConfig(every_steps=5, prompts_per_domain=2, split="select"))
    recipe_eval = EvaluateConfig(prompt_set="mt_bench", prompt_path=str(tmp_path / "question.jsonl"), max_tokens=32)
    cfg = selection_config(train_cfg, recipe_eval)
    assert (cfg.prompt_set, cfg.prompt_path, cfg.split, cfg.max_prompts_per_domain) == ("heldout", "", "select", 2)
    assert cfg.max_tokens == 32 and cfg.context_buckets == () and not cfg.check_lossless and cfg.ngram_order == 0


def _synthetic_report(**kwargs) -> dict:
    row = {"prompts": 1, "acceptance_length": 1.5, "acceptance_rate": 0.25, "acceptance_by_position": [0.5, 0.0]}
    return {"target": "t", "draft": "d", "split": "heldout", "temperature": 0.0, "num_speculative_tokens": 2,
            "al_average": "pooled", "domains": {"g": dict(row)}, "overall": dict(row), "context_buckets": {}}


@pytest.fixture
def al_cli(tmp_path, root, tiny_target, monkeypatch):
    """``evaluate al`` through its CLI with the measurement stubbed (no engine): returns (run, calls)."""
    import eaglenest.evaluate.commands as commands
    from eaglenest.evaluate.cli import main as evaluate_main

    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text("{}")
    calls = []
    monkeypatch.setattr(commands, "evaluate_al", lambda **kw: calls.append(kw) or _synthetic_report())
    argv = ["al", f"--recipe={root / 'recipes' / 'toy.yaml'}", f"run.workdir={tmp_path / 'work'}",
            f"run.target={tiny_target}", f"evaluate.draft={draft}", "evaluate.num_speculative_tokens=2",
            "evaluate.chat_template_kwargs={}"]
    return (lambda: evaluate_main(argv)), calls


def test_al_killed_while_writing_is_measured_again(tmp_path, al_cli, monkeypatch, capsys):
    """report.json is what a re-run takes as done (its cache key): written before the plots and
    provenance.json, a run killed in between was never completed (no plots, no provenance, exit 0)."""
    import eaglenest.evaluate.report as report_mod

    run, calls = al_cli
    real_plots = report_mod.al_plots

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(report_mod, "al_plots", killed)
    assert run() == 130 and len(calls) == 1
    monkeypatch.setattr(report_mod, "al_plots", real_plots)
    assert run() == 0 and len(calls) == 2  # measured again, not "already measures this draft"
    eval_dir = tmp_path / "work" / "eval"
    names = {p.name for p in eval_dir.iterdir()}
    assert {"report.json", "report.md", "provenance.json", "al_by_domain.png", "acceptance_by_position.png"} <= names
    assert run() == 0 and len(calls) == 2  # now complete: the cached report is shown
    assert "already measures this draft" in capsys.readouterr().err


def test_al_cached_report_that_is_not_an_object_is_measured_again(tmp_path, al_cli):
    run, calls = al_cli
    (tmp_path / "work" / "eval").mkdir(parents=True)
    (tmp_path / "work" / "eval" / "report.json").write_text("[1, 2]")
    assert run() == 0 and len(calls) == 1
    assert json.loads((tmp_path / "work" / "eval" / "report.json").read_text())["overall"]["acceptance_length"] == 1.5


def test_no_draft_rounds_give_no_per_position_shares():
    """Outputs that end at their prefill token (max_tokens=1, an immediate end token) have no draft
    rounds: AL and the acceptance rate are None, and the per-position shares were 0.0 (a draft that
    never gets a token accepted) instead of absent."""
    from eaglenest.evaluate.al import SpecCounters

    s = SpecCounters(drafts=0, draft_tokens=0, accepted=0, accepted_per_pos=(0, 0, 0)).summary()
    assert (s["acceptance_length"], s["acceptance_rate"], s["acceptance_by_position"]) == (None, None, [])
    s = SpecCounters(drafts=4, draft_tokens=12, accepted=3, accepted_per_pos=(2, 1, 0)).summary()
    assert s["acceptance_by_position"] == [0.5, 0.25, 0.0]


def test_served_al_selection_refuses_its_prompts_before_training(tmp_path, tiny_target):
    """A ``train.select.split`` prompt with no room in the evaluate engine made the first selection,
    steps into training, fail inside vLLM; the scorer refuses it when it is built (before training)."""
    from eaglenest.engine import EngineConfig
    from eaglenest.featurestore import schema as S
    from eaglenest.featurestore.table import store
    from eaglenest.pipeline.served_al import served_al_scorer
    from eaglenest.train.config import SelectConfig, TrainConfig

    uri = str(tmp_path / "store")
    rows = [_row("ok", "heldout", "Hello there."), _row("long", "heldout", "word " * 600)]
    store.append(uri, store.PROMPTS, pa.Table.from_pylist(rows, schema=S.PROMPTS_SCHEMA))
    train_cfg = TrainConfig(select=SelectConfig(every_steps=5, prompts_per_domain=4))
    small = EvaluateConfig(engine=EngineConfig(max_model_len=256, memory_fraction=0.1))
    with pytest.raises(ConfigError) as err:
        served_al_scorer(train_cfg, small, target_dir=str(tiny_target), store_uri=uri)
    assert str(err.value).startswith("evaluate.engine.max_model_len: prompt long has "), str(err.value)
    assert callable(served_al_scorer(train_cfg, EvaluateConfig(), target_dir=str(tiny_target), store_uri=uri))


def test_unreadable_prompt_file_is_one_line_from_the_cli(tmp_path, root, tiny_target, capfd):
    """``evaluate al`` on a truncated question.jsonl: exit 2 and one line on stderr (``datasets`` logged
    its own ERROR line, twice, and progress bars around the refusal); nothing written."""
    from eaglenest.evaluate.cli import main as evaluate_main

    bad = tmp_path / "question.jsonl"
    bad.write_text('{"question_id": 1, "category": "c", "turns": ["a"]}\n{"question_id": 2, "cat')
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text("{}")
    code = evaluate_main(["al", f"--recipe={root / 'recipes' / 'toy.yaml'}", f"run.workdir={tmp_path / 'work'}",
                          f"run.target={tiny_target}", f"evaluate.draft={draft}", "evaluate.prompt_set=mt_bench",
                          f"evaluate.prompt_path={bad}", "evaluate.num_speculative_tokens=2",
                          "evaluate.chat_template_kwargs={}"])
    err = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1, err
    assert err[0] == f"evaluate: error: evaluate.prompt_path: cannot read {bad} as json (JSON parse error: " \
                     "Missing a closing quotation mark in string. in row 1)"
    assert not (tmp_path / "work").exists()


def test_a_new_features_version_is_measured_again(tmp_path, al_cli, monkeypatch):
    """The report's n-gram reference is fitted on the features table: a new version of it (a new
    capture) is a new measurement, not "already measures this draft"."""
    # the feature-store helpers: on sys.path only once tests/featurestore's conftest was loaded
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "featurestore"))
    import fs_helpers as H

    from eaglenest.featurestore.table import store

    run, calls = al_cli
    uri, m = str(tmp_path / "work" / "store"), H.meta()
    store.append(uri, store.FEATURES, H.table(["a0"], m, domain="a"), meta=m)
    assert run() == 0 and run() == 0 and len(calls) == 1  # the same store: cached
    store.append(uri, store.FEATURES, H.table(["a1"], m, domain="a"), meta=m)
    assert run() == 0 and len(calls) == 2
    assert json.loads((tmp_path / "work" / "eval" / "provenance.json").read_text())["inputs"]["features_version"] \
        == store.latest_version(uri, store.FEATURES)


def test_a_report_measured_by_other_software_is_measured_again(al_cli, monkeypatch, capsys):
    """The cache key held the weights and settings but not the software: after a vLLM (or eaglenest)
    upgrade, `evaluate al` showed the old report as "already measures this draft"."""
    import eaglenest.evaluate.commands as commands

    run, calls = al_cli
    versions = {"vllm": "0.1.0", "eaglenest": "0.1.0"}
    monkeypatch.setattr(commands, "package_versions", lambda: dict(versions))
    assert run() == 0 and run() == 0 and len(calls) == 1  # the same software: the cached report
    assert "already measures this draft" in capsys.readouterr().err
    versions["vllm"] = "0.2.0"
    assert run() == 0 and len(calls) == 2
    assert "already measures this draft" not in capsys.readouterr().err


@pytest.mark.parametrize("k", [10**6, 4096])
def test_a_k_no_sequence_can_hold_is_refused_when_the_recipe_loads(k):
    """``evaluate.num_speculative_tokens=1000000`` went into vLLM's speculative config (serve refused it,
    evaluate did not): K draft tokens and the target's own must fit the engine's max_model_len."""
    from eaglenest.engine import EngineConfig

    with pytest.raises(ConfigError, match=rf"evaluate\.num_speculative_tokens: {k} draft tokens a round; .* "
                                          r"evaluate\.engine\.max_model_len \(4096\); set at most 128"):
        EvaluateConfig(num_speculative_tokens=k, engine=EngineConfig(max_model_len=4096))
    # vLLM verifies at most 128 draft tokens a round (test_evaluate_qa6): 4095, once accepted here, is not
    assert EvaluateConfig(num_speculative_tokens=128, engine=EngineConfig(max_model_len=4096))
    with pytest.raises(ConfigError, match=r"evaluate\.num_speculative_tokens: .* set at most 99$"):
        EvaluateConfig(num_speculative_tokens=100, engine=EngineConfig(max_model_len=100))
