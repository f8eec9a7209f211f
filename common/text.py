"""Text identity shared by every stage: what counts as "the same prompt".

Used for deduplication (ingest), held-out splits (ingest) and contamination checks (ingest and
evaluate), so all of them agree on one normalisation.
"""

from __future__ import annotations

import hashlib
import re
import textwrap
import unicodedata


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


def content_key(text: str) -> str:
    """SHA-256 of the normalised text, case- and whitespace-insensitive."""
    squashed = re.sub(r"\s+", " ", normalise(text).lower())
    return hashlib.sha256(squashed.encode()).hexdigest()
