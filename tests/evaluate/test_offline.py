"""Offline AL (HF target + PyTorch draft) against vLLM's served AL on the same prompts.

The draft is trained here in a few seconds on the committed tiny target's own greedy outputs
(Hugging Face features, draft step 0 only), so acceptance is well above 1 and position-dependent;
a random draft (AL ~1) would make agreement trivial. Greedy, fp32 target and draft: the offline
replay should reproduce vLLM's rounds exactly, so the test asserts identical outputs and round
counts, and AL within 1% (the issue asks for 3%).
"""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

pytestmark = pytest.mark.slow

K, MAX_TOKENS = 3, 48


def _prompts(root, start: int, n: int) -> list[dict]:
    out = []
    for d in ("arithmetic", "records", "prose"):
        rows = [json.loads(line) for line in (root / "recipes" / "data" / f"{d}.jsonl").read_text().splitlines()]
        for r in rows[start:start + n]:
            msgs = ([{"role": "system", "content": r["system"]}] if r.get("system") else [])
            out.append({"sample_id": r["id"], "domain": d, "messages": msgs + [{"role": "user", "content": r["prompt"]}]})
    return out


def _train_draft(tiny_target, train_prompts, out_dir):
    """~150 Adam steps on draft step 0 (predict token i+2 from target feature i and token i+1)."""
    import numpy as np
    import torch

    from eaglenest.evaluate.offline import _aux, load_target, prompt_ids
    from eaglenest.serve.export import export_draft
    from eaglenest.train.checkpoint import save_checkpoint
    from eaglenest.train.config import TrainConfig
    from eaglenest.train.loop import build_draft
    from eaglenest.train.target import load_target_tensors
    from eaglenest.train.vocab import select_vocab

    torch.manual_seed(0)
    model, tok, _ = load_target(tiny_target)
    seqs = []
    with torch.no_grad():
        for p in train_prompts:
            ids = torch.tensor([prompt_ids(tok, p)])
            seqs.append(model.generate(ids, max_new_tokens=64, do_sample=False)[0])
    counts = np.bincount(torch.cat(seqs).numpy(), minlength=model.config.vocab_size)
    vocab = select_vocab(counts, 256)
    layer_ids = (2, 4, 5)
    draft = build_draft(TrainConfig(draft_vocab_size=256), load_target_tensors(tiny_target),
                        layer_ids=layer_ids, vocab=vocab, seed=0)
    t2d_index = torch.full((model.config.vocab_size,), -100, dtype=torch.long)
    t2d_index[torch.as_tensor(vocab.draft_ids)] = torch.arange(vocab.size)
    with torch.no_grad():
        data = [(_aux(model(s[None], output_hidden_states=True).hidden_states, layer_ids).clone(), s) for s in seqs]
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=3e-3)
    for step in range(150):
        aux, s = data[step % len(data)]
        t = len(s) - 2
        normed, _ = draft.step(s[None, 1:t + 1], draft.combine(aux[None, :t]), torch.arange(t)[None], [],
                               torch.ones(1, t, t, dtype=torch.bool).tril())
        loss = torch.nn.functional.cross_entropy(draft.logits(normed)[0], t2d_index[s[2:t + 2]], ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
    save_checkpoint(out_dir / "ckpt", draft, info={"layer_ids": list(layer_ids), "step": 150, "table_version": 0,
                                                   "store_uri": "none", "train_config": {}})
    return export_draft(out_dir / "ckpt", out_dir / "draft", target_dir=tiny_target), out_dir / "ckpt"


@pytest.fixture(scope="module")
def trained(tmp_path_factory, root, tiny_target):
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train_draft(tiny_target, _prompts(root, 0, 8), tmp_path_factory.mktemp("offline"))
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def eval_store(tmp_path_factory, root):
    from eaglenest.featurestore import schema as S
    from eaglenest.featurestore.table import store

    uri = str(tmp_path_factory.mktemp("offstore") / "store")
    rows = [dict(sample_id=p["sample_id"], domain=p["domain"], source="test", split="heldout", mode="chat",
                 messages_json=json.dumps(p["messages"]), prompt_token_ids=[], response_token_ids=[],
                 finish_reason="", gen_params_id="g") for p in _prompts(root, 40, 3)]
    store.append(uri, store.PROMPTS, pa.Table.from_pylist(rows, schema=S.PROMPTS_SCHEMA))
    return uri


def test_offline_al_matches_vllm(tiny_target, trained, eval_store):
    from eaglenest.engine import EngineConfig
    from eaglenest.evaluate.config import EvaluateConfig
    from eaglenest.evaluate.offline import offline_al
    from eaglenest.evaluate.prompts import load_prompt_set
    from eaglenest.evaluate.run import evaluate_al

    draft, ckpt = trained
    cfg = EvaluateConfig(max_tokens=MAX_TOKENS, num_speculative_tokens=K, context_buckets=(),
                         check_lossless=False, engine=EngineConfig(max_model_len=512, memory_fraction=0.15))
    served = evaluate_al(target=str(tiny_target), draft=str(draft), store_uri=eval_store, cfg=cfg)
    groups, _ = load_prompt_set(cfg, eval_store)
    off = offline_al(target=tiny_target, draft=draft, groups=groups, num_speculative_tokens=K, max_tokens=MAX_TOKENS)
    s, o = served["overall"], off["overall"]
    print(f"\nserved AL {s['acceptance_length']} ({s['draft_rounds']} rounds) / offline AL "
          f"{o['acceptance_length']} ({o['draft_rounds']} rounds); per request "
          f"{s['acceptance_length_per_request']} / {o['acceptance_length_per_request']}")
    assert s["acceptance_length"] > 1.3, "the briefly trained draft should be clearly better than random"
    assert o["acceptance_length"] == pytest.approx(s["acceptance_length"], rel=0.01)
    assert o["acceptance_length_per_request"] == pytest.approx(s["acceptance_length_per_request"], rel=0.01)
    assert o["draft_rounds"] == s["draft_rounds"] and o["accepted_tokens"] == s["accepted_tokens"]
    assert o["acceptance_by_position"] == pytest.approx(s["acceptance_by_position"], abs=0.01)
    # Same output lengths per group (stop tokens and max_tokens cut identically).
    assert set(served["domains"]) == {"arithmetic", "records", "prose"}  # else the loop below checks nothing
    assert {n: r["output_tokens"] for n, r in off["domains"].items()} == \
        {n: r["output_tokens"] for n, r in served["domains"].items()}
    for name, row in served["domains"].items():
        assert off["domains"][name]["acceptance_length"] == pytest.approx(row["acceptance_length"], rel=0.01)
    # The train checkpoint (same weights) gives the same figures as the exported directory.
    again = offline_al(target=tiny_target, draft=ckpt, groups=groups, num_speculative_tokens=K, max_tokens=MAX_TOKENS)
    assert again["overall"]["acceptance_length"] == o["acceptance_length"]


def test_offline_rejects_non_draft(tmp_path, tiny_target):
    from eaglenest.errors import ConfigError
    from eaglenest.evaluate.offline import load_draft

    with pytest.raises(ConfigError, match="neither an exported draft"):
        load_draft(tmp_path, tiny_target)


def test_offline_al_matches_vllm_with_a_sliding_window(tmp_path, tiny_target, trained, eval_store):
    """train.sliding_window: the same draft exported with a 16-position window (prompts + 48 output
    tokens reach past it). vLLM and the offline replay must apply the window alike."""
    import shutil

    from eaglenest.engine import EngineConfig
    from eaglenest.evaluate.config import EvaluateConfig
    from eaglenest.evaluate.offline import offline_al
    from eaglenest.evaluate.prompts import load_prompt_set
    from eaglenest.evaluate.run import evaluate_al

    draft, _ = trained
    windowed = tmp_path / "draft16"
    shutil.copytree(draft, windowed)
    cfg_json = json.loads((windowed / "config.json").read_text())
    (windowed / "config.json").write_text(json.dumps({**cfg_json, "layer_types": ["sliding_attention"],
                                                      "sliding_window": 16}))
    cfg = EvaluateConfig(max_tokens=MAX_TOKENS, num_speculative_tokens=K, context_buckets=(), check_lossless=False,
                         ngram_order=0, engine=EngineConfig(max_model_len=512, memory_fraction=0.15))
    served = evaluate_al(target=str(tiny_target), draft=str(windowed), store_uri=eval_store, cfg=cfg)["overall"]
    groups, _ = load_prompt_set(cfg, eval_store)
    off = offline_al(target=tiny_target, draft=windowed, groups=groups, num_speculative_tokens=K,
                     max_tokens=MAX_TOKENS)["overall"]
    assert off["draft_rounds"] == served["draft_rounds"] and off["accepted_tokens"] == served["accepted_tokens"]
    assert off["acceptance_by_position"] == pytest.approx(served["acceptance_by_position"], abs=0.01)
    full = offline_al(target=tiny_target, draft=draft, groups=groups, num_speculative_tokens=K,
                      max_tokens=MAX_TOKENS)["overall"]
    assert full["accepted_tokens"] != off["accepted_tokens"], "the window should change what the draft proposes"
