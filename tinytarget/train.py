"""Train and evaluate the tiny target: a from-scratch ``LlamaForCausalLM`` on the synthetic corpus.

Documents are chat-formatted samples (rendered by the tokenizer's own chat template) and, for a
fraction, the plain-text form; all are concatenated and cut into fixed-length rows (sequence
packing, attention crossing document boundaries, loss on every token). The trade-off is the usual
one for tiny pretraining: no per-document masking, in exchange for no padding and a simple loop.
Everything is seeded and runs on a fixed thread count, so a rebuild gives the same weights on the
same software stack.
"""

from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import dataclass

from eaglenest.tinytarget import corpus

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    vocab_size: int = 2048
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 8
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    max_position_embeddings: int = 32768


#: Seeds are torch's (``torch.manual_seed`` takes no more than 64 bits): [0, MAX_SEED).
MAX_SEED = 2**63


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    seed: int = 0
    num_steps: int = 600
    batch_size: int = 16
    seq_len_tokens: int = 256
    num_train_samples: int = 40000
    raw_fraction: float = 0.25
    peak_lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 40
    weight_decay: float = 0.01
    num_threads: int = 1


def llama_config(shape: ModelShape, ids: dict[str, int]):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size, num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        max_position_embeddings=shape.max_position_embeddings, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=False, hidden_act="silu", initializer_range=0.02,
        attention_bias=False, mlp_bias=False, dtype="float32", use_cache=True, **ids)


def render_documents(samples: list[dict], hf_tok, *, raw_fraction: float, seed: int) -> list[list[int]]:
    """Token ids per document: chat form via the chat template, or raw text + ``<|end|>``."""
    rng = random.Random(seed)
    texts = []
    for s in samples:
        if rng.random() < raw_fraction:
            texts.append(hf_tok.bos_token + corpus.to_raw_text(s) + hf_tok.eos_token + "\n")
        else:
            texts.append(hf_tok.apply_chat_template(corpus.to_messages(s), tokenize=False))
    return hf_tok(texts, add_special_tokens=False)["input_ids"]


def pack(docs: list[list[int]], seq_len_tokens: int):
    """Concatenate documents and cut into ``[num_rows, seq_len_tokens]`` (the tail is dropped)."""
    import torch

    flat = [t for d in docs for t in d]
    n = len(flat) // seq_len_tokens
    return torch.tensor(flat[: n * seq_len_tokens], dtype=torch.long).view(n, seq_len_tokens)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine from ``peak_lr`` down to ``min_lr_ratio * peak_lr``."""
    if step < cfg.warmup_steps:
        return cfg.peak_lr * (step + 1) / cfg.warmup_steps
    t = (step - cfg.warmup_steps) / max(1, cfg.num_steps - cfg.warmup_steps)
    return cfg.peak_lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def optimizer(model, *, peak_lr: float, weight_decay: float, beta2: float = 0.95):
    """AdamW (betas 0.9 / ``beta2``) with weight decay on the matrices only (not norms or biases)."""
    import torch

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=peak_lr, betas=(0.9, beta2), eps=1e-8)


def train(model, rows, cfg: TrainConfig) -> dict:
    """Train ``model`` in place on packed ``rows``; returns loss history and timing."""
    import torch
    from tqdm import tqdm

    gen = torch.Generator().manual_seed(cfg.seed)
    opt = optimizer(model, peak_lr=cfg.peak_lr, weight_decay=cfg.weight_decay)
    model.train()
    order, pos, losses = torch.randperm(len(rows), generator=gen), 0, []
    start = time.perf_counter()
    bar = tqdm(range(cfg.num_steps), desc="train", mininterval=5.0)
    for step in bar:
        if pos + cfg.batch_size > len(order):
            order, pos = torch.randperm(len(rows), generator=gen), 0
        batch = rows[order[pos: pos + cfg.batch_size]]
        pos += cfg.batch_size
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 20 == 0 or step == cfg.num_steps - 1:
            bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{lr_at(step, cfg):.1e}")
    seconds = time.perf_counter() - start
    model.eval()
    log.info("trained %d steps in %.0f s, final loss %.3f", cfg.num_steps, seconds, losses[-1])
    return {"train_seconds": round(seconds, 1), "final_train_loss": round(losses[-1], 4),
            "rows_available": len(rows), "tokens_seen": cfg.num_steps * cfg.batch_size * cfg.seq_len_tokens}


def evaluate_domains(model, hf_tok, samples: list[dict]) -> dict[str, dict[str, float]]:
    """Per-domain loss and top-1 next-token accuracy on the assistant tokens (answer + ``<|end|>``)."""
    import torch

    sums: dict[str, list[float]] = {}
    with torch.no_grad():
        for s in samples:
            enc = hf_tok.apply_chat_template(corpus.to_messages(s), tokenize=True, return_dict=True,
                                             return_assistant_tokens_mask=True)
            ids = torch.tensor([enc["input_ids"]])
            mask = torch.tensor(enc["assistant_masks"][1:], dtype=torch.bool)
            logits = model(input_ids=ids).logits[0, :-1]
            targets = ids[0, 1:]
            nll = torch.nn.functional.cross_entropy(logits, targets, reduction="none")[mask]
            hit = (logits.argmax(-1) == targets)[mask]
            acc = sums.setdefault(s["domain"], [0.0, 0.0, 0.0])
            acc[0] += nll.sum().item()
            acc[1] += hit.sum().item()
            acc[2] += mask.sum().item()
    return {d: {"loss": round(v[0] / v[2], 4), "top1_accuracy": round(v[1] / v[2], 4),
                "num_tokens": int(v[2]), "num_samples": sum(1 for s in samples if s["domain"] == d)}
            for d, v in sums.items()}


def greedy_chat(model, hf_tok, sample: dict, *, max_new_tokens: int = 160) -> tuple[str, bool]:
    """Greedy answer to ``sample``'s prompt; returns (text, stopped at ``<|end|>``)."""
    import torch

    ids = hf_tok.apply_chat_template(corpus.to_messages(sample, with_response=False),
                                     add_generation_prompt=True, tokenize=True, return_dict=True)
    inp = torch.tensor([ids["input_ids"]])
    with torch.no_grad():
        out = model.generate(inp, attention_mask=torch.ones_like(inp), do_sample=False,
                             max_new_tokens=max_new_tokens, eos_token_id=hf_tok.eos_token_id,
                             pad_token_id=hf_tok.pad_token_id)
    new = out[0, inp.shape[1]:].tolist()
    stopped = bool(new) and new[-1] == hf_tok.eos_token_id
    return hf_tok.decode(new, skip_special_tokens=True), stopped
