"""What an eleventh newcomer's walk of docs/long_context.md found, each as a check that would catch it
again (beside tests/test_docs_walk_qa7.py, which holds the page's seed formula to the code):

* the page's `make tiny-target-long` line said it equals a command without `--phase-dir`, while the
  Makefile passes `--phase-dir runs/tiny-target-long-phases` (the page's next paragraph says so);
  here the command the page gives is the Makefile's, flag for flag;
* the page's `--remeasure` line continues the committed build from `--base wip-phases/retrieval`, a
  folder of saved phases that is not in the repository: on a fresh clone the line is refused. The page
  now says so, quoting the refusal, and here the line is run verbatim from a folder without it;
* "What to try next" said the committed build reads the recall fact at 2K "0.45 -> 0.08", the figures
  from before the paired remeasure; the page's own table and the card's provenance say 0.296 -> 0.088.
  Here every figure of the page's table, and the 2K figure of that item, is held to provenance.json;
* the phase table, the options' defaults and the measurement's sizes the page states are the recipe
  file's and the code's;
* docs/families.md's table of recipe keys gives the trainer's defaults and each family's K;
* "rows of 2K ... ~5x the optimizer steps for the same tokens": BENCHMARKS.md measured 229 against 69.

No engine, no training: the build's CLI is run only to its refusal, about 10 s in all.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
from pathlib import Path

from eaglenest.tinytarget import long as long_build
from eaglenest.tinytarget import longconfig, longdata, longeval
from eaglenest.train.config import BEST_NUM_SPECULATIVE_TOKENS, TrainConfig, trained_num_speculative_tokens

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "long_context.md"
PROV = ROOT / "assets" / "tiny-target-long" / "provenance.json"
RECIPE = ROOT / "recipes" / "tiny_target" / "long.yaml"


def _page() -> str:
    return PAGE.read_text(encoding="utf-8")


def _command_block() -> list[str]:
    """The lines of the page's "## The command" code block."""
    text = _page()
    start = text.index("## The command")
    block = re.search(r"```bash\n(.*?)```", text[start:], re.S)
    assert block, "docs/long_context.md: no bash block under '## The command'"
    return [line for line in block.group(1).splitlines() if line.strip()]


def _prov() -> dict:
    return json.loads(PROV.read_text(encoding="utf-8"))


def _makefile_command(target: str) -> list[str]:
    """The Makefile recipe of ``target`` as argv, ``$(BIN)/python`` as ``python``."""
    text = (ROOT / "Makefile").read_text(encoding="utf-8").replace("\\\n", " ")
    found = re.search(rf"^{re.escape(target)}:[^\n]*\n\t([^\n]+)", text, re.M)
    assert found, f"Makefile: no target {target}"
    return [("python" if w.endswith("/python") else w) for w in shlex.split(found.group(1))]


def test_the_make_line_says_what_the_makefile_runs():
    line = next(x for x in _command_block() if x.startswith("make tiny-target-long"))
    shown = line.split("# =", 1)
    assert len(shown) == 2, f"the page no longer says what `make tiny-target-long` runs: {line}"
    assert shlex.split(shown[1]) == _makefile_command("tiny-target-long"), (
        f"docs/long_context.md says `make tiny-target-long` = {shown[1].strip()}; the Makefile runs "
        f"{' '.join(_makefile_command('tiny-target-long'))}")


def test_the_remeasure_line_on_a_fresh_clone_is_refused_as_the_page_says(tmp_path, monkeypatch, capsys):
    """The page's ``--remeasure`` line, run from a folder that holds the recipe but not the build's saved
    phases (a fresh clone): refused in one line, the one the page quotes."""
    line = next(x for x in _command_block() if "--remeasure" in x)
    argv = shlex.split(line.split("#", 1)[0])
    assert argv[:3] == ["python", "-m", "eaglenest.tinytarget.long"], line
    base = argv[argv.index("--base") + 1]
    (tmp_path / "recipes" / "tiny_target").mkdir(parents=True)
    (tmp_path / "recipes" / "tiny_target" / "long.yaml").write_bytes(RECIPE.read_bytes())
    monkeypatch.chdir(tmp_path)
    assert long_build.main(argv[3:]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    quoted = [" ".join(q.split()) for q in re.findall(r"`([^`]*no model at[^`]*)`", _page())]
    assert quoted, f"docs/long_context.md does not say that --base {base} is not in the repository " \
                   f"(the line is refused on a fresh clone: {err})"
    assert any(q in err for q in quoted), f"the page quotes {quoted}; the command says {err}"
    assert not (tmp_path / "assets").exists()  # refused before anything is written


def _table_rows(start_marker: str) -> dict[str, list[str]]:
    """``{first cell: cells}`` of the first markdown table after ``start_marker``."""
    text = _page()
    start = text.index(start_marker)
    rows = {}
    for line in text[start:].splitlines()[1:]:
        if rows and not line.startswith("|"):
            break
        if line.startswith("|") and not line.startswith("|---"):
            cells = [c.strip().strip("*`") for c in line.strip("|").split("|")]
            rows[cells[0]] = cells[1:]
    return rows


def _buckets() -> list[tuple[str, dict]]:
    return sorted(_prov()["metrics"]["buckets"].items(), key=lambda kv: int(kv[0]))


def _recall_value(bucket: dict) -> tuple[float, float]:
    """The recall prompts' answer-value probability, whole prompt and last 512 tokens (token-weighted)."""
    rows = [r for r in bucket["per_prompt"] if r["material"] == "recall" and r.get("answer_tokens")]
    n = sum(r["answer_tokens"] for r in rows)
    return (sum(r["answer_kept_sum"] for r in rows) / n, sum(r["answer_removed_sum"] for r in rows) / n)


def test_the_committed_builds_table_is_its_provenance():
    rows = _table_rows("**Status: committed.**")
    conf = rows[next(k for k in rows if k.startswith("target_confidence"))]
    ratio = rows["/ 1K"]
    recall = rows[next(k for k in rows if k.startswith("recall fact's value"))]
    buckets = _buckets()
    assert len(buckets) >= 2, "provenance.json holds no buckets: the loop below would check nothing"
    assert rows["bucket"] == [f"{int(b) // 1024}K" for b, _ in buckets]
    for i, (b, fig) in enumerate(buckets):
        assert float(conf[i]) == round(fig["target_confidence"], 3), f"bucket {b}: confidence"
        assert float(ratio[i]) == round(_prov()["metrics"]["confidence_ratio_to_1k"][b], 3), f"bucket {b}: / 1K"
        kept, removed = (float(x) for x in recall[i].strip("*").split("->"))
        assert (kept, removed) == tuple(round(v, 3) for v in _recall_value(fig)), f"bucket {b}: recall value"


def test_what_to_try_next_quotes_the_committed_builds_2k_figures():
    item = re.search(r"1\. \*\*Retrieval past 2K\.\*\*(.*?)\n2\. ", _page(), re.S)
    assert item, "docs/long_context.md: no 'Retrieval past 2K' item"
    found = re.search(r"reads it at 2K\s+\(([\d.]+) -> ([\d.]+)", item.group(1))
    assert found, item.group(1)
    kept, removed = _recall_value(dict(_buckets())["2048"])
    assert (float(found.group(1)), float(found.group(2))) == (round(kept, 2), round(removed, 2)), (
        f"the page says {found.group(1)} -> {found.group(2)} at 2K; the card's provenance: "
        f"{kept:.3f} -> {removed:.3f}")


def test_the_phase_table_is_the_recipe_file():
    recipe = longconfig.load_recipe(RECIPE)
    phases = {p.name: dict(p.settings) for p in recipe["phases"]}
    rows = _table_rows("| phase | stages | settings | from run |")
    assert list(rows) == list(phases), "the page's phases are not the recipe's, in order"
    for name, (stages, settings, _run) in rows.items():
        assert stages == longconfig.format_stages(phases[name]["stages"]), name
        lr = re.search(r"\blr ([\d.e-]+)", settings)
        assert lr and float(lr.group(1)) == phases[name]["peak_lr"], f"{name}: {settings}"
        weight = re.search(r"answer weight (\d+)", settings)
        assert (float(weight.group(1)) if weight else None) == phases[name].get("answer_weight"), name


def test_the_options_defaults_and_the_measurements_sizes_are_the_codes():
    page, d = _page(), longconfig.LongConfig()
    opts = page[page.index("Options: `--rope-theta`"):]
    assert f"`--adam-beta2` (AdamW's second-moment decay, {d.adam_beta2})" in opts
    assert f"`--warmup-steps` ({d.warmup_steps})" in opts
    assert f"`token_weight` ({d.token_weight:g})" in page
    assert f"a stage shorter than\n{longconfig.MIN_STAGE_TOKENS} tokens" in opts
    assert f"more than {longdata.MAX_PACKED}\nprompts" in opts
    assert f"a span of {longdata.COPY_SPAN} random ordinary tokens" in page
    lo, hi = longdata.REPEAT_SPAN
    assert f"is {lo}-{hi} random\nordinary tokens" in page
    assert d.raw_fraction == 0.25 and "the short corpus keeps a quarter of\nthe rows" in page
    assert f"(default {d.seed}; 0 and {longconfig.EVAL_MATERIAL_SEED} are refused)" in page
    measure = page[page.index("### The measurement"):page.index("## Why the compute")]
    assert f"greedy decode of up to {longeval.MAX_NEW_TOKENS} tokens" in measure
    assert f"material\n`{', '.join(longeval.KINDS)}`" in measure
    assert "(first 8 output tokens,\nlast 512 prompt tokens kept)" in measure
    kw = longeval.measure.__kwdefaults__
    assert (kw["probe_tokens"], kw["keep_tokens"]) == (8, 512)
    assert f"Default {d.eval_prompts_per_bucket} prompts per bucket, one of each kind" in measure
    assert d.eval_prompts_per_bucket == len(longeval.KINDS) and d.eval_buckets == longeval.BUCKETS
    assert longeval.copy_probe.__kwdefaults__["lengths"] == (128, 512, 1024)
    assert "at 128, 512 and 1K tokens, in the card" in page


# ---- docs/families.md: the recipe keys' defaults and each family's K ---------------------------------------

def _families_rows() -> list[list[str]]:
    text = (ROOT / "docs" / "families.md").read_text(encoding="utf-8")
    start = text.index("| family | what vLLM runs per round |")
    rows = []
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


def _default(cfg, dotted: str):
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def test_the_families_table_gives_the_trainers_defaults_and_ks():
    rows = _families_rows()
    assert [re.match(r"`(\w+)`", r[0]).group(1) for r in rows] == list(BEST_NUM_SPECULATIVE_TOKENS)
    seen = 0
    for family_cell, _runs, _forwards, keys, k_cell in rows:
        family = re.match(r"`(\w+)`", family_cell).group(1)
        for key, shown in re.findall(r"`train\.([\w.]+)` \(([^)]+)\)", keys):
            want = _default(TrainConfig(), key)
            assert shown == ("null" if want is None else f"{want:g}" if isinstance(want, float) else str(want)), \
                f"docs/families.md: train.{key} ({shown}); the default is {want}"
            seen += 1
        k = int(re.match(r"(\d+)", k_cell).group(1))
        assert k == BEST_NUM_SPECULATIVE_TOKENS[family], f"{family}: K {k}"
        train = dataclasses.asdict(TrainConfig(family=family))
        assert k <= trained_num_speculative_tokens(train), f"{family}: K {k} past the depth trained by default"
    assert seen >= 8  # the extraction finds the keys (else the loop above checked nothing)


def test_the_row_tokens_step_gain_is_the_measured_one():
    """docs/long_context.md said rows of 2K gave "~5x the optimizer steps for the same tokens"; BENCHMARKS.md
    measured 229 steps against 69 on the same 50.7K tokens (3.3x)."""
    bench = (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8")
    measured = re.search(r"8,704 tokens gave (\d+) optimizer steps in 10 epochs[^.]*?rows of 2K give (\d+) on the\s+"
                         r"same", bench)
    assert measured, "BENCHMARKS.md no longer gives the steps of rows of 8,704 and of 2K tokens"
    before, after = int(measured.group(1)), int(measured.group(2))
    said = re.search(r"`train\.row_tokens`, ~(\d+)x the optimizer steps for\s+the same tokens", _page())
    assert said, "docs/long_context.md no longer gives the steps rows of 2K tokens gain"
    assert int(said.group(1)) == round(after / before), \
        f"the page says ~{said.group(1)}x the steps; BENCHMARKS.md measured {after} vs {before}"


def test_the_pages_summary_of_the_committed_build_is_its_provenance():
    """"Both conditions hold" and "Short prompts cost little": the ratio at 32K, the pooled answer value at 1K
    and the short held-out top-1 before -> after, against the two fixtures' provenance."""
    page, long_m = _page(), _prov()["metrics"]
    base_m = json.loads((ROOT / "assets" / "tiny-target" / "provenance.json").read_text(encoding="utf-8"))["metrics"]
    ratio = re.search(r"Both conditions hold: ([\d.]+) x at 32K", page)
    assert ratio and float(ratio.group(1)) == round(long_m["confidence_ratio_to_1k"]["32768"], 3)
    pooled = re.search(r"pooled go ([\d.]+) -> ([\d.]+) at 1K", page)
    far = long_m["buckets"]["1024"]["far_context"]
    assert pooled and (float(pooled.group(1)), float(pooled.group(2))) == \
        (round(far["answer_value_kept"], 2), round(far["answer_value_removed"], 2))
    short = page[page.index("Short prompts cost little"):]
    shown = dict((d, (float(a), float(b))) for d, a, b in
                 re.findall(r"(arithmetic|records|code|prose)\s+([\d.]+) -> ([\d.]+)", short[:300]))
    assert set(shown) == set(long_m["held_out"]), shown
    for domain, (before, after) in shown.items():
        assert (before, after) == (round(base_m["held_out"][domain]["top1_accuracy"], 3),
                                   round(long_m["held_out"][domain]["top1_accuracy"], 3)), domain
