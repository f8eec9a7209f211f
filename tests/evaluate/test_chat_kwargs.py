"""Evaluation renders prompts with the chat-template kwargs the training prompts were generated with:
``evaluate.chat_template_kwargs`` resolves to ``ingest.chat_template_kwargs`` plus the manifest's
reasoning switch unless set, and every renderer (``prompts.render``, the context buckets, the
offline path) uses it. No engine: ``tests/ingest/test_reasoning.py`` checks vLLM's own rendering
(``evaluate.run._decode``) against ``render`` on a real engine."""

from __future__ import annotations

import logging

from eaglenest.evaluate.buckets import build_bucket_prompts
from eaglenest.evaluate.settings import evaluate_config
from eaglenest.evaluate.offline import prompt_ids
from eaglenest.evaluate.prompts import render
from eaglenest.hf import load_tokenizer
from eaglenest.recipe import load_recipe

QUESTION = [{"role": "user", "content": "What is 2 + 3?"}]


def test_render_passes_the_kwargs_to_the_template(thinking_target):
    tok = load_tokenizer(thinking_target, trust_remote_code=False)
    on, off, none = (tok.decode(render(tok, QUESTION, k)) for k in ({"enable_thinking": True},
                                                                   {"enable_thinking": False}, None))
    assert on.endswith("<|assistant|>\n<think>\n")
    assert off.endswith("<|assistant|>\n<think>\n\n</think>\n\n")
    assert none.endswith("<|assistant|>\n")
    kwargs = {"enable_thinking": True}
    assert prompt_ids(tok, {"messages": QUESTION}, kwargs) == render(tok, QUESTION, kwargs)
    material = [([{"role": "user", "content": f"Question {i}?"}], f"Answer {i}.") for i in range(4)]
    (bucket,) = build_bucket_prompts(tok, material, (128,), per_bucket=1, max_positions=4096, max_tokens=16,
                                     chat_template_kwargs=kwargs)[128]
    assert tok.decode(bucket["prompt_token_ids"]).endswith("<|assistant|>\n<think>\n")


def test_evaluate_uses_the_ingest_kwargs_unless_set(tmp_path, root, caplog):
    manifest = tmp_path / "m.yaml"
    manifest.write_text(f"name: m\nlicence: CC0-1.0\ngeneration:\n  reasoning: 'on'\ndomains:\n  a:\n"
                        f"    cap_prompts: 4\n    sources:\n      - path: {root}/recipes/data/arithmetic.jsonl\n"
                        f"        provenance: test\n")
    # A work dir of its own: a store left in the recipe's (after `make demo`) would decide instead.
    base = [f"run.workdir={tmp_path / 'run'}", f"ingest.manifest={manifest}", "ingest.chat_template_kwargs={custom: 1}"]
    cfg = evaluate_config(load_recipe(root / "recipes/toy.yaml", base))
    assert cfg.chat_template_kwargs == {"custom": 1, "enable_thinking": True}
    cfg = evaluate_config(load_recipe(root / "recipes/toy.yaml", base + ["evaluate.chat_template_kwargs={}"]))
    assert cfg.chat_template_kwargs == {}  # set explicitly: the template's defaults
    with caplog.at_level(logging.WARNING):
        cfg = evaluate_config(load_recipe(root / "recipes/toy.yaml", [base[0], f"ingest.manifest={tmp_path}/none.yaml",
                                                                      "ingest.chat_template_kwargs={custom: 1}"]))
    assert cfg.chat_template_kwargs == {"custom": 1} and "manifest not read" in caplog.text
    assert evaluate_config(load_recipe(root / "recipes/toy.yaml", base[:1])).chat_template_kwargs == {}


def _manifest_file(tmp_path, root, reasoning: str):
    path = tmp_path / f"manifest-{reasoning}.yaml"
    path.write_text(f"name: m-{reasoning}\nlicence: CC0-1.0\ngeneration:\n  reasoning: '{reasoning}'\ndomains:\n"
                    f"  arithmetic:\n    cap_prompts: 4\n    held_out_count: 2\n    sources:\n"
                    f"      - path: {root}/recipes/data/arithmetic.jsonl\n        provenance: test\n")
    return path


def test_evaluation_renders_in_the_mode_the_store_was_built_in(tmp_path, root, thinking_target, caplog):
    """`ingest build --manifest mine.yaml` (reasoning on) records how it rendered the prompts; `evaluate`
    through a recipe whose manifest says off renders as the store says, and says so in one warning
    line. No engine: a pool of held-out prompts only is written without generation."""
    from eaglenest.ingest.build import build
    from eaglenest.ingest.config import IngestConfig
    from eaglenest.ingest.manifest import load_manifest
    from eaglenest.ingest.pool import load_pool

    mine, other = _manifest_file(tmp_path, root, "on"), _manifest_file(tmp_path, root, "off")
    recipe = load_recipe(root / "recipes/toy.yaml", [f"run.workdir={tmp_path}/run", f"run.target={thinking_target}",
                                                     f"ingest.manifest={other}"])
    m = load_manifest(mine)
    heldout = [e for e in load_pool(m, target=str(thinking_target)) if e.split == "heldout"]
    assert heldout
    stats = build(m, heldout, target=str(thinking_target), store_uri=recipe.run.store_uri, cfg=IngestConfig())
    assert stats["chat_template_kwargs"] == {"enable_thinking": True}

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="eaglenest.evaluate.settings"):
        cfg = evaluate_config(recipe)
    assert cfg.chat_template_kwargs == {"enable_thinking": True}  # the store's mode, not the recipe's
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "\n" not in warnings[0], warnings
    assert "as the store's prompts were rendered" in warnings[0] and str(other) in warnings[0]
    assert "enable_thinking: False" in warnings[0]

    # Told otherwise: --manifest (the same meaning as on ingest build) or evaluate.chat_template_kwargs.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="eaglenest.evaluate.settings"):
        assert evaluate_config(recipe, manifest=str(other)).chat_template_kwargs == {"enable_thinking": False}
    assert "from --manifest" in caplog.text
    assert evaluate_config(recipe, manifest=str(mine)).chat_template_kwargs == {"enable_thinking": True}
    explicit = load_recipe(root / "recipes/toy.yaml", [f"run.workdir={tmp_path}/run", f"ingest.manifest={other}",
                                                       "evaluate.chat_template_kwargs={}"])
    assert evaluate_config(explicit).chat_template_kwargs == {}

    # The recipe agreeing with the store: no warning.
    caplog.clear()
    agree = load_recipe(root / "recipes/toy.yaml", [f"run.workdir={tmp_path}/run", f"ingest.manifest={mine}"])
    with caplog.at_level(logging.WARNING, logger="eaglenest.evaluate.settings"):
        assert evaluate_config(agree).chat_template_kwargs == {"enable_thinking": True}
    assert not caplog.records
