"""Test helpers: a random tiny Llama target and a features table computed from it with HF.

Loaded by path from the conftest files (tests have no packages). Features follow the store's
contract: aux layers in vLLM ids (== HF ``hidden_states[j]`` for j < L) and ``last_hidden`` = the
last block's output BEFORE the final norm, taken with a forward hook, because transformers 5
returns ``hidden_states[L]`` already normed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

TARGET_SHAPE = dict(vocab_size=2048, hidden_size=128, intermediate_size=384, num_hidden_layers=8,
                    num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=2048,
                    tie_word_embeddings=False, rms_norm_eps=1e-5)
LAYER_IDS = (2, 4, 5)


def make_target(path: Path, *, seed: int = 0, lm_head_scale: float = 30.0, **overrides) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(**{**TARGET_SHAPE, **overrides}, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # a confident target (random init is near-uniform): learnable, peaky targets
        model.lm_head.weight.mul_(lm_head_scale)
    model.save_pretrained(path, safe_serialization=True)
    return path


@torch.no_grad()
def compute_features(target_dir: Path, sequences: list[list[int]], layer_ids=LAYER_IDS):
    """(aux [T, n_aux, H], last [T, H]) float32 per sequence, plus the greedy continuation check."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    grab = {}
    hook = model.model.layers[-1].register_forward_hook(
        lambda m, i, o: grab.__setitem__("last", o[0] if isinstance(o, tuple) else o))
    out = []
    for seq in sequences:
        hs = model(torch.tensor([seq]), output_hidden_states=True).hidden_states
        aux = torch.stack([hs[j][0] for j in layer_ids], dim=1)
        out.append((aux.numpy(), grab["last"][0].numpy()))
    hook.remove()
    return out


@torch.no_grad()
def greedy_sequences(target_dir: Path, *, n: int, prompt_len: int, gen_len: int, seed: int = 0):
    """(token ids, loss mask) pairs: random prompts + the target's own greedy continuation."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, model.config.vocab_size, (n, prompt_len), generator=g)
    # One batched call (equal prompt lengths: no padding involved).
    seqs = model.generate(prompts, max_new_tokens=gen_len, min_new_tokens=gen_len, do_sample=False,
                          pad_token_id=0).tolist()
    out = [(seq, [0] * prompt_len + [1] * (len(seq) - prompt_len)) for seq in seqs]
    return out


def write_features(uri: str, target_dir: Path, samples, *, layer_ids=LAYER_IDS, split="train",
                   table: str = "features") -> int:
    """Append feature rows for ``samples`` [(ids, mask)] to ``uri``; returns the table version."""
    from eaglenest.featurestore import schema as S
    from eaglenest.featurestore.table import store

    feats = compute_features(target_dir, [s for s, _ in samples], layer_ids)
    meta = S.FeatureMeta(target=str(target_dir), layer_ids=tuple(layer_ids), last_layer_id=8,
                         hidden_size=TARGET_SHAPE["hidden_size"], dtype="float32")
    rows = []
    for i, ((ids, mask), (aux, last)) in enumerate(zip(samples, feats)):
        sid = f"s{i}" if split == "train" else f"{split}-s{i}"  # ids are unique across a table
        rows.append(dict(sample_id=sid, domain="synthetic", source="test", split=split, mode="raw",
                         gen_params_id="greedy", num_tokens=len(ids), num_loss_tokens=int(sum(mask)),
                         input_ids=list(ids), loss_mask=list(mask),
                         aux_hidden=S.encode_tensor(np.asarray(aux, dtype="<f4"), "float32"),
                         last_hidden=S.encode_tensor(np.asarray(last, dtype="<f4"), "float32")))
    rows_table, table_name = pa.Table.from_pylist(rows, schema=S.features_schema(meta)), table
    return store.append(uri, table_name, rows_table, meta=meta)


def untrained_checkpoint(cfg, target_dir: Path, out: Path) -> Path:
    """A checkpoint of a freshly built draft of ``cfg`` (a TrainConfig) for ``target_dir`` at ``out``:
    what ``serve export`` reads, with no training (aux layers LAYER_IDS, a random draft vocabulary)."""
    import dataclasses

    from eaglenest.train.checkpoint import save_checkpoint
    from eaglenest.train.loop import build_draft
    from eaglenest.train.target import load_target_tensors
    from eaglenest.train.vocab import select_vocab

    t = load_target_tensors(target_dir)
    vocab = select_vocab(torch.randint(0, 100, (int(t["config"]["vocab_size"]),)).numpy(), 700)
    model = build_draft(cfg, t, layer_ids=LAYER_IDS, vocab=vocab, seed=0)
    save_checkpoint(out, model, info={"layer_ids": list(LAYER_IDS), "step": 0, "table_version": 1, "store_uri": "s",
                                      "train_config": dataclasses.asdict(cfg)})
    return out
