"""README's five commands, walked by a new user on a target of their own that is not the tiny default.

The user read README.md and docs/manifest.md only: they write a small manifest and a recipe in a
folder of their own (a name with a blank), name the target relatively (``../my models/three layers``,
read from the current directory, docs/targets.md), leave ``featurestore.layer_ids`` at its default,
and run ``ingest build``, ``featurestore capture``, ``train run``, ``serve export`` and ``evaluate al``
through the installed console entry points, in this process, from that folder.

The target is the tiny target cut to its first 3 decoder layers (its own trained weights, config.json
says 3). vLLM's default aux layers ``(2, L//2, L-3)`` are ``(2, 1, 0)`` there, distinct, which
docs/targets.md lists as a default that applies; capture refused them as "not ascending" although the
user gave none. vLLM hands aux layers over in layer order, so the table, the checkpoint and the
export must all say ``(0, 1, 2)``, and vLLM must draft with the export.

Three engines (ingest, capture, evaluate's): about 3 minutes on the 2-core machine under load.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from eaglenest.evaluate.cli import main as evaluate_main
from eaglenest.featurestore import schema as S
from eaglenest.featurestore.cli import main as featurestore_main
from eaglenest.featurestore.table import store
from eaglenest.ingest.cli import main as ingest_main
from eaglenest.pipeline.train_cli import main as train_main
from eaglenest.serve.cli import main as serve_main

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
NUM_LAYERS = 3
#: Rows of each demo source the user copies (held out: 1 per domain).
ROWS = 8
#: The walk, in README's order: (name, entry point, command).
STAGES = [("ingest", ingest_main, "build"), ("featurestore", featurestore_main, "capture"),
          ("train", train_main, "run"), ("serve", serve_main, "export"), ("evaluate", evaluate_main, "al")]


def cut_target(out: Path, num_layers: int) -> Path:
    """The tiny target's first ``num_layers`` decoder layers, as a Hugging Face folder at ``out``."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(ROOT / "assets" / "tiny-target", out)
    state = load_file(str(out / "model.safetensors"))
    kept = {k: v for k, v in state.items()
            if not (k.startswith("model.layers.") and int(k.split(".")[2]) >= num_layers)}
    save_file(kept, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": num_layers}, indent=2))
    return out


def write_project(work: Path) -> Path:
    """A manifest (docs/manifest.md's keys) over copies of two demo sources, and a recipe naming the
    target relatively; small engines and a few steps so the walk stays short. Returns the recipe."""
    (work / "data").mkdir(parents=True)
    for name in ("arithmetic", "prose"):
        lines = (ROOT / "recipes" / "data" / f"{name}.jsonl").read_text().splitlines()[:ROWS]
        (work / "data" / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    domains = {name: {"cap_prompts": ROWS, "sources": [{"path": f"data/{name}.jsonl", "field": "prompt",
                                                         "provenance": "copied from the eaglenest demo"}]}
               for name in ("arithmetic", "prose")}
    manifest = {"name": "mine", "version": 1, "licence": "CC0-1.0", "held_out_count": 1,
                "generation": {"temperature": 0.0, "max_tokens": 32, "seed": 0}, "domains": domains}
    (work / "manifest.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))
    engine = {"max_model_len": 512, "memory_fraction": 0.1, "max_num_seqs": 8}
    recipe = {"run": {"workdir": "runs/mine", "target": "../my models/three layers"},
              "ingest": {"manifest": "manifest.yaml", "engine": dict(engine)},
              "featurestore": {"engine": dict(engine)},
              "train": {"num_steps": 3, "warmup_steps": 1, "batch_rows": 2, "state": {"every_steps": 0}},
              # No lossless pass (a second engine): vLLM's greedy verification makes any draft lossless, so it
              # would prove nothing of the export; that vLLM drafts with it (aux layer 0 included) does.
              "evaluate": {"max_tokens": 16, "max_prompts_per_domain": 1, "context_buckets": [], "ngram_order": 0,
                           "check_lossless": False, "engine": dict(engine)}}  # copies: YAML aliases are refused
    (work / "recipe.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    return work / "recipe.yaml"


@pytest.fixture(scope="module")
def walked(tmp_path_factory):
    root = tmp_path_factory.mktemp("newuser")
    target = cut_target(root / "my models" / "three layers", NUM_LAYERS)
    work = root / "work dir"
    write_project(work)
    codes = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(work)
        for name, main, command in STAGES:
            codes[name] = main([command, "--recipe", "recipe.yaml"])
            if codes[name]:
                break  # the next stage needs this one's output; its error is on stderr above
    return work, target, codes


def test_every_command_of_the_walk_succeeds(walked):
    _, _, codes = walked
    assert codes == {name: 0 for name, _, _ in STAGES}, codes


def test_the_default_aux_layers_of_a_three_layer_target_are_taken_in_layer_order(walked):
    work, target, codes = walked
    assert codes.get("serve") == 0, codes
    meta = S.feature_meta(store.dataset(str(work / "runs" / "mine" / "store"), store.FEATURES).schema)
    assert meta.layer_ids == (0, 1, 2) and meta.last_layer_id == NUM_LAYERS
    draft = json.loads((work / "runs" / "mine" / "draft" / "config.json").read_text())
    assert draft["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    assert draft["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [-1, 0, 1]  # "output of block k"


def test_vllm_drafts_with_the_export(walked):
    work, _, codes = walked
    assert codes.get("evaluate") == 0, codes
    report = json.loads((work / "runs" / "mine" / "eval" / "report.json").read_text())
    overall, k = report["overall"], report["num_speculative_tokens"]
    assert overall["draft_rounds"] > 0 and overall["draft_tokens"] == k * overall["draft_rounds"], overall
    assert set(report["domains"]) == {"arithmetic", "prose"}, sorted(report["domains"])
