"""Byte-level BPE tokenizer and chat template for the tiny target.

Trained with ``tokenizers`` on the synthetic corpus and saved as a Hugging Face fast tokenizer
(``tokenizer.json`` + ``tokenizer_config.json``), so ``AutoTokenizer`` and vLLM load it like any
hub model. Digits are split one per token before BPE: the trade-off is longer arithmetic sequences
for a model that can actually learn column-wise carries. Pre-tokenization is GPT-2 style (no merges
across words), so tokens look like a real LLM's; the corpus then holds fewer distinct pieces than
``VOCAB_SIZE`` and the trained vocabulary is smaller than the model's (padded) embedding.

Chat format (the Jinja template below)::

    <|bos|><|system|>\\n{system}<|end|>\\n<|user|>\\n{prompt}<|end|>\\n<|assistant|>\\n{answer}<|end|>\\n

The assistant answer *and its* ``<|end|>`` sit inside ``{% generation %}``, so
``return_assistant_tokens_mask=True`` marks exactly what the model must learn to emit.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Iterable

log = logging.getLogger(__name__)

BOS, END, PAD = "<|bos|>", "<|end|>", "<|pad|>"
ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
# Order fixes the ids: <|pad|>=0, <|bos|>=1, <|end|>=2, then the role markers.
SPECIAL_TOKENS = [PAD, BOS, END, *ROLE_TOKENS.values()]
VOCAB_SIZE = 2048

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{% if message['role'] == 'assistant' %}"
    # transformers renders with trim_blocks: a literal newline right after a block tag is dropped,
    # so the one after {% endgeneration %} is written as an expression.
    "<|assistant|>\n{% generation %}{{ message['content'] }}<|end|>{% endgeneration %}{{ '\\n' }}"
    "{% else %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def train_tokenizer(texts: Iterable[str], *, vocab_size: int = VOCAB_SIZE):
    """Train a byte-level BPE ``tokenizers.Tokenizer`` on ``texts`` (deterministic for fixed input)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2)
    tok.train_from_iterator(texts, trainer=trainer)
    # Like Llama: plain encoding (add_special_tokens=True) starts with <|bos|>. The chat template
    # writes <|bos|> itself and is encoded with add_special_tokens=False, so it is never doubled.
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)])
    # BPE stops merging once every word of the small corpus is one token (~1.1k entries): the
    # model's embedding is padded to VOCAB_SIZE rows, as real models pad theirs; unused ids never
    # occur as targets, so training drives their logits down.
    log.info("tokenizer vocab: %d entries (model vocab %d)", tok.get_vocab_size(), vocab_size)
    return tok


def save_hf_tokenizer(tok, outdir: str | Path, *, model_max_length: int) -> None:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``."""
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    tok.save(str(outdir / "tokenizer.json"))
    added = {str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False,
                                       "rstrip": False, "single_word": False, "special": True}
             for t in SPECIAL_TOKENS}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": END, "pad_token": PAD, "unk_token": None,
        "add_bos_token": True, "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "padding_side": "left",
        "added_tokens_decoder": added,
        "extra_special_tokens": [ROLE_TOKENS[r] for r in ("system", "user", "assistant")],
        "chat_template": CHAT_TEMPLATE,
    }
    (outdir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (outdir / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": BOS, "eos_token": END, "pad_token": PAD,
         "additional_special_tokens": list(ROLE_TOKENS.values())}, indent=2) + "\n")


def special_ids(tok) -> dict[str, int]:
    """Ids of bos/eos/pad in a trained ``tokenizers.Tokenizer``."""
    return {"bos_token_id": tok.token_to_id(BOS), "eos_token_id": tok.token_to_id(END),
            "pad_token_id": tok.token_to_id(PAD)}


def check_hf_tokenizer(path: str | Path) -> None:
    """Load with ``AutoTokenizer`` and check round trip and the assistant mask; raise on failure."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(path))
    text = "What is 47 + 38?\n\n{\n  \"name\": \"Ana\"\n}"
    ids = hf(text)["input_ids"]
    if ids[0] != hf.bos_token_id or hf.decode(ids, skip_special_tokens=True) != text:
        raise RuntimeError(f"tokenizer round trip failed: {hf.decode(ids)!r}")
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello there."}]
    out = hf.apply_chat_template(msgs, tokenize=True, return_dict=True,
                                 return_assistant_tokens_mask=True)
    masked = [t for t, m in zip(out["input_ids"], out["assistant_masks"]) if m]
    if hf.decode(masked) != "Hello there." + END:
        raise RuntimeError(f"assistant mask covers {hf.decode(masked)!r}")
    log.info("tokenizer at %s: vocab %d, round trip and assistant mask ok", path, len(hf))
