"""Memory-fit refusals: estimates that grow as they should, one clear line naming the key, and each
stage refusing a unit that cannot fit before any engine or trainer starts (and passing the recipes
that run today)."""

from __future__ import annotations

import json

import pytest

from eaglenest import memfit
from eaglenest.errors import ConfigError
from eaglenest.recipe import load_recipe

TINY = "assets/tiny-target"
#: A config-only "target" far too large for any test machine at 1M tokens (no weights on disk).
HUGE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 16384, "num_hidden_layers": 126,
        "num_attention_heads": 128, "num_key_value_heads": 128, "head_dim": 128, "intermediate_size": 53248,
        "vocab_size": 128256, "max_position_embeddings": 1 << 20, "dtype": "bfloat16"}


def _train(pack_tokens: int, **kw):
    args = dict(pack_tokens=pack_tokens, rows=1, hidden=128, num_aux=3, heads=4, head_dim=32, intermediate=384,
                draft_vocab=1024, target_vocab=2048, ttt_steps=7, attn_chunk_tokens=2048, target_chunk_tokens=2048)
    return memfit.train_estimate(**{**args, **kw})


def test_training_memory_grows_linearly_past_the_attention_chunk():
    a, b, c = (_train(n).total_bytes for n in (8192, 16384, 32768))
    assert b - a == (c - b) // 2  # linear: every term is O(tokens) once rows are chunked
    dense = _train(2048).parts["attention_scores"]
    assert dense == 7 * 4 * 2048 * 2048 * 4  # up to the chunk: a dense [T, T] per head and TTT step


def test_require_fit_names_the_estimate_the_memory_and_the_key():
    est = memfit.Estimate("a thing", "train.pack_tokens", {"a": 3 << 30, "b": 1 << 30})
    memfit.require_fit(est, available=4 << 30)  # exactly fits
    with pytest.raises(ConfigError) as e:
        memfit.require_fit(est, available=2 << 30)
    line = str(e.value)
    assert "\n" not in line and line.startswith("train.pack_tokens: a thing needs about 4.00 GiB (a 3.00 GiB")
    assert "2.00 GiB of memory available; lower train.pack_tokens" in line


def test_capture_estimate_counts_the_captured_rows_and_the_kv():
    dims = memfit.target_dims(json.loads(open(f"{TINY}/config.json").read()))
    est = memfit.capture_estimate(dims, tokens=32768, weights=memfit.weights_bytes(TINY, dims), capture_layers=4,
                                  stored_bytes_per_token=4 * 128 * 4, key="k")
    assert est.parts["kv_cache"] == 32768 * 2 * 8 * 4 * 32 * 4
    assert est.parts["captured_rows"] == 3 * 32768 * 2048
    memfit.require_fit(est)  # the tiny target at 32K fits any machine the suite runs on
    huge = memfit.target_dims(HUGE)
    big = memfit.capture_estimate(huge, tokens=1 << 20, weights=memfit.weights_bytes("-", huge), capture_layers=4,
                                  stored_bytes_per_token=4 * 16384 * 2, key="k")
    with pytest.raises(ConfigError, match=r"^k: capturing the longest conversation \(1048576 tokens\) needs about"):
        memfit.require_fit(big)


def test_train_run_refuses_a_row_too_long_for_memory_before_anything(tmp_path, capsys):
    from eaglenest.pipeline import commands
    from eaglenest.pipeline.train_cli import main

    commands.check_fit(load_recipe("recipes/toy.yaml", []))  # what runs today passes
    commands.check_fit(load_recipe("recipes/long.yaml", []))
    work = tmp_path / "w"
    rc = main(["run", "--recipe", "recipes/toy.yaml", f"run.workdir={work}", "train.pack_tokens=50000000"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert "error: train.pack_tokens: a training step of 4 row(s) of 50000000 tokens" in err[0]
    assert "GiB of memory available; lower train.pack_tokens" in err[0]
    assert not (work / "train").exists()


def test_evaluate_refuses_a_bucket_too_long_for_memory_and_shortens_past_positions(tmp_path):
    from eaglenest.evaluate.commands import check_fit
    from eaglenest.evaluate.settings import evaluate_config

    huge = tmp_path / "huge"
    huge.mkdir()
    (huge / "config.json").write_text(json.dumps(HUGE))
    recipe = load_recipe("recipes/long_eval.yaml", [])
    check_fit(TINY, evaluate_config(recipe))  # 1K-32K on the tiny target: fits
    far = load_recipe("recipes/long_eval.yaml", ["evaluate.context_buckets=[100000000]"])
    check_fit(TINY, evaluate_config(far))  # past 32768 positions: shortened to them (as evaluate does), fits
    with pytest.raises(ConfigError, match=r"^evaluate\.context_buckets: serving the longest context bucket "
                                          r"\(1048576 tokens with its output\) needs about .* GiB"):
        check_fit(str(huge), evaluate_config(far))


def test_ingest_build_refuses_a_composed_chat_longer_than_the_engine(tmp_path, capsys):
    from eaglenest.ingest.cli import main

    work = tmp_path / "w"
    rc = main(["build", "--recipe", "recipes/long.yaml", f"run.workdir={work}", "ingest.engine.max_model_len=4096"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert "ingest.engine.max_model_len: 4096 is shorter than the longest composed conversation (8352 tokens" in err[0]
    assert not work.exists()


@pytest.mark.parametrize("family", ["peagle", "dflash"])
def test_anchors_past_a_rows_tokens_are_not_counted_in_the_memory_check(family):
    """The trainer draws at most one anchor per position of a row; the memory check counted all of
    ``anchors_per_row``: 10**7 anchors on 64-token rows was refused as needing ~10**8 GiB."""
    from eaglenest.pipeline import commands

    over = [f"train.family={family}", f"train.{family}.anchors_per_row=10000000", "train.pack_tokens=64"]
    commands.check_fit(load_recipe("recipes/toy.yaml", over))  # runs: fits
    at = [f"train.family={family}", f"train.{family}.anchors_per_row=64", "train.pack_tokens=64"]
    recipes = [load_recipe("recipes/toy.yaml", o) for o in (over, at)]
    cfg = memfit.load_target_config(recipes[0].run.target)
    big, same = (commands._train_estimate(r, cfg, r.train) for r in recipes)
    assert big.total_bytes == same.total_bytes
