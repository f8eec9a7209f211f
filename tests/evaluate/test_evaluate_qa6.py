"""QA repros for ``evaluate`` (sixth pass, long context first): a context bucket is cut to the language
model's positions (a multimodal wrapper's text config); a bucket of one prompt claims no interval, and
one without draft rounds neither plots an AL of 0 nor drops the other buckets' error bars; every bucket
figure is recomputable from its per-prompt rows; compare names groups and buckets measured over other
prompts and writes compare.json last; one ``evaluate`` command does not write into another's result
folder; a K past what vLLM verifies is refused when the recipe loads. Only the per-prompt test starts
engines (marked slow).

Each test reproduces a bug a user met; it fails without the fix in the module it names.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest

import eaglenest.evaluate.commands as commands
import eaglenest.evaluate.compare as compare_mod
from eaglenest.engine import MAX_NUM_SPECULATIVE_TOKENS, EngineConfig
from eaglenest.evaluate.buckets import bucket_lengths
from eaglenest.evaluate.cli import main as evaluate_main
from eaglenest.evaluate.compare import differences, side_by_side
from eaglenest.evaluate.config import EvaluateConfig
from eaglenest.evaluate.intervals import add_intervals
from eaglenest.evaluate.plan import max_positions, plan
from eaglenest.evaluate.plots import context_axes
from eaglenest.evaluate.report import markdown
from eaglenest.evaluate.run import evaluate_al


def _target(tmp_path, tiny_target, name: str, edit) -> str:
    """A copy of the tiny target whose config.json is ``edit(config)``."""
    dst = tmp_path / name
    shutil.copytree(tiny_target, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(edit(cfg)))
    return str(dst)


def _wrapped(cfg: dict) -> dict:
    """A multimodal wrapper (Mistral-3, Gemma-3 style) whose text config has 16384 positions; the
    wrapper's own config has no ``max_position_embeddings``."""
    return {"architectures": ["Mistral3ForConditionalGeneration"], "model_type": "mistral3",
            "text_config": {**cfg, "max_position_embeddings": 16384}}


def test_buckets_are_cut_to_the_positions_of_a_wrapped_language_model(tmp_path, tiny_target, prompts_store):
    """``evaluate al`` on a Gemma-3 / Mistral-3 style target (positions in ``text_config``; Gemma-3's
    sliding-window layers beside global ones) read 4096 positions, the default when the top-level
    config does not say: on a 128K target every bucket past 4K was cut to 4K - 64 tokens and merged into
    one, and the engine's max_model_len stayed 4096 (the memory estimate, reading the text config, sized
    the engine for the full 32K bucket meanwhile)."""
    wrapped = _target(tmp_path, tiny_target, "wrapped", _wrapped)
    assert max_positions(wrapped) == 16384
    assert max_positions(str(tiny_target)) == 32768  # a plain config: its own max_position_embeddings
    cfg = EvaluateConfig(num_speculative_tokens=2, max_tokens=4, max_prompts_per_domain=1, bucket_max_tokens=8,
                         context_buckets=(1024, 8192), bucket_material=("records",))
    p = plan(cfg, target=wrapped, store_uri=prompts_store)
    assert p.max_positions == 16384 and p.engine.max_model_len == 8200
    assert bucket_lengths(cfg.context_buckets, max_positions=p.max_positions, max_tokens=8) == {1024: 1024, 8192: 8192}


def _linear_rope(cfg: dict) -> dict:
    """A target of 4096 positions stretched 4x by a linear rotary factor (vicuna-16k style): vLLM serves 16384."""
    return {**cfg, "max_position_embeddings": 4096, "rope_scaling": {"rope_type": "linear", "factor": 4.0}}


def test_a_linear_rotary_factor_counts_for_the_buckets_as_vllm_counts_it(tmp_path, tiny_target, prompts_store):
    """A 4096-position target with a linear rotary factor of 4 was evaluated to 4K only: the 8K bucket
    was cut to 4K (merged), though vLLM runs it at 16384 (its max_model_len derivation counts the factor)."""
    from eaglenest.evaluate.commands import check_fit

    stretched = _target(tmp_path, tiny_target, "stretched", _linear_rope)
    assert max_positions(stretched) == 16384
    cfg = EvaluateConfig(num_speculative_tokens=2, max_tokens=4, max_prompts_per_domain=1, bucket_max_tokens=8,
                         context_buckets=(1024, 8192), bucket_material=("records",))
    p = plan(cfg, target=stretched, store_uri=prompts_store)
    assert p.max_positions == 16384 and p.engine.max_model_len == 8200
    check_fit(stretched, cfg)  # sized for the 8K bucket, not refused


def _bucket(prompts: int, *, pair_shift: int = 0) -> dict:
    per = [{"sample_id": f"p{i}", "pair": i, "material": "records", "evidence_distance_tokens": 900,
            "answer_found": False, "draft_rounds": 10, "accepted_tokens": 3 + i + pair_shift,
            "confidence_sum": 6.0 + i, "confidence_tokens": 8} for i in range(prompts)]
    rounds = sum(p["draft_rounds"] for p in per)
    return {"prompts": prompts, "prompt_tokens": 1024, "acceptance_length": 1 + sum(p["accepted_tokens"] for p in per)
            / rounds, "acceptance_length_per_request": 1.3, "acceptance_rate": 0.15, "acceptance_by_position": [0.3],
            "target_confidence": sum(p["confidence_sum"] for p in per) / (8 * prompts), "per_prompt": per}


def _report(**over) -> dict:
    row = {"prompts": 2, "acceptance_length": 1.5, "acceptance_length_per_request": 1.5, "acceptance_rate": 0.25,
           "acceptance_by_position": [0.5]}
    rep = {"target": "t", "draft": "d", "split": "heldout", "num_speculative_tokens": 1, "temperature": 0.0,
           "max_tokens": 8, "bucket_max_tokens": 8, "chat_template_kwargs": {}, "al_average": "pooled",
           "overall": row, "domains": {"a": row}, "context_buckets": {},
           "predictability": {"measure": "m"}}
    return {**rep, **over}


def test_a_bucket_of_one_prompt_claims_no_interval(tmp_path):
    """The default, one prompt per bucket: every bucket read ``1.300 [1.300, 1.300]`` in report.md (and a
    zero-height error bar under a "95% intervals" title): a bootstrap of one prompt resamples that prompt
    only, and the zero-width interval read as certainty. Two prompts get one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    report = _report(context_buckets={"1024": _bucket(1), "2048": _bucket(1, pair_shift=1)})
    add_intervals(report, resamples=200, seed=0)
    for name, row in report["context_buckets"].items():
        assert row["intervals"] == {}, (name, row["intervals"])
        assert row["note"] == "not a measurement: 1 prompt(s) < 16"
    assert report["context_buckets"]["2048"]["al_ratio_to_shortest"] == 1.0769  # the point, without an interval
    lines = [ln for ln in markdown(report).splitlines() if ln.startswith(("| 1024 |", "| 2048 |"))]
    assert len(lines) == 2 and all("[" not in ln for ln in lines), lines
    assert lines[0].startswith("| 1024 | 1024 | 1 | 1.300 | - | 1.300 | 0.750 |")
    fig, ax = plt.subplots()
    context_axes(ax, report["context_buckets"])
    assert "95% intervals" not in ax.get_title() and "1 prompts per bucket" in ax.get_title()
    plt.close(fig)

    two = _report(context_buckets={"1024": _bucket(2)})
    add_intervals(two, resamples=200, seed=0)
    lo, hi = two["context_buckets"]["1024"]["intervals"]["acceptance_length"]
    assert lo < two["context_buckets"]["1024"]["acceptance_length"] < hi  # accepted 3 and 4 of 10: some spread


def test_compare_names_groups_and_buckets_measured_over_other_prompts():
    """A report over 2 prompts per domain (``evaluate.max_prompts_per_domain=2``) and 1 per bucket beside
    one over all 40 and 16 per bucket: the same group and bucket names, so compare.md printed the deltas
    as a like comparison."""
    a = _report(domains={"a": {**_report()["overall"], "prompts": 2}}, context_buckets={"1024": _bucket(1)})
    b = _report(domains={"a": {**_report()["overall"], "prompts": 40}}, context_buckets={"1024": _bucket(16)})
    assert differences(a, b) == {"prompts": [{"a": 2, "ctx 1024": {"prompts": 1, "prompt_tokens": 1024}},
                                             {"a": 40, "ctx 1024": {"prompts": 16, "prompt_tokens": 1024}}]}
    assert "**Not measured alike**, the deltas mix in: prompts A `{'a': 2, " in side_by_side(a, b)
    # A bucket shortened to another length (another target's positions): not the same prompts either.
    short = _report(context_buckets={"1024": {**_bucket(1), "prompt_tokens": 1000}})
    assert differences(a, short) == {"prompts": [{"ctx 1024": {"prompts": 1, "prompt_tokens": 1024}},
                                                 {"ctx 1024": {"prompts": 1, "prompt_tokens": 1000}}]}
    # A group only one side has is named once, under "groups"; the same prompts everywhere: nothing.
    assert list(differences(a, _report(domains={"z": _report()["overall"]}, context_buckets=a["context_buckets"]))) \
        == ["groups"]
    assert differences(a, json.loads(json.dumps(a))) == {}


def _offline_argv(root, tmp_path, tiny_target, out) -> list[str]:
    return ["offline", f"--recipe={root / 'recipes' / 'toy.yaml'}", f"run.workdir={tmp_path / 'w'}",
            f"run.target={tiny_target}", "evaluate.chat_template_kwargs={}", "evaluate.num_speculative_tokens=2",
            "--out", str(out)]


def test_an_evaluate_command_does_not_write_into_another_ones_result_folder(tmp_path, root, tiny_target,
                                                                            monkeypatch, capsys):
    """``evaluate offline --out runs/toy/eval`` (the `evaluate al` folder): offline_report.json went beside
    report.json and its provenance.json replaced al's, so report.json (still valid under its cache key,
    and what ``serve push`` publishes) sat beside a provenance.json of another command and run."""

    monkeypatch.setattr(commands, "offline_al", lambda **kw: {"draft": "d", "overall": _report()["overall"],
                                                              "domains": {}})
    monkeypatch.setattr(commands, "load_prompt_set", lambda cfg, uri: ({}, {"prompt_set": "heldout"}))
    draft = tmp_path / "w" / "draft"
    draft.mkdir(parents=True)
    (draft / "config.json").write_text("{}")
    ev = tmp_path / "w" / "eval"
    ev.mkdir()
    (ev / "report.json").write_text(json.dumps(_report()))
    (ev / "provenance.json").write_text('{"argv": ["evaluate", "al"]}')
    assert evaluate_main(_offline_argv(root, tmp_path, tiny_target, ev)) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"evaluate: error: --out: {ev} holds report.json, another evaluate command's result: this "
                   "command's provenance.json would replace that run's; write the output elsewhere")
    assert sorted(p.name for p in ev.iterdir()) == ["provenance.json", "report.json"]
    assert (ev / "provenance.json").read_text() == '{"argv": ["evaluate", "al"]}'
    # Its own folder, written before: measured again there.
    own = tmp_path / "w" / "eval_offline"
    for _ in range(2):
        assert evaluate_main(_offline_argv(root, tmp_path, tiny_target, own)) == 0
    assert sorted(p.name for p in own.iterdir()) == ["offline_report.json", "provenance.json"]


@pytest.mark.parametrize("result", ["offline_report.json", "throughput.json", "parity.json", "compare.json"])
def test_evaluate_al_does_not_write_into_another_commands_result_folder(tmp_path, root, tiny_target, monkeypatch,
                                                                        capsys, result):

    measured = []
    monkeypatch.setattr(commands, "evaluate_al", lambda **kw: measured.append(kw) or _report())
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text("{}")
    out = tmp_path / "other"
    out.mkdir()
    (out / result).write_text("{}")
    assert evaluate_main(["al", f"--recipe={root / 'recipes' / 'toy.yaml'}", f"run.workdir={tmp_path / 'w'}",
                          f"run.target={tiny_target}", f"evaluate.draft={draft}", "evaluate.num_speculative_tokens=2",
                          "evaluate.chat_template_kwargs={}", "evaluate.context_buckets=[]", "--out", str(out)]) == 2
    assert f"--out: {out} holds {result}, another evaluate command's result" in capsys.readouterr().err
    assert measured == [] and sorted(p.name for p in out.iterdir()) == [result]


def test_compare_stopped_while_writing_leaves_no_result_beside_the_earlier_files(tmp_path, root, monkeypatch):
    """``evaluate compare`` wrote compare.json first, then compare.md and provenance.json: a run stopped
    between them (Ctrl-C, a full disk) left the new compare.json beside the previous run's compare.md,
    a folder of two comparisons. compare.json now goes last, an earlier one removed first."""

    reports = {}
    for name, al in (("a", 1.5), ("b", 2.0), ("c", 3.0)):
        reports[name] = tmp_path / f"{name}.json"
        reports[name].write_text(json.dumps(_report(draft=name, overall={**_report()["overall"],
                                                                          "acceptance_length": al})))
    argv = ["compare", f"--recipe={root / 'recipes' / 'toy.yaml'}", f"run.workdir={tmp_path / 'w'}",
            "--a", str(reports["a"])]
    assert evaluate_main([*argv, "--b", str(reports["b"])]) == 0
    out = tmp_path / "w" / "compare"
    first_md = (out / "compare.md").read_text()
    assert json.loads((out / "compare.json").read_text())["b"]["draft"] == "b"

    def stopped(path, text):
        raise KeyboardInterrupt

    monkeypatch.setattr(compare_mod, "write_text_atomic", stopped)
    assert evaluate_main([*argv, "--b", str(reports["c"])]) == 130  # "evaluate: interrupted"
    assert (out / "compare.md").read_text() == first_md
    assert not (out / "compare.json").exists()  # not c's beside b's compare.md


def test_a_k_past_what_vllm_verifies_is_refused_when_the_recipe_loads(tmp_path, root, tiny_target, capsys):
    """``evaluate al evaluate.num_speculative_tokens=1500`` (or 200): accepted because it fits
    max_model_len, the engine started, and its first decode died in vLLM's rejection sampler with a bare
    ``AssertionError`` traceback (``max_spec_len <= MAX_SPEC_LEN``, 128). 128 itself decodes (checked on
    the tiny target)."""

    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text("{}")
    for k in (129, 1500):
        assert evaluate_main(["al", f"--recipe={root / 'recipes' / 'toy.yaml'}", f"run.workdir={tmp_path / 'w'}",
                              f"run.target={tiny_target}", f"evaluate.draft={draft}",
                              f"evaluate.num_speculative_tokens={k}", "evaluate.chat_template_kwargs={}"]) == 2
        err = capsys.readouterr().err.strip()
        assert err == (f"evaluate: error: evaluate.num_speculative_tokens: {k} draft tokens a round; vLLM verifies "
                       "at most 128 a round, and they and the target's own token must fit "
                       "evaluate.engine.max_model_len (4096); set at most 128")
    assert not (tmp_path / "w").exists()
    assert EvaluateConfig(num_speculative_tokens=MAX_NUM_SPECULATIVE_TOKENS).num_speculative_tokens == 128


@pytest.mark.slow
def test_every_bucket_figure_is_derived_from_its_per_prompt_rows(tiny_target, random_draft, prompts_store):
    """report.json's bucket rows pool their ``per_prompt`` rows: AL, rounds, accepted and output tokens,
    the acceptance histogram and by-position shares, the per-request mean, target_confidence and the
    far-context figures are recomputed here from the rows alone. ``output_tokens``, the histogram and
    ``acceptance_by_position`` were not derivable (the rows held totals only), so a reader could not check
    a bucket's figures against its prompts. The one test here that starts engines (tiny target, 2 prompts
    per bucket, 8 output tokens)."""

    k = 2
    cfg = EvaluateConfig(num_speculative_tokens=k, max_tokens=8, bucket_max_tokens=8, max_prompts_per_domain=1,
                         context_buckets=(256, 1024), bucket_prompts=2, bucket_material=("records", "chat"),
                         ngram_order=0, bootstrap_resamples=200, far_context_keep_tokens=128,
                         engine=EngineConfig(memory_fraction=0.1))
    report = json.loads(json.dumps(evaluate_al(target=str(tiny_target), draft=str(random_draft),
                                               store_uri=prompts_store, cfg=cfg)))  # as report.json holds it
    assert sorted(report["context_buckets"], key=int) == ["256", "1024"]
    for name, row in report["context_buckets"].items():
        per = row["per_prompt"]
        assert row["prompts"] == len(per) == 2 and row["prompt_tokens"] == int(name)
        rounds, accepted = sum(p["draft_rounds"] for p in per), sum(p["accepted_tokens"] for p in per)
        assert (row["draft_rounds"], row["accepted_tokens"]) == (rounds, accepted) and rounds > 0
        assert row["output_tokens"] == sum(p["output_tokens"] for p in per) > 0
        assert row["acceptance_length"] == round(1 + accepted / rounds, 4)
        hist = [sum(col) for col in zip(*(p["acceptance_histogram"] for p in per))]
        assert len(hist) == k + 1 and row["acceptance_histogram"] == hist
        assert row["acceptance_by_position"] == [round(sum(hist[j:]) / rounds, 4) for j in range(1, k + 1)]
        request_als = [1 + p["accepted_tokens"] / p["draft_rounds"] for p in per if p["draft_rounds"]]
        assert row["acceptance_length_per_request"] == round(sum(request_als) / len(request_als), 4)
        conf = sum(p["confidence_sum"] for p in per) / sum(p["confidence_tokens"] for p in per)
        assert row["target_confidence"] == pytest.approx(conf, abs=1e-4)
        lo, hi = row["intervals"]["acceptance_length"]
        assert lo <= row["acceptance_length"] <= hi
        far, probed = row["far_context"], [p for p in per if p.get("far_tokens")]
        assert far["prompts"] == len(probed) == 2  # both prompts are longer than the 128 tokens kept
        n = sum(p["far_tokens"] for p in probed)
        assert far["confidence_kept"] == pytest.approx(sum(p["far_kept_sum"] for p in probed) / n, abs=1e-4)
        assert far["confidence_far_removed"] == pytest.approx(sum(p["far_removed_sum"] for p in probed) / n,
                                                             abs=1e-4)
    overall, groups = report["overall"], report["domains"].values()
    rounds, accepted = sum(g["draft_rounds"] for g in groups), sum(g["accepted_tokens"] for g in groups)
    assert overall["prompts"] == sum(g["prompts"] for g in groups)
    assert overall["acceptance_length"] == round(1 + accepted / rounds, 4)
    assert report["lossless"]["prompts"] == overall["prompts"] + 4 and report["lossless"]["all_identical"]


def test_a_bucket_without_draft_rounds_keeps_the_other_buckets_error_bars():
    """A bucket whose outputs all ended at their first token has no draft round: no AL (None) and no
    interval. al_by_context.png then drew its AL at 0 (below the floor of 1 every AL has) and dropped the
    95% error bars of every other bucket, as if none had an interval."""

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.container import ErrorbarContainer

    report = _report(context_buckets={"1024": _bucket(4), "2048": _bucket(4), "4096": _bucket(4, pair_shift=2)})
    add_intervals(report, resamples=200, seed=0)
    for name, row in report["context_buckets"].items():
        row["prompt_tokens"] = int(name)
    dry = report["context_buckets"]["2048"]
    dry.update(acceptance_length=None, acceptance_length_per_request=None, intervals={})
    fig, ax = plt.subplots()
    context_axes(ax, report["context_buckets"])
    (bars,) = [c for c in ax.containers if isinstance(c, ErrorbarContainer) and c.get_label() == "pooled over rounds"]
    line = bars.lines[0]
    ys = [float(y) for y in line.get_ydata()]
    assert math.isnan(ys[1]) and ys[0] == report["context_buckets"]["1024"]["acceptance_length"]
    (segments,) = [lc.get_segments() for lc in bars.lines[2]]
    ends = {round(float(s[0][0])): (round(float(s[0][1]), 4), round(float(s[1][1]), 4)) for s in segments
            if len(s) and not math.isnan(float(s[0][1]))}
    assert ends == {b: tuple(report["context_buckets"][str(b)]["intervals"]["acceptance_length"])
                    for b in (1024, 4096)}
    plt.close(fig)
