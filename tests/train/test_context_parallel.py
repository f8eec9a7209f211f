"""Context parallelism: a row split over 2 gloo ranks gives the one-rank loss and every gradient.

Two real ranks (this file run as a script per rank, a gloo group over a file store), fp64, rows
with several documents and padding, TTT steps > 1, with and without a sliding window, with the
plain and the chunked loss; the ranks' losses and gradients are summed and compared with one
process training on the whole rows. Plus the recipe refusals.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eaglenest.config import apply_overrides, build
from eaglenest.errors import ConfigError
from eaglenest.train.config import TrainConfig
from eaglenest.train.context_parallel import ContextParallel, CPObjective, split_batch
from eaglenest.train.dist import DistState
from eaglenest.train.loop import train
from eaglenest.train.model import DraftFlags, Eagle3Draft, draft_config, init_weights
from eaglenest.train.ttt import Batch, TargetHead, target_targets, ttt_loss

TARGET = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=4096, hidden_act="silu")
T = 45  # odd: the split pads the row
#: name -> (sliding window, attention chunk, TTT steps, target_chunk_tokens)
CASES = {"full": (0, 8, 3, 0), "window": (0 + 5, 8, 3, 0), "one_chunk": (0, 10_000, 4, 0),
         "chunked_loss": (0, 8, 3, 16), "window_chunked_loss": (7, 16, 2, 16)}


def make(window: int, chunk: int) -> tuple[Eagle3Draft, TargetHead, torch.Tensor]:
    cfg = draft_config(TARGET, draft_vocab_size=64, layer_ids=(1, 2, 3), flags=DraftFlags(), sliding_window=window)
    cfg.attn_chunk_tokens = chunk
    m = Eagle3Draft(cfg).double()
    init_weights(m, seed=0, std=0.1)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        m.d2t.copy_(torch.arange(64) * 3)
        m.embed_tokens.weight.copy_(torch.randn(256, 64, generator=g) * 0.1)
    head = TargetHead(torch.ones(64) + 0.1 * torch.randn(64, generator=g), torch.randn(256, 64, generator=g), 1e-5)
    return m, head.double(), torch.arange(64) * 3


def rows() -> Batch:
    """Two rows: three documents; two documents then 6 padding tokens."""
    g = torch.Generator().manual_seed(1)
    lens = [[20, 9, 16], [15, 24, -6]]
    doc = torch.stack([torch.cat([torch.full((abs(n),), d if n > 0 else -1) for d, n in enumerate(r)]) for r in lens])
    pos = torch.stack([torch.cat([torch.arange(abs(n)) if n > 0 else torch.zeros(-n, dtype=torch.long)
                                  for n in r]) for r in lens])
    loss = (doc >= 0) & (torch.rand(2, T, generator=g) > 0.2)
    return Batch(input_ids=torch.randint(0, 256, (2, T), generator=g), loss_mask=loss, doc_ids=doc,
                 position_ids=pos, aux=torch.randn(2, T, 192, generator=g, dtype=torch.float64),
                 last_hidden=torch.randn(2, T, 64, generator=g, dtype=torch.float64))


def run_case(name: str, *, rank: int = 0, size: int = 1, group=None) -> dict:
    """Loss, per-step counts and gradients of one case: the whole rows (size 1) or rank's part."""
    window, chunk, k, target_chunk = CASES[name]
    model, head, ids = make(window, chunk)
    batch = rows()
    if size == 1:
        probs, argmax = target_targets(head, batch.last_hidden, ids)
        res = ttt_loss(model, batch, probs, argmax, num_steps=k, step_decay=0.8, chunk_tokens=target_chunk)
    else:
        import torch.distributed as dist

        local = split_batch(batch, rank=rank, size=size, halo=k + 1, group=group)
        probs, argmax = target_targets(head, local.last_hidden, ids)
        objective = CPObjective(model)
        counts = torch.tensor(objective.counts(local, k), dtype=torch.float64)
        dist.all_reduce(counts, group=group)
        res = objective(local, probs, argmax, num_steps=k, step_decay=0.8, denominators=counts.tolist(),
                        chunk_tokens=target_chunk)
    res.loss.backward()
    return {"loss": float(res.loss.detach()), "step_correct": res.step_correct, "step_count": res.step_count,
            "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}}


def rank_main(rank: int, size: int, store: str, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=size)
    try:
        torch.save({name: run_case(name, rank=rank, size=size, group=dist.group.WORLD) for name in CASES},
                   Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("cp")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    procs = [subprocess.Popen([sys.executable, __file__, str(r), "2", str(tmp / "store"), str(tmp)], env=env,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    errs = [p.communicate(timeout=300)[1] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(e[-4000:] for e in errs)
    return [torch.load(tmp / f"rank{r}.pt") for r in range(2)]


@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_sum_to_one_rank(two_ranks, name):
    ref = run_case(name)
    parts = [r[name] for r in two_ranks]
    assert sum(p["loss"] for p in parts) == pytest.approx(ref["loss"], rel=1e-10)
    assert [a + b for a, b in zip(parts[0]["step_count"], parts[1]["step_count"])] == ref["step_count"]
    assert [a + b for a, b in zip(parts[0]["step_correct"], parts[1]["step_correct"])] == ref["step_correct"]
    assert all(p["step_count"][0] > 0 for p in parts)  # both ranks hold loss tokens
    assert parts[0]["grads"].keys() == parts[1]["grads"].keys() == ref["grads"].keys()
    for n, want in ref["grads"].items():
        torch.testing.assert_close(parts[0]["grads"][n] + parts[1]["grads"][n], want, rtol=1e-9, atol=1e-12, msg=n)
        # Each rank alone is not the whole gradient: the test can fail.
    assert not torch.allclose(parts[0]["grads"]["fc.weight"], ref["grads"]["fc.weight"])


def test_split_pads_and_keeps_a_halo():
    b = rows()
    a, c = (split_batch(b, rank=r, size=2, halo=4) for r in range(2))
    assert a.shard.start == 0 and c.shard.start == 23 and a.shard.num_tokens == c.shard.num_tokens == 23
    assert a.input_ids.shape == c.input_ids.shape == (2, 27)
    assert torch.equal(a.input_ids[:, 23:], b.input_ids[:, 23:27])  # rank 0's halo: rank 1's first tokens
    assert (c.doc_ids[:, 22:] == -1).all() and not c.loss_mask[:, 22:].any()  # padding past the end
    assert a.shard.doc_ids.shape == (2, 46)


@pytest.mark.parametrize("override, key", [
    ({"family": "peagle"}, "family=peagle"), ({"family": "dflash"}, "family=dflash"),
    ({"source": "stream"}, "source=stream"), ({"context_parallel": 0}, "train.context_parallel")])
def test_refused_combinations(override, key):
    with pytest.raises(ConfigError, match="train.context_parallel") as err:
        TrainConfig(**{"context_parallel": 2, **override})
    assert key in str(err.value) and "\n" not in str(err.value)


def test_refused_without_enough_ranks():
    assert ContextParallel.create(1, DistState()) is None
    with pytest.raises(ConfigError, match=r"train.context_parallel=2: needs a multiple of 2 ranks .* has 1"):
        ContextParallel.create(2, DistState())


RECIPE = str(Path(__file__).resolve().parents[2] / "recipes" / "toy.yaml")
#: 24 samples of 32 tokens, 3 per row, 2 rows a step; a sliding window across the split.
RUN = dict(draft_vocab_size=512, ttt_steps=3, pack_tokens=96, batch_rows=2, warmup_steps=2, lr=2e-3,
           num_steps=4, log_every_steps=1, num_threads=1, sliding_window=40)


@pytest.mark.slow
def test_trainer_context_parallel_matches_one_rank(tmp_path, feature_store, tiny_target):
    """`train launch --nproc 2` with train.context_parallel=2 (FSDP2 + the split rows) trains as one rank."""
    def metrics(work: Path) -> list[dict]:
        return [json.loads(x) for x in (work / "train" / "metrics.jsonl").read_text().splitlines()]

    cfg = build(TrainConfig, apply_overrides({}, [f"{k}={v}" for k, v in RUN.items()]), where="train")
    train(cfg, store_uri=feature_store[0], workdir=str(tmp_path / "one"), target_dir=str(tiny_target), seed=0)
    cmd = [sys.executable, "-m", "eaglenest.pipeline.train_cli", "launch", "--nproc", "2", "--recipe", RECIPE,
           f"run.workdir={tmp_path / 'cp'}", f"run.target={tiny_target}", f"run.store={feature_store[0]}",
           "train.context_parallel=2", *(f"train.{k}={v}" for k, v in RUN.items())]
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-8000:]
    assert "each row split over 2 ranks, 1 data-parallel groups" in proc.stderr  # not plain data parallelism
    a, b = metrics(tmp_path / "one"), metrics(tmp_path / "cp")
    assert [m["step"] for m in a] == [m["step"] for m in b] == [1, 2, 3, 4]  # zip below compares every step
    for x, y in zip(a, b):
        assert y["step_count"] == x["step_count"] and y["tokens"] == x["tokens"]
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-4), (x["step"], x["loss"], y["loss"])


if __name__ == "__main__":  # one rank of two_ranks: rank, world size, file store, output folder
    rank_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
