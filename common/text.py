"""Text identity shared by every stage: what counts as "the same prompt".

Used for deduplication (ingest), held-out splits (ingest) and contamination checks (ingest and
evaluate), so all of them agree on one normalisation.
"""

from __future__ import annotations

import hashlib
import json
import re
import textwrap
import unicodedata
from typing import Sequence


#: Domain names (a manifest's domains, an import's ``--domain``): ASCII letters, digits, '-' and '_',
#: since they go into sample ids (``<domain>-<hash>``) and file names.
DOMAIN_NAME = re.compile(r"[A-Za-z0-9_-]+")


def normalise(text: str) -> str:
    """Unicode NFKC, unified newlines, trimmed trailing spaces: the form a text's identity is taken from."""
    return _trimmed(unicodedata.normalize("NFKC", text))


def tidy(text: str) -> str:
    """The text a prompt is sent and stored as: canonical composition (NFC), unified newlines, trimmed
    lines. Not NFKC, which only the identity (:func:`content_key`) folds: it rewrites what a prompt says
    ("x² + y²" to "x2 + y2", "½" to "1⁄2", "①" to "1"), and the target would answer another question.
    Blank lines around the text and the indentation all its lines share go; the first line's own goes
    too unless a later line is indented: an indented snippet (code) keeps its lines' relative indentation."""
    lines = textwrap.dedent(_rstripped(unicodedata.normalize("NFC", text))).strip("\n").split("\n")
    if not any(line[:1].isspace() for line in lines[1:]):  # no structure to keep: a stray leading space
        lines[0] = lines[0].lstrip()
    return "\n".join(lines)


def _trimmed(text: str) -> str:
    return _rstripped(text).strip()


def _rstripped(text: str) -> str:
    """``text`` with one newline convention and no whitespace at the end of any line."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    return "\n".join(line.rstrip() for line in text.split("\n"))


def is_blank(text: str) -> bool:
    """No visible character: whitespace and format characters only (zero-width spaces, U+FEFF, ...)."""
    return all(c.isspace() or unicodedata.category(c) == "Cf" for c in text)


#: Characters that show nothing and change no word: soft hyphen, Mongolian vowel separator, zero-width
#: space, direction marks and embeddings, word joiner and invisible operators, BOM. Identity leaves them out
#: (a prompt pasted with a zero-width space is the same prompt); not the zero-width (non-)joiners U+200C/D,
#: which make emoji sequences and shape Indic and Persian words.
INVISIBLE = re.compile("[\u00ad\u180e\u200b\u200e\u200f\u202a-\u202e\u2060-\u2064\u2066-\u2069\ufeff]")


def content_key(text: str) -> str:
    """SHA-256 of the normalised text, case- and whitespace-insensitive, :data:`INVISIBLE` characters left out."""
    return _key(INVISIBLE.sub("", text))


def _key(text: str) -> str:
    """SHA-256 of the normalised text, case- and whitespace-insensitive (scheme 1's ids: invisible characters
    count)."""
    squashed = re.sub(r"\s+", " ", normalise(text).lower())
    return hashlib.sha256(squashed.encode()).hexdigest()


#: The sample-id scheme ``ingest build`` writes into a new prompts table (recorded in each commit's lineage
#: as ``sample_id_scheme``; docs/manifest.md item 5). 1: the key of the system prompt and the user turns
#: joined by newlines, one text, invisible characters counted, which gave a two-turn chat ["Hi", "there"],
#: the one turn "Hi\nthere" and "Hi there", or a system prompt and the same text as the first user line,
#: one id. 2: as 1 for one user turn without a system prompt (most prompts keep their id), :data:`INVISIBLE`
#: characters left out; otherwise each part keyed on its own, by role and turn.
SAMPLE_ID_SCHEME = 2
SAMPLE_ID_SCHEMES = (1, 2)


def conversation_key(system: str, turns: Sequence[str], *, scheme: int = SAMPLE_ID_SCHEME) -> str:
    """The content key of a conversation (a system prompt, '' for none, and its user turns): what its
    sample id, its place in the pool's order and its held-out draw are taken from, under ``scheme``.
    Each part is case-, whitespace- and NFKC-insensitive (:func:`content_key`); under scheme 2 where
    one part ends and the next begins, and which is the system prompt, count too. Scheme 2's hashed
    text holds a newline, which no :func:`content_key` text does (whitespace squashed to one space):
    a structured key never equals a single prompt's."""
    if scheme not in SAMPLE_ID_SCHEMES:
        raise ValueError(f"sample-id scheme {scheme} is not one of {SAMPLE_ID_SCHEMES}")
    if scheme == 1:
        return _key("\n".join([system, *turns]))
    if len(turns) == 1 and not system:
        return content_key(turns[0])
    parts = {"system": content_key(system) if system else None, "user": [content_key(t) for t in turns]}
    return hashlib.sha256(f"eaglenest.sample_id/{scheme}\n{json.dumps(parts, sort_keys=True)}".encode()).hexdigest()
