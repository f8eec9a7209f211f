"""vLLM serves the ``serve.format=speculators`` export directly, losslessly, with the same acceptance as
the default export of the same weights.

A draft is trained here in seconds on the committed tiny target's own greedy outputs (as
tests/evaluate/test_offline.py does), with aux layers (1, 3, 6): not vLLM's default (2, 4, 5) for
this 8-layer target, so a reader that missed the ids would fall back to other layers and the
acceptance counts would differ. Three engines, one at a time: the target alone; target + the
default export (``speculative_config``); and ``LLM(model=<speculators dir>)``, where vLLM takes the
target and the number of draft tokens from the draft's own config.json, as ``vllm serve`` does.
Greedy, fp32: both drafts must propose the same tokens, so the engines' accepted-token counters
must be equal, not merely close.
"""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow

K, MAX_TOKENS, IDS = 3, 48, (1, 3, 6)


def _prompts(root, start: int, n: int) -> list[list[dict]]:
    out = []
    for d in ("arithmetic", "records", "prose"):
        rows = [json.loads(x) for x in (root / "recipes" / "data" / f"{d}.jsonl").read_text().splitlines()]
        out += [([{"role": "system", "content": r["system"]}] if r.get("system") else [])
                + [{"role": "user", "content": r["prompt"]}] for r in rows[start:start + n]]
    return out


def _train(tiny_target, chats, held_out, out_dir):
    """~150 AdamW steps on draft step 0 (predict token i+2 from target features i and token i+1);
    returns the checkpoint and the held-out chats as token ids."""
    import numpy as np
    import torch

    from eaglenest.evaluate.offline import load_target, prompt_ids
    from eaglenest.train.checkpoint import save_checkpoint
    from eaglenest.train.config import TrainConfig
    from eaglenest.train.loop import build_draft
    from eaglenest.train.target import load_target_tensors
    from eaglenest.train.vocab import select_vocab

    torch.manual_seed(0)
    model, tok, _ = load_target(tiny_target)
    with torch.no_grad():
        seqs = [model.generate(torch.tensor([prompt_ids(tok, {"messages": m})]), max_new_tokens=64,
                               do_sample=False)[0] for m in chats]
        data = [(torch.cat([hs[j][0] for j in IDS], -1), s)
                for s in seqs for hs in [model(s[None], output_hidden_states=True).hidden_states]]
    vocab = select_vocab(np.bincount(torch.cat(seqs).numpy(), minlength=model.config.vocab_size), 256)
    draft = build_draft(TrainConfig(draft_vocab_size=256), load_target_tensors(tiny_target), layer_ids=IDS,
                        vocab=vocab, seed=0)
    t2d = torch.full((model.config.vocab_size,), -100, dtype=torch.long)
    t2d[torch.as_tensor(vocab.draft_ids)] = torch.arange(vocab.size)
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=3e-3)
    for step in range(150):
        aux, s = data[step % len(data)]
        t = len(s) - 2
        normed, _ = draft.step(s[None, 1:t + 1], draft.combine(aux[None, :t]), torch.arange(t)[None], [],
                               torch.ones(1, t, t, dtype=torch.bool).tril())
        loss = torch.nn.functional.cross_entropy(draft.logits(normed)[0], t2d[s[2:t + 2]], ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
    save_checkpoint(out_dir / "ckpt", draft, info={"layer_ids": list(IDS), "step": 150, "table_version": 0,
                                                   "store_uri": "none", "train_config": {}})
    return out_dir / "ckpt", [prompt_ids(tok, {"messages": m}) for m in held_out]


@pytest.fixture(scope="module")
def exports(tmp_path_factory, root, tiny_target):
    import torch

    from eaglenest.serve.export import export_draft

    tmp = tmp_path_factory.mktemp("specvllm")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ckpt, prompts = _train(tiny_target, _prompts(root, 0, 8), _prompts(root, 40, 3), tmp)
    finally:
        torch.set_num_threads(threads)
    return {fmt: export_draft(ckpt, tmp / fmt, target_dir=tiny_target, format=fmt, num_speculative_tokens=K)
            for fmt in ("vllm", "speculators")}, prompts


def _run(model: str, prompts, draft: str | None = None) -> tuple[list[list[int]], dict]:
    from eaglenest.serve.draft_check import _run as run

    return run(model, prompts, MAX_TOKENS, draft=draft, num_spec=K, mem=0.15, max_len=512, dtype="float32")


def test_speculators_export_serves_like_the_default(exports, tiny_target):
    drafts, prompts = exports
    base, _ = _run(str(tiny_target), prompts)
    default, m_default = _run(str(tiny_target), prompts, draft=str(drafts["vllm"]))  # method eagle3, K tokens
    spec, m_spec = _run(str(drafts["speculators"]), prompts)  # target and K from the draft's config.json
    print(f"\nAL default export {m_default['acceptance_length']:.4f}, speculators export "
          f"{m_spec['acceptance_length']:.4f} ({m_spec['spec_decode_num_drafts']:.0f} drafts)")
    assert default == base and spec == base, "speculative decoding must not change greedy output"
    assert m_default["acceptance_length"] > 1.3, "the briefly trained draft should be clearly better than random"
    for key in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens"):
        assert m_spec[key] == m_default[key], key
