"""The stream source trains the rows the table path trains (``num_loss_tokens > 0``), planned without an
engine: a multi-turn conversation whose last answer is empty still teaches its earlier answers."""

from __future__ import annotations

import json

import pyarrow as pa
from stream_helpers import FS
from transformers import AutoTokenizer

from eaglenest.featurestore import schema as S
from eaglenest.featurestore.capture import turns
from eaglenest.featurestore.capture.build import _turn_spans
from eaglenest.featurestore.table import store
from eaglenest.train.stream_source import StreamShards

CONV = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "2 + 3 = 5"},
        {"role": "user", "content": "And times 4?"}]


def _row(sid, messages, prompt, response):
    return {"sample_id": sid, "domain": "d", "source": "s", "split": "train", "mode": "chat",
            "messages_json": json.dumps(messages), "prompt_token_ids": prompt, "response_token_ids": response,
            "finish_reason": "stop", "gen_params_id": "g"}


def test_the_stream_trains_the_rows_the_table_path_trains(tmp_path, tiny_target):
    tok = AutoTokenizer.from_pretrained(tiny_target)
    multi = list(tok.apply_chat_template(CONV, add_generation_prompt=True, tokenize=True)["input_ids"])
    single = list(tok.apply_chat_template(CONV[:1], add_generation_prompt=True, tokenize=True)["input_ids"])
    end = tok.convert_tokens_to_ids("<|end|>")
    rows = [_row("a-answered", [*CONV[:1], {"role": "assistant", "content": "5"}], single, tok("5")["input_ids"] + [end]),
            _row("b-empty-single", [*CONV[:1], {"role": "assistant", "content": ""}], single, []),
            _row("c-empty-last-of-two", [*CONV, {"role": "assistant", "content": ""}], multi, [])]
    uri = str(tmp_path / "store")
    store.append(uri, store.PROMPTS, pa.Table.from_pylist(rows, schema=S.PROMPTS_SCHEMA))
    # what the table path trains: the rows whose captured loss mask is not all zero
    spans = _turn_spans(str(tiny_target), rows, [])
    masks = {r["sample_id"]: sum(_mask(r, spans)) for r in rows}
    trained = sorted(sid for sid, n in masks.items() if n > 0)
    assert trained == ["a-answered", "c-empty-last-of-two"]  # the earlier answer of c counts
    src = StreamShards(uri, featurestore=FS, target=str(tiny_target), split="train", pack_tokens=256, batch_rows=1,
                       seed=0, depth=1)
    assert [c["sample_id"] for c in src.convs] == trained
    assert [int(m.sum()) for m in src.masks] == [masks[s] for s in trained]


def _mask(row, spans):
    return turns.loss_mask(len(row["prompt_token_ids"]), len(row["response_token_ids"]), list(spans(row)))
