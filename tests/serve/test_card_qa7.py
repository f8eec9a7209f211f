"""Hostile inputs to the Hub card's AL table (``serve push``): group names are a prompt file's
``category`` or a manifest domain, any text, and each must stay one cell of its row."""

from __future__ import annotations

import re

from eaglenest.serve.push import card


def _cells(line: str) -> list[str]:
    """The cells of a Markdown table row (a ``\\|`` is text inside a cell, not a border)."""
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]


def test_al_table_keeps_odd_group_names_in_one_cell():
    names = ["maths | logic", "two\nlines", "émoji 🦅 домен", "plain"]
    report = {"num_speculative_tokens": 1, "temperature": 0.0,
              "domains": {n: {"prompts": 2, "acceptance_length": 1.5, "acceptance_length_per_request": 1.4,
                              "acceptance_by_position": [0.5]} for n in names},
              "overall": {"prompts": 8, "acceptance_length": 1.5, "acceptance_by_position": [0.5]}}
    text = card("# card", {"inputs": {"target": "/models/t"}}, licences={"src": "mit"}, manifest_name="m",
                report=report)
    lines = text.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("| group |"))
    rows = []
    for line in lines[head + 2:]:
        if not line.startswith("|"):
            break
        rows.append(_cells(line))
    width = len(_cells(lines[head]))
    assert width == 5  # group, prompts, AL pooled, AL per-request, pos 1
    assert len(rows) == len(names) + 1, rows  # one row per group and the overall row: no name broke a row
    assert all(len(r) == width for r in rows), rows
    assert [r[0] for r in rows[:-1]] == ["maths \\| logic", "two lines", "émoji 🦅 домен", "plain"]
    assert rows[0][2] == "1.500" and rows[-1][0] == "**overall**"
