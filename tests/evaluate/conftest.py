"""Evaluate fixtures: a tiny prompts store, published-format prompt files written here, a draft.

The MT-Bench and SPEED-Bench fixtures are tiny files written by the tests themselves in the
published formats (MT-Bench ``question.jsonl``; SPEED-Bench parquet with question_id, category,
sub_category, turns, source, src_id, difficulty, multiturn). The draft is a random-init EAGLE-3 head
for the committed tiny target (exported with ``serve export``'s code): AL near 1, which is enough
to exercise vLLM's metrics, buckets and the lossless check, not to judge quality.
"""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

DOMAINS = {
    "arithmetic": ["What is 12 + 30?", "Compute 7 x 6.", "What is 81 - 17?"],
    "prose": ["Write a sentence about rain.", "Describe a quiet morning.", "Tell me about the sea."],
}
TRAIN = ["What is 5 + 5?", "Write a sentence about snow."]


def _row(sid, domain, split, text, system=""):
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    return dict(sample_id=sid, domain=domain, source="test", split=split, mode="chat",
                messages_json=json.dumps(msgs), prompt_token_ids=[], response_token_ids=[],
                finish_reason="", gen_params_id="g")


@pytest.fixture(scope="session")
def prompts_store(tmp_path_factory):
    """Held-out prompts of two domains; one held-out prompt duplicates a training one (other case)."""
    from eaglenest.featurestore import schema as S
    from eaglenest.featurestore.table import store

    uri = str(tmp_path_factory.mktemp("evalstore") / "store")
    rows = [_row(f"{d}-{i}", d, "heldout", t) for d, ts in DOMAINS.items() for i, t in enumerate(ts)]
    rows += [_row(f"train-{i}", "arithmetic", "train", t, system="Be brief.") for i, t in enumerate(TRAIN)]
    rows.append(_row("arithmetic-dup", "arithmetic", "heldout", "  WHAT is 5 +   5? "))
    store.append(uri, store.PROMPTS, pa.Table.from_pylist(rows, schema=S.PROMPTS_SCHEMA))
    return uri


@pytest.fixture(scope="session")
def mt_bench_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("mtb") / "question.jsonl"
    qs = [{"question_id": 1, "category": "writing", "turns": ["Write two lines about tea.", "Shorter."]},
          {"question_id": 2, "category": "math", "turns": ["What is 3 + 4?", "And times 2?"]},
          {"question_id": 3, "category": "math", "turns": ["what is 5 + 5?", "Why?"]}]
    path.write_text("".join(json.dumps(q) + "\n" for q in qs))
    return path


@pytest.fixture(scope="session")
def speed_bench_dir(tmp_path_factory):
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("speedbench")
    (root / "qualitative").mkdir()
    rows = [dict(question_id=f"q{i}", category=c, sub_category="x", turns=[t], source="test", src_id=str(i),
                 difficulty="easy", multiturn=False)
            for i, (c, t) in enumerate([("coding", "Write a loop."), ("rag", "Summarise the text."),
                                        ("coding", "Reverse a list.")])]
    pq.write_table(pa.Table.from_pylist(rows), root / "qualitative" / "test-00000-of-00001.parquet")
    return root


@pytest.fixture(scope="session")
def random_draft(tmp_path_factory, tiny_target):
    import torch

    from eaglenest.serve.export import export_draft
    from eaglenest.train.checkpoint import save_checkpoint
    from eaglenest.train.config import TrainConfig
    from eaglenest.train.loop import build_draft
    from eaglenest.train.target import load_target_tensors
    from eaglenest.train.vocab import select_vocab

    tmp = tmp_path_factory.mktemp("draft")
    t = load_target_tensors(tiny_target)
    vocab = select_vocab(torch.arange(2048, 0, -1).numpy(), 512)
    model = build_draft(TrainConfig(draft_vocab_size=512), t, layer_ids=(2, 4, 5), vocab=vocab, seed=0)
    save_checkpoint(tmp / "ckpt", model, info={"layer_ids": [2, 4, 5], "step": 0, "table_version": 1,
                                               "store_uri": "s", "train_config": {}})
    return export_draft(tmp / "ckpt", tmp / "draft", target_dir=tiny_target)
