"""Reasoning ("thinking") targets: the chat-template kwargs a run renders with, and truncated thinking.

Two sources set ``chat_template_kwargs``: the recipe's ``ingest.chat_template_kwargs`` (any mapping,
e.g. ``{enable_thinking: true}``) is the base, and the manifest's ``generation.reasoning`` switch
(``on``/``off``) sets ``enable_thinking`` on top. The two may agree; when they contradict each other
the run is refused, naming both keys, rather than one silently winning. The same merged kwargs reach
regeneration (local engine and endpoints) and evaluation.

Reasoning text is part of the response: it is stored with the other generated tokens and trained on.
A response whose think block never closed because it hit ``max_tokens`` (finish reason ``length``)
is dropped instead: its "answer" is a cut-off thought, so training on it would teach the draft a
distribution the target never finishes. The block may be opened by the response or by the
generation prompt itself (Qwen3-style templates end the prompt with ``<think>\\n`` when thinking is
on). Trade-off: the check decodes the ids of ``length`` rows only, and it looks for the tags as text,
so a literal tag a user wrote and the model echoed could in principle be mistaken for one.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping, Sequence

from eaglenest.errors import ConfigError
from eaglenest.hf import load_tokenizer

#: Tags used when neither the recipe nor the target's template names any.
DEFAULT_TAGS = ("<think>", "</think>")
#: Pairs recognised in a chat template or a tokenizer's added tokens, first match wins. The last is the
#: harmony format's (gpt-oss): its thinking is the ``analysis`` channel, which ``<|end|>`` closes.
KNOWN_TAGS = (("<think>", "</think>"), ("<thinking>", "</thinking>"), ("\u25c1think\u25b7", "\u25c1/think\u25b7"),
              ("<reasoning>", "</reasoning>"), ("<|begin_of_thought|>", "<|end_of_thought|>"),
              ("<|channel|>analysis<|message|>", "<|end|>"))
#: Prompt tokens decoded to see whether the generation prompt ends inside an open think block.
PROMPT_TAIL_TOKENS = 32
#: The harmony format's (gpt-oss) thinking and answer channels, and the tokens that end a message.
HARMONY_ANALYSIS = KNOWN_TAGS[-1][0]
HARMONY_FINAL = "<|channel|>final<|message|>"
HARMONY_ENDS = ("<|end|>", "<|return|>", "<|call|>")


def template_kwargs(reasoning: str, base: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The merged ``chat_template_kwargs`` (None: pass nothing, the template's defaults)."""
    merged = dict(base or {})
    if reasoning != "default":
        want = reasoning == "on"
        if "enable_thinking" in merged and merged["enable_thinking"] != want:
            raise ConfigError(f"ingest.chat_template_kwargs: enable_thinking={merged['enable_thinking']} "
                              f"contradicts the manifest's generation.reasoning: {reasoning}; change one of them")
        merged["enable_thinking"] = want
    return merged or None


def resolve_tags(configured: Sequence[str], tokenizer=None) -> tuple[str, str]:
    """The think tags: the recipe's ``ingest.think_tags``, else a known pair the target's chat
    template or added tokens contain, else ``<think>`` / ``</think>``."""
    if configured:
        return configured[0], configured[1]
    if tokenizer is not None:
        template = tokenizer.chat_template or ""
        if isinstance(template, dict):  # named templates (a list in tokenizer_config.json): look in each
            template = "\n".join(t for t in template.values() if isinstance(t, str))
        added = set(tokenizer.get_added_vocab())
        for pair in KNOWN_TAGS:
            if all(t in template or t in added for t in pair):
                return pair
    return DEFAULT_TAGS


@dataclasses.dataclass(frozen=True)
class ThinkCheck:
    """Decides whether a chat answer ended inside its think block; small and picklable (Dask)."""

    open_tag: str
    close_tag: str
    target: str
    trust_remote_code: bool = False

    def truncated(self, prompt_ids: Sequence[int], response_ids: Sequence[int], finish_reason: str) -> bool:
        if finish_reason != "length":
            return False
        text = self._decode(response_ids)
        opened, closed = text.rfind(self.open_tag), text.rfind(self.close_tag)
        if opened >= 0 or closed >= 0:
            return opened > closed
        # No tag in the answer: open only if the generation prompt itself ends in an open block.
        return self.opens_block(self._decode(prompt_ids[-PROMPT_TAIL_TOKENS:]))

    def opens_block(self, text: str) -> bool:
        """Whether ``text`` ends inside an open think block (only whitespace after the open tag)."""
        opened, closed = text.rfind(self.open_tag), text.rfind(self.close_tag)
        return opened > closed and not text[opened + len(self.open_tag):].strip()

    def history_text(self, response_ids: Sequence[int], text: str) -> str:
        """What an answer is in the history of its conversation's next turn: ``text`` as generated, except the
        answer of a harmony-format target (gpt-oss), which goes back as its ``final`` channel ('' if it has
        none): gpt-oss's template renders an earlier answer's content as that channel, drops the analysis of
        earlier turns, and refuses channel tags in a content, while vLLM's text skips the special tokens and
        runs the channels together ("analysis...assistantfinal...")."""
        if self.open_tag != HARMONY_ANALYSIS and "<|channel|>" not in _added_vocab(self.target, self.trust_remote_code):
            return text
        raw = self._decode(response_ids) if response_ids else text
        if "<|channel|>" not in raw:  # a harmony target answering without channels: nothing to take apart
            return text
        at = raw.rfind(HARMONY_FINAL)
        final = raw[at + len(HARMONY_FINAL):] if at >= 0 else ""
        for end in HARMONY_ENDS:
            final = final.split(end, 1)[0]
        return final

    def _decode(self, ids: Sequence[int]) -> str:
        return _tokenizer(self.target, self.trust_remote_code).decode(list(ids), skip_special_tokens=False)


@functools.lru_cache(maxsize=4)
def _tokenizer(target: str, trust_remote_code: bool):
    """One tokenizer per process and target (a Dask worker loads it once for all its shards)."""
    return load_tokenizer(target, trust_remote_code=trust_remote_code)


@functools.lru_cache(maxsize=4)
def _added_vocab(target: str, trust_remote_code: bool) -> frozenset[str]:
    return frozenset(_tokenizer(target, trust_remote_code).get_added_vocab())
