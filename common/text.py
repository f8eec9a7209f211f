"""Text identity shared by every stage: what counts as "the same prompt".

Used for deduplication (ingest), held-out splits (ingest) and contamination checks (ingest and
evaluate), so all of them agree on one normalisation.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata


def normalise(text: str) -> str:
    """Unicode NFKC, unified newlines, trimmed trailing spaces."""
    text = unicodedata.normalize("NFKC", text).replace("\r\n", "\n").replace("\r", "\n")
    return "\n".join(line.rstrip() for line in text.strip().split("\n"))


def content_key(text: str) -> str:
    """SHA-256 of the normalised text, case- and whitespace-insensitive."""
    squashed = re.sub(r"\s+", " ", normalise(text).lower())
    return hashlib.sha256(squashed.encode()).hexdigest()
