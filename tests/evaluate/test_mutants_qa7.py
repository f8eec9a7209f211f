"""First-principles checks of the evaluation's figures, written where a plausible slip (a mutant of
the code) left every earlier test passing: each test computes its expectation independently."""

from __future__ import annotations

import random
import statistics
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

from eaglenest.evaluate.al import SpecCounters, per_request_summary
from eaglenest.evaluate.buckets import _chat_prompt, bucket_lengths, distinct_lengths, merged_buckets
from eaglenest.evaluate.compare import differences, side_by_side
from eaglenest.evaluate.intervals import add_ratio_intervals, bootstrap, bucket_intervals, ratio_stat, spec_counts
from eaglenest.evaluate.ngram import NgramTable, simulate
from eaglenest.evaluate.throughput import _spread, server_counters
from eaglenest.hf import load_tokenizer


def _metrics(*hists):
    return [SimpleNamespace(histogram=list(h)) for h in hists]


def test_per_request_median_of_an_even_number_of_requests_is_the_middle_pair_mean():
    # Request ALs: 1 + accepted / rounds = 1.0, 2.0, 3.0, 4.0 (k = 3: histograms indexed by accepted count).
    hists = ([4, 0, 0, 0], [0, 4, 0, 0], [0, 0, 2, 0], [0, 0, 0, 5])
    als = [1 + sum(j * c for j, c in enumerate(h)) / sum(h) for h in hists]
    out = per_request_summary(_metrics(*hists))
    assert out["acceptance_length_per_request_median"] == round(statistics.median(als), 4) == 2.5
    assert out["acceptance_length_per_request"] == round(statistics.fmean(als), 4)
    odd = per_request_summary(_metrics(*hists[:3]))
    assert odd["acceptance_length_per_request_median"] == round(statistics.median(als[:3]), 4) == 2.0


def test_counter_delta_from_an_engine_with_no_counts_yet_keeps_every_position():
    # Before the first group vLLM may export no per-position series at all: the delta is the totals.
    before = SpecCounters(0, 0, 0, ())
    after = SpecCounters(6, 18, 7, (4, 2, 1))
    delta = after - before
    assert delta == after
    assert delta.summary()["acceptance_by_position"] == [round(4 / 6, 4), round(2 / 6, 4), round(1 / 6, 4)]
    # and the other way round, as a running total starts from nothing
    assert SpecCounters(0, 0, 0, ()) + after == after


def test_a_bucket_of_one_prompt_gets_no_interval_however_it_is_drawn():
    # Every resample of one prompt is that prompt: a zero-width interval would read as certainty.
    one = [{"accepted_tokens": 7, "draft_rounds": 4}]
    assert bootstrap(1, ratio_stat([7], [4], 1.0), resamples=200, seed=0) is None
    assert bucket_intervals(one, resamples=200, seed=0) == {}
    two = one + [{"accepted_tokens": 1, "draft_rounds": 4}]
    low, high = bucket_intervals(two, resamples=400, seed=0)["acceptance_length"]
    # the two possible single-prompt figures bound every draw: 1 + 1/4 and 1 + 7/4
    assert 1.25 <= low < high <= 2.75


def test_every_bootstrap_draw_has_the_buckets_size_and_only_its_indices():
    seen: list[list[int]] = []

    def stat(idx: list[int]) -> float:
        seen.append(idx)
        return float(len(idx))

    assert bootstrap(5, stat, resamples=300, seed="s") == (5.0, 5.0)
    assert len(seen) == 300 and all(0 <= i < 5 for idx in seen for i in idx)
    assert {i for idx in seen for i in idx} == set(range(5))  # with replacement, every prompt drawn some time


def _bucket(al_rows: list[tuple[int, int]]) -> dict:
    rows = [{"sample_id": f"p{i}", "pair": i, "accepted_tokens": a, "draft_rounds": r}
            for i, (a, r) in enumerate(al_rows)]
    return {"prompts": len(rows), "per_prompt": rows,
            "acceptance_length": round(1 + sum(a for a, _ in al_rows) / sum(r for _, r in al_rows), 4)}


def test_ratio_to_shortest_takes_the_shortest_bucket_by_tokens_not_by_text():
    # report.json's keys are text: "1024" sorts before "512", yet 512 tokens is the shortest bucket.
    report = {"context_buckets": {"1024": _bucket([(2, 4), (6, 4)]), "512": _bucket([(4, 4), (4, 4)])}}
    add_ratio_intervals(report, resamples=200, seed=0)
    assert report["bucket_intervals"]["ratio_to_shortest"]["bucket"] == "512"
    assert "al_ratio_to_shortest" not in report["context_buckets"]["512"]
    assert report["context_buckets"]["1024"]["al_ratio_to_shortest"] == round(2.0 / 2.0, 4)


def test_buckets_of_different_prompt_counts_are_not_paired():
    # Documented: paired only when every bucket has the shortest one's prompts (same count, same pairs);
    # a bucket holding two of its three questions is drawn independently, and the report says so.
    report = {"context_buckets": {"1024": _bucket([(2, 4), (6, 4), (1, 4)]), "2048": _bucket([(2, 4), (6, 4)])}}
    add_ratio_intervals(report, resamples=200, seed=0)
    how = report["bucket_intervals"]["ratio_to_shortest"]
    assert how["paired"] is False and "independently" in how["method"]
    full = {"context_buckets": {"1024": _bucket([(2, 4), (6, 4)]), "2048": _bucket([(1, 4), (3, 4)])}}
    add_ratio_intervals(full, resamples=200, seed=0)
    assert full["bucket_intervals"]["ratio_to_shortest"]["paired"] is True


def test_spec_counts_are_rounds_and_accepted_tokens_of_the_histogram():
    # histogram[j]: rounds that accepted exactly j draft tokens
    got = spec_counts(SimpleNamespace(histogram=[2, 1, 3]))
    assert got == {"draft_rounds": 6, "accepted_tokens": 0 * 2 + 1 * 1 + 2 * 3, "acceptance_histogram": [2, 1, 3]}
    assert spec_counts(None) == {"draft_rounds": 0, "accepted_tokens": 0, "acceptance_histogram": []}


def test_ngram_replay_drafts_after_the_prefill_token():
    # vLLM: the prefill emits output[0]; the first round drafts from the context ending with it.
    table = NgramTable(order=1, next_token={(1,): 9, (5,): 6, (6,): 7, (7,): 8}, fit_tokens=4)
    r = simulate(table, [1], [5, 6, 7, 8], k=2)
    # round 1: context ..5 -> guesses 6, 7 (both right), emits 6 7 + the target's 8: done
    assert (r.rounds, r.accepted, r.by_position) == (1, 2, [1, 1])
    assert r.acceptance_length == 3.0


def test_ngram_replay_context_holds_the_targets_own_token_of_each_round():
    # k = 1; each round emits the accepted guess and the target's token: the next round drafts after that one.
    table = NgramTable(order=1, next_token={(5,): 6, (6,): 0, (7,): 8, (8,): 9}, fit_tokens=4)
    r = simulate(table, [], [5, 6, 7, 8, 9], k=1)
    assert (r.rounds, r.accepted) == (2, 2)  # [6 ok] + 7, then [8 ok] + 9


def test_ngram_guess_prefers_the_longest_known_context():
    table = NgramTable(order=2, next_token={(4, 5): 6, (5,): 9}, fit_tokens=2)
    assert table.guess([4, 5]) == 6
    assert table.guess([3, 5]) == 9  # unknown pair: backs off to the last token
    assert table.guess([]) is None


def test_buckets_shortened_to_one_length_are_decoded_once_under_the_shortest():
    # A 1000-position target: 1024, 2048 and 4096 all shorten to 1000 - 64 prompt tokens.
    lengths = bucket_lengths((4096, 512, 2048, 1024), max_positions=1000, max_tokens=64)
    assert lengths == {4096: 936, 512: 512, 2048: 936, 1024: 936}
    assert merged_buckets(lengths) == {1024: [2048, 4096]}
    assert distinct_lengths(lengths) == {512: 512, 1024: 936}


def test_a_chat_bucket_prompt_ends_with_the_same_latest_turns_at_every_length(tiny_target):
    # Paired buckets: prompt i is the same conversation at every length, cut further back; so the
    # shorter prompt (BOS aside) is the tail of the longer one, and both end with the question.
    tok = load_tokenizer(str(tiny_target), trust_remote_code=False)
    words = ["sea", "mountain range", "quiet old library", "river", "desert at night", "city"]
    material = [([{"role": "user", "content": f"Question {i} about the {w}?"}],
                 f"Answer {i}: the {w} is " + "very " * i + "wide.") for i, w in enumerate(words)]
    short, _ = _chat_prompt(tok, material, 60, random.Random("s:0"), None)
    long, passes = _chat_prompt(tok, material, 300, random.Random("s:0"), None)
    assert len(short) == 60 and len(long) == 300 and passes >= 1
    bos = 1 if tok.bos_token_id is not None and long[:1] == [tok.bos_token_id] else 0
    assert short[:bos] == long[:bos]
    assert long[len(long) - (60 - bos):] == short[bos:]


def _report(**over) -> dict:
    row = {"prompts": 4, "acceptance_length": 2.0, "acceptance_length_per_request": 2.0}
    return {"draft": "d", "target": "t", "num_speculative_tokens": 3, "temperature": 0.0, "max_tokens": 64,
            "bucket_max_tokens": 64, "split": "heldout", "domains": {"a": dict(row)}, "overall": dict(row),
            "context_buckets": {"1024": {**row, "prompt_tokens": 1024}}, **over}


def test_compare_flags_reports_measured_with_another_number_of_draft_tokens():
    # AL grows with K: a delta between K=3 and K=1 is not the drafts' difference.
    assert differences(_report(), _report()) == {}
    assert differences(_report(), _report(num_speculative_tokens=1)) == {"num_speculative_tokens": [3, 1]}
    md = side_by_side(_report(), _report(num_speculative_tokens=1))
    assert "**Not measured alike**" in md and "num_speculative_tokens A `3`, B `1`" in md


def test_compare_flags_a_bucket_shortened_to_another_length():
    # The same bucket name over prompts of other lengths (another target's positions) is no like delta.
    b = _report(context_buckets={"1024": {"prompts": 4, "acceptance_length": 2.0, "prompt_tokens": 960}})
    assert differences(_report(), b) == {"prompts": [{"ctx 1024": {"prompts": 4, "prompt_tokens": 1024}},
                                                    {"ctx 1024": {"prompts": 4, "prompt_tokens": 960}}]}


def test_throughput_spread_reports_the_median_of_the_seeds():
    assert _spread([1.0, 2.0, 10.0]) == {"mean": round(13 / 3, 4), "min": 1.0, "max": 10.0, "median": 2.0, "n": 3}


class _Metrics(BaseHTTPRequestHandler):
    TEXT = ("# HELP vllm:spec_decode_num_drafts_total drafts\n# TYPE vllm:spec_decode_num_drafts_total counter\n"
            'vllm:spec_decode_num_drafts_total{engine="0",model_name="target"} 3.0\n'
            'vllm:spec_decode_num_drafts_total{engine="1",model_name="target"} 4.0\n'
            'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="target"} 5.0\n'
            'vllm:generation_tokens_total{engine="0",model_name="a b"} 20.0\n'
            'vllm:spec_decode_num_drafts_created{engine="0"} 1.7e9\n')

    def do_GET(self):  # noqa: N802 - http.server's naming
        body = self.TEXT.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_server_counters_sum_every_label_set():
    # One series per engine (data parallel) or label set: the server's total is their sum.
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Metrics)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        got = server_counters(f"http://127.0.0.1:{srv.server_port}")
    finally:
        srv.shutdown()
        srv.server_close()
    assert got == {"generation_tokens": 20.0, "drafts": 7.0, "draft_tokens": 0.0, "accepted_tokens": 5.0}
