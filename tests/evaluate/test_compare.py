"""``evaluate compare`` on two reports (no engine) and its error for a wrong input."""

from __future__ import annotations

import json

from eaglenest.evaluate.cli import main
from eaglenest.evaluate.compare import side_by_side
from eaglenest.evaluate.report import markdown


def _report(al, draft):
    row = {"prompts": 2, "acceptance_length": al, "acceptance_length_per_request": al + 0.1}
    return {"draft": draft, "domains": {"code": row}, "overall": row,
            "context_buckets": {"1024": {**row, "acceptance_length": al - 0.5}}}


def test_compare_reports(tmp_path, capsys):
    (tmp_path / "a.json").write_text(json.dumps(_report(2.0, "d1")))
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "report.json").write_text(json.dumps(_report(2.5, "d2")))
    rc = main(["compare", "--a", str(tmp_path / "a.json"), "--b", str(tmp_path / "b"), f"run.workdir={tmp_path}"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "| code | 2.000 | 2.500 | 0.500 | 2.100 | 2.600 | 0.500 |" in out
    assert "| ctx 1024 | 1.500 | 2.000 | 0.500 |" in out
    assert (tmp_path / "compare" / "compare.md").read_text() == out.rstrip("\n") + "\n"
    prov = json.loads((tmp_path / "compare" / "provenance.json").read_text())  # beside every output
    assert prov["inputs"] == {"a": str(tmp_path / "a.json"), "b": str(tmp_path / "b")}


def test_compare_rejects_unknown_input(tmp_path, capsys):
    assert main(["compare", "--a", str(tmp_path), "--b", str(tmp_path), f"run.workdir={tmp_path}"]) == 2
    assert "neither a report.json nor an exported draft" in capsys.readouterr().err


def test_context_buckets_are_compared_in_token_order():
    """report.json keeps its keys sorted as text (1024, 16384, 2048, ...): the table followed that order."""
    from eaglenest.evaluate.compare import side_by_side

    row = {"acceptance_length": 2.0, "acceptance_length_per_request": 2.0}
    rep = {"draft": "d", "overall": row, "domains": {"x": row},
           "context_buckets": {k: row for k in ("1024", "16384", "2048", "32768", "4096", "8192")}}
    names = [ln.split("|")[1].strip() for ln in side_by_side(rep, rep).splitlines() if "| ctx " in ln]
    assert names == ["ctx 1024", "ctx 2048", "ctx 4096", "ctx 8192", "ctx 16384", "ctx 32768"]


def _columns(line: str) -> int:
    """Cells of a Markdown table row (an escaped ``\\|`` is inside a cell)."""
    return len(line.replace("\\|", "").strip().strip("|").split("|"))


def test_a_group_name_with_a_bar_or_a_line_break_stays_one_cell_of_its_row():
    # A prompt file's category is any text: "math|logic" split the row into one column too many and a
    # line break ended the table, in report.md and compare.md alike.
    row = {"prompts": 2, "acceptance_length": 2.0, "acceptance_length_per_request": 2.0, "acceptance_rate": 0.5,
           "acceptance_by_position": [0.6, 0.4]}
    odd = "math|logic\nhard"
    rep = {"draft": "d", "target": "t", "num_speculative_tokens": 2, "temperature": 0.0, "split": "heldout",
           "al_average": "pooled", "overall": row, "domains": {odd: row, "code": row}}
    for text in (markdown(rep), side_by_side(rep, rep)):
        table = [ln for ln in text.splitlines() if ln.startswith("|")]
        assert len({_columns(ln) for ln in table}) == 1, table
        assert any(ln.startswith("| math\\|logic hard |") for ln in table), table


def test_an_evaluate_offline_folder_is_compared_and_flagged_as_another_method(tmp_path, capsys):
    # `--a <workdir>/eval_offline` was refused as "neither a report.json nor an exported draft", and an
    # offline estimate beside a served AL was not flagged as measured differently.
    offline = {**_report(2.0, "d1"), "method": "offline (HF target, greedy)"}
    (tmp_path / "eval_offline").mkdir()
    (tmp_path / "eval_offline" / "offline_report.json").write_text(json.dumps(offline))
    (tmp_path / "b.json").write_text(json.dumps(_report(2.5, "d2")))
    rc = main(["compare", "--a", str(tmp_path / "eval_offline"), "--b", str(tmp_path / "b.json"),
               f"run.workdir={tmp_path}"])
    out = capsys.readouterr().out
    assert rc == 0 and "| code | 2.000 | 2.500 | 0.500 |" in out
    assert "**Not measured alike**" in out and "method A `offline (HF target, greedy)`, B `None`" in out
    assert json.loads((tmp_path / "compare" / "compare.json").read_text())["settings_differ"] == {
        "method": ["offline (HF target, greedy)", None]}
