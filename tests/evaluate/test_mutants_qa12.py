"""Mutation audit (QA pass 12) of AL, intervals, n-gram drafting, buckets and selection: each test
here kills a plausible mutant the earlier tests let through, checked from first principles (vLLM's own
definitions, an independent reference computation, an invariant)."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pyarrow as pa
import pytest
from vllm.v1.metrics.reader import Counter, Vector
from vllm.v1.metrics.stats import RequestSpecDecodeMetrics

from eaglenest.evaluate import ngram
from eaglenest.evaluate.buckets import build_bucket_prompts
from eaglenest.evaluate.config import EvaluateConfig
from eaglenest.evaluate.intervals import add_ratio_intervals, bootstrap, ratio_stat
from eaglenest.evaluate.run import _Mode, _pooled, ngram_predictability, spearman
from eaglenest.featurestore import schema as S
from eaglenest.featurestore.table import store
from eaglenest.hf import load_tokenizer
from eaglenest.specdecode import SpecCounters, read_counters

sys.path.insert(0, str(Path(__file__).parents[1] / "featurestore"))
import fs_helpers as H  # noqa: E402


class _TwoEngineLLM:
    """What ``vllm.LLM.get_metrics()`` returns with data parallel 2 (one series per engine core, labelled
    ``engine``): vLLM's own reader objects. A 2-core CPU runs one engine core, so the second is written here."""

    def __init__(self, per_engine: list[tuple[int, int, int, list[int]]]):
        self.per_engine = per_engine

    def get_metrics(self):
        out = []
        for e, (drafts, tokens, accepted, per_pos) in enumerate(self.per_engine):
            labels = {"engine": str(e), "model_name": "target"}
            out += [Counter(name="vllm:spec_decode_num_drafts", labels=labels, value=drafts),
                    Counter(name="vllm:spec_decode_num_draft_tokens", labels=labels, value=tokens),
                    Counter(name="vllm:spec_decode_num_accepted_tokens", labels=labels, value=accepted),
                    Vector(name="vllm:spec_decode_num_accepted_tokens_per_pos", labels=labels, values=per_pos),
                    Counter(name="vllm:generation_tokens", labels=labels, value=999)]
        return out


def test_counters_sum_every_engines_series():
    """read_counters kept the last engine's value (``=`` for ``+=``): AL of one engine core of two."""
    got = read_counters(_TwoEngineLLM([(10, 30, 12, [7, 4, 1]), (6, 18, 3, [3, 0, 0])]))
    assert got == SpecCounters(16, 48, 15, (10, 4, 1))
    assert got.acceptance_length == 1 + 15 / 16


def test_acceptance_rate_is_accepted_over_draft_tokens_as_vllm_defines_it():
    """vLLM (``v1/spec_decode/metrics.py``): draft acceptance rate = accepted / draft tokens, AL = 1 +
    accepted / drafts; a rate over rounds (drafts) reads K times too high."""
    s = SpecCounters(drafts=10, draft_tokens=30, accepted=12, accepted_per_pos=(7, 4, 1)).summary()
    assert s["acceptance_rate"] == 0.4
    assert s["acceptance_length"] == 2.2
    assert s["acceptance_by_position"] == [0.7, 0.4, 0.1]


def _mode(prompts: int, output_tokens: int, delta: SpecCounters, hists: list[list[int]]) -> _Mode:
    m = _Mode()
    m.prompts, m.output_tokens, m.delta = prompts, output_tokens, delta
    m.metrics = [RequestSpecDecodeMetrics(num_spec_tokens=len(h) - 1, histogram=h) for h in hists]
    return m


def test_overall_pools_the_counters_of_every_mode():
    """``overall`` (``run._pooled``) kept the last mode's counter delta: with chat and raw held-out prompts
    (a store with a ``raw_fraction: 1.0`` domain) its AL was the raw prompts' alone, not the pooled one."""
    chat = _mode(2, 40, SpecCounters(10, 20, 8, (6, 2)), [[4, 4, 2], [0, 0, 0]])
    raw = _mode(1, 30, SpecCounters(5, 10, 9, (5, 4)), [[0, 1, 4]])
    row = _pooled([chat, raw])
    assert (row["prompts"], row["output_tokens"], row["draft_rounds"], row["accepted_tokens"]) == (3, 70, 15, 17)
    assert row["acceptance_length"] == round(1 + 17 / 15, 4)
    assert row["acceptance_by_position"] == [round(11 / 15, 4), round(6 / 15, 4)]
    assert row["acceptance_histogram"] == [4, 5, 6] and row["requests_with_drafts"] == 2
    assert row["acceptance_length_from_histograms"] == row["acceptance_length"]


def _pearson_of_average_ranks(xs: list[float], ys: list[float]) -> float:
    """Spearman's rho by its definition: Pearson's r of the ranks, tied values sharing their mean rank."""
    def ranks(v):
        return [sum(u < x for u in v) + (sum(u == x for u in v) - 1) / 2 for x in v]

    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    return cov / (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5


@pytest.mark.parametrize("xs, ys", [([1, 5, 5, 9], [1, 3, 2, 4]), ([2, 2, 7, 7, 9], [3, 1, 4, 1, 5]),
                                    ([1.2, 1.5, 1.5, 1.5, 2.0], [0.9, 0.7, 0.8, 0.95, 0.99])])
def test_spearman_gives_tied_groups_their_mean_rank(xs, ys):
    """``run.spearman`` gave a tied group its first rank: equal to the mean rank's result only when the tie
    is at the bottom (the earlier test's case); a tie in the middle changed the correlation."""
    assert spearman(xs, ys) == pytest.approx(_pearson_of_average_ranks(xs, ys), abs=1e-4)


def test_ngram_al_drafts_its_first_guess_from_the_prompts_own_tokens(tmp_path):
    """``ngram_predictability`` replayed each output without its prompt (``prompt_ids`` dropped): the first
    round's context was the prefill token alone, so a table that needs the prompt's last token to guess
    right read as a weaker drafter. Fitted on ``1 2 3 4 2 5``: after ``4 2`` comes 5, after ``2`` alone
    3 and 5 tie and the smaller id, 3, wins."""
    m = H.meta()
    rows = H.rows(["a"], m, num_tokens=6)
    rows[0].update(input_ids=[1, 2, 3, 4, 2, 5], loss_mask=[0, 1, 1, 1, 1, 1])
    store.append(str(tmp_path), "features", pa.Table.from_pylist(rows, schema=S.features_schema(m)), meta=m)
    report = {"domains": {"d": {}}, "overall": {}, "modes": {}, "context_buckets": {}}
    cfg = EvaluateConfig(num_speculative_tokens=1, ngram_order=2)
    ngram_predictability(report, {"d": [{"sample_id": "p", "messages": []}]}, {}, {"p": [2, 5]}, {"p": [9, 4]}, cfg,
                         store_uri=str(tmp_path), table="features")
    # prefill emits 2; one round: context (4, 2) guesses 5 = the target's token: 1 accepted of 1 round
    assert report["domains"]["d"]["ngram_al"] == 2.0 and report["overall"]["ngram_al"] == 2.0


def test_a_bucket_interval_is_the_central_95_percent_of_its_resamples():
    """``bootstrap`` cut ``1 - level`` from each tail (a 90% interval labelled 95%): within the earlier
    test's 20% of the normal width. Here to 7%: the bootstrap of a mean of n prompts is normal with the
    population sd over sqrt(n), so its central 95% is mean +- 1.96 of that, and centred on the mean."""
    values = [((i * 37) % 101) / 100 for i in range(200)]
    n, mean = len(values), statistics.fmean(values)
    se = statistics.pstdev(values) / n ** 0.5
    lo, hi = bootstrap(n, ratio_stat(values, [1.0] * n), resamples=4000, seed="qa12")
    assert hi - lo == pytest.approx(2 * 1.96 * se, rel=0.07)
    assert mean - lo == pytest.approx(hi - mean, rel=0.15)


def _al_rows(pairs: list[tuple[int, int]], *, paired: bool) -> dict:
    rows = [{"sample_id": f"p{i}", "accepted_tokens": a, "draft_rounds": r, **({"pair": i} if paired else {})}
            for i, (a, r) in enumerate(pairs)]
    return {"prompts": len(rows), "per_prompt": rows,
            "acceptance_length": round(1 + sum(a for a, _ in pairs) / sum(r for _, r in pairs), 4)}


def test_buckets_whose_prompts_are_not_paired_are_drawn_independently():
    """Unpaired buckets (rows without ``pair``: an older report) of equal counts were drawn with the same
    indices, as if paired: two buckets of the same spread read as exactly equal (a zero-width interval
    [1, 1]), the certainty the docs say only pairing earns. Drawn independently, the ratio varies."""
    prompts = [(1, 4), (7, 4), (3, 4), (5, 4), (0, 4), (8, 4)]
    report = {"context_buckets": {"1024": _al_rows(prompts, paired=False), "2048": _al_rows(prompts, paired=False)}}
    add_ratio_intervals(report, resamples=400, seed=0)
    assert report["bucket_intervals"]["ratio_to_shortest"]["paired"] is False
    lo, hi = report["context_buckets"]["2048"]["intervals"]["al_ratio_to_shortest"]
    assert lo < 0.9 and hi > 1.1
    paired = {"context_buckets": {"1024": _al_rows(prompts, paired=True), "2048": _al_rows(prompts, paired=True)}}
    add_ratio_intervals(paired, resamples=400, seed=0)  # the same questions, the same answers: exactly 1
    assert paired["context_buckets"]["2048"]["intervals"]["al_ratio_to_shortest"] == [1.0, 1.0]


def test_generated_prompts_ask_the_same_question_at_every_length(tiny_target):
    """Prompt ``i`` of every bucket is paired (docs: "asks the same closing question at every length ... keeps its
    question, answer and evidence and gets more filler"): a seed that depends on the bucket asked another."""
    tok = load_tokenizer(str(tiny_target), trust_remote_code=False)
    out = build_bucket_prompts(tok, [], (1024, 2048), per_bucket=3, max_positions=4096, max_tokens=16,
                               kinds=("records", "code", "recall"))
    for short, long in zip(out[1024], out[2048]):
        assert (short["pair"], short["material"]) == (long["pair"], long["material"])
        assert (short["answer"], short["answer_value"]) == (long["answer"], long["answer_value"])
        assert short["answer"] is not None
        # the closing question (the prompt's last 24 tokens) is the same
        assert short["prompt_token_ids"][-24:] == long["prompt_token_ids"][-24:]


def test_ngram_replays_pool_their_per_position_counts():
    """``Replay.__add__`` kept the left replay's per-position counts: a group's
    ``ngram_acceptance_by_position`` was its first prompt's alone over every prompt's rounds. Pooled, as vLLM
    pools ``num_accepted_tokens_per_pos``: the sum of each replay's counts, padded to the longer."""
    table = ngram.fit([pa.RecordBatch.from_pydict({"input_ids": [[1, 2, 3, 4, 1, 2, 3, 4]],
                                                   "loss_mask": [[0] + [1] * 7]})], order=1)
    a = ngram.simulate(table, [9], [1, 2, 3, 4, 1], k=3)  # one round: 2 3 4 guessed and accepted, 1 emitted
    b = ngram.simulate(table, [9], [2, 3, 7, 7], k=3)  # round 1: 3 accepted, 4 not; round 2: no guess after 7
    both = sum([a, b], ngram.Replay(by_position=[0, 0, 0]))
    assert (a.by_position, b.by_position) == ([1, 1, 1], [1, 0, 0])
    assert (both.rounds, both.accepted, both.by_position) == (a.rounds + b.rounds, 4, [2, 1, 1])
    assert (ngram.Replay(1, 1, [1]) + ngram.Replay(1, 2, [1, 1])).by_position == [2, 1]
