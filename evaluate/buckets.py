"""Context-length buckets (1K .. 32K prompt tokens) built from held-out material.

A bucket prompt is a long multi-turn chat: earlier turns are held-out prompts with the target's own
answers (from the held-out decode, so no training text enters), the last turn is a held-out
question, and the history is cut at the front so the prompt has exactly the bucket's token count
(the first turn may start mid-text, like a sliding window). When the held-out material is shorter
than a bucket it is cycled in a new seeded order each pass; the report states how many distinct
material tokens there were, so a bucket made of repeats is visible.

Trade-off: prompts are token ids (``TokensPrompt``), built with the target's own chat template,
so the bucket length is exact; a bucket longer than the target's positions minus the output length
is shortened to fit and reported with its actual length.
"""

from __future__ import annotations

import logging
import random

from eaglenest.errors import ConfigError
from eaglenest.evaluate.prompts import render

log = logging.getLogger(__name__)


def _ids(tok, messages: list[dict], chat_template_kwargs: dict | None = None) -> list[int]:
    return render(tok, messages, chat_template_kwargs)


def buckets_in_order(report: dict) -> list[tuple[str, dict]]:
    """A report's context buckets by length (report.json's keys sort as text: "16384" < "2048")."""
    return sorted((report.get("context_buckets") or {}).items(), key=lambda kv: int(kv[0]))


def bucket_length(bucket: int, *, max_positions: int, max_tokens: int) -> int:
    """Prompt tokens used for ``bucket``: the bucket, or what fits beside ``max_tokens`` of output."""
    return min(bucket, max_positions - max_tokens)


def build_bucket_prompts(tok, material: list[tuple[list[dict], str]], buckets: tuple[int, ...], *,
                         per_bucket: int, max_positions: int, max_tokens: int, seed: int = 0,
                         chat_template_kwargs: dict | None = None
                         ) -> dict[int, list[dict]]:
    """``{bucket: [{"sample_id", "prompt_token_ids", "question_id"}]}`` of exact lengths.

    ``material``: (prompt messages, answer text) pairs of held-out conversations.
    """
    if not material:
        raise ConfigError("evaluate.context_buckets: no held-out material to build context prompts from")
    out: dict[int, list[dict]] = {}
    for bucket in buckets:
        length = bucket_length(bucket, max_positions=max_positions, max_tokens=max_tokens)
        if length < 16:
            raise ConfigError(f"evaluate.context_buckets: {bucket} leaves no room for "
                              f"{max_tokens} output tokens within {max_positions} positions")
        rows = []
        for i in range(per_bucket):
            rng = random.Random(f"{seed}:{bucket}:{i}")
            q_msgs, _ = material[rng.randrange(len(material))]
            question = [m for m in q_msgs if m["role"] == "user"][-1:]
            tail = _ids(tok, question, chat_template_kwargs)
            bos = 1 if tok.bos_token_id is not None and tail[:1] == [tok.bos_token_id] else 0
            history: list[dict] = []
            body: list[int] = []
            need = length - len(tail)
            passes = 0
            while len(body) < need:
                order = list(range(len(material)))
                rng.shuffle(order)
                for j in order:
                    msgs, answer = material[j]
                    history += [m for m in msgs if m["role"] == "user"][-1:]
                    history.append({"role": "assistant", "content": answer})
                passes += 1
                full = _ids(tok, history + question, chat_template_kwargs)
                body = full[bos:len(full) - (len(tail) - bos)]
            ids = tail[:bos] + body[len(body) - need:] + tail[bos:] if need > 0 else tail[-length:]
            assert len(ids) == length, (len(ids), length)
            rows.append({"sample_id": f"ctx{bucket}-{i}", "prompt_token_ids": ids, "material_passes": passes})
        out[bucket] = rows
        log.info("bucket %d: %d prompts of %d tokens (%d pass(es) over the material)",
                 bucket, len(rows), length, max(r["material_passes"] for r in rows))
    return out
