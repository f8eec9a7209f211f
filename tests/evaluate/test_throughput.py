"""``evaluate throughput``'s aggregation, report and plot (no server: the sweep's raw points are given).

The live sweep (two vLLM servers) runs in ``bench/serve_throughput.py``; here the arithmetic that
turns its points into rows, paired per-seed speed-ups, the markdown table and the PNG is checked.
"""

from __future__ import annotations

import pytest

from eaglenest.evaluate.throughput import markdown, summarise


def _pt(tok_s: float, ttft: float = 0.1, e2e: float = 1.0) -> dict:
    return {"output_tokens": 320, "requests": 10, "wall_s": 320 / tok_s, "output_tokens_per_s": tok_s,
            "median_ttft_s": ttft, "median_e2e_s": e2e}


def test_summarise_pairs_seeds_and_plot(tmp_path):
    from eaglenest.evaluate.plots import throughput_plot

    points = {"baseline": {1: [_pt(100), _pt(50)], 4: [_pt(200), _pt(200), _pt(100)]},
              "speculative": {1: [_pt(150), _pt(100)], 4: [_pt(100), _pt(300), _pt(100)]}}
    modes, speedup = summarise(points)
    b1 = modes["baseline"][0]
    assert b1["concurrency"] == 1 and b1["output_tokens_per_s"] == {"mean": 75.0, "min": 50.0, "max": 100.0,
                                                                   "median": 75.0, "n": 2}
    assert speedup[0]["speedup"] == pytest.approx(125 / 75, abs=1e-3)
    # Per seed: 150/100 and 100/50, paired by position, not the ratio of means.
    assert speedup[0]["speedup_per_seed"]["min"] == 1.5 and speedup[0]["speedup_per_seed"]["max"] == 2.0
    assert speedup[1]["speedup_per_seed"]["median"] == 1.0 and speedup[1]["speedup_per_seed"]["min"] == 0.5
    result = {"target": "t", "draft": "d", "num_speculative_tokens": 3, "max_tokens": 32, "seeds": [0, 1, 2],
              "modes": modes, "speedup": speedup, "spread": "s"}
    md = markdown(result)
    assert "| 4 | speculative | 166.7 | 100.0 | 300.0 |" in md and "1.00 [0.50, 1.50]" in md
    png = throughput_plot(result, tmp_path)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
