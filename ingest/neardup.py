"""Near-duplicate detection: MinHash signatures over word shingles, LSH banding, exact verification.

A text becomes the set of its word ``n``-grams (shingles, after :func:`eaglenest.text.normalise` and
lower-casing, without the invisible characters identity leaves out). A word keeps its combining marks, and
in scripts written without spaces (Chinese, Japanese, Thai) each letter is a word: their shingles are letter
n-grams. Two texts are near duplicates when the Jaccard similarity of their shingle sets is at
least the threshold. Finding them without comparing all pairs: each shingle is hashed (CRC-32, so the
result never depends on the process or platform) and ``num_perm`` universal hash functions
``(a * x + b) mod p`` (``p = 2**32 + 15``, prime; ``a``, ``b`` drawn once from a fixed seed) give a
MinHash signature; the signature is cut into ``bands`` of ``rows`` (chosen for the threshold, as in
Broder's LSH) and texts sharing any band are candidates. Candidates are then checked with the exact
Jaccard of their shingle sets, so a reported near duplicate is never a false positive; the only
error is a rare miss (a pair above the threshold sharing no band), which is why the banding is
tuned to weigh misses eight times as heavily as candidate checks (at threshold 0.8 with 128
permutations: 14 bands of 9 rows; a pair at 0.8 is a candidate with p = 0.87, at 0.9 with p = 0.999).

Everything is deterministic: same texts in the same order, same answers. Trade-off: signatures are
numpy (``num_perm x shingles`` products per text, taken a few thousand shingles at a time so a huge
prompt is signed in a few MiB), fine for ~10^6 prompts on one core; beyond that the signing would
move into the executor.
"""

from __future__ import annotations

import functools
import re
import sys
import unicodedata
import zlib

import numpy as np

from eaglenest.text import INVISIBLE, normalise

_P = np.uint64((1 << 32) + 15)  # prime > every 32-bit shingle hash; a*x + b stays below 2**64
_SEED = 0x5EED_D0D0
#: Shingles signed at once: num_perm x _CHUNK uint64 products (4 MiB at 128 permutations) per temporary.
_CHUNK = 4096


#: Scripts written without spaces between words (Han, kana, Yi; Thai, Lao, Myanmar, Khmer, Tai Tham): each
#: letter is a word of its own, so their shingles are letter n-grams (a sentence is not one "word").
_UNSPACED = ("\u0e00-\u0eff\u1000-\u109f\u1780-\u17ff\u1950-\u19df\u1a20-\u1aaf\u2e80-\u2fdf\u3005-\u3007"
             "\u3021-\u3029\u3031-\u3035\u303b\u3040-\u30ff\u3100-\u312f\u31a0-\u31bf\u31f0-\u31ff"
             "\u3400-\u4dbf\u4e00-\u9fff\ua000-\ua4cf\uf900-\ufaff\U00020000-\U0003ffff")


@functools.cache
def _patterns() -> tuple[re.Pattern, re.Pattern, re.Pattern]:
    """(a run of word characters and combining marks, which \\w leaves out: Devanagari vowel signs, Thai tone
    marks; a letter of an unspaced script; the words of a run that holds one). Built once (a pass over Unicode)."""
    marks, first = [], None
    for c in range(sys.maxunicode + 2):
        is_mark = c <= sys.maxunicode and unicodedata.category(chr(c))[0] == "M"
        if is_mark and first is None:
            first = c
        elif not is_mark and first is not None:
            marks.append(f"{re.escape(chr(first))}-{re.escape(chr(c - 1))}")
            first = None
    m = "".join(marks)
    return (re.compile(f"[\\w{m}]+"), re.compile(f"[{_UNSPACED}]"),
            re.compile(f"(?=\\w)[{_UNSPACED}][{m}]*|[^{_UNSPACED}]+"))


def _words(text: str) -> list[str]:
    if text.isascii():  # no mark, no unspaced script: the plain (fast) pattern
        return re.findall(r"\w+", text)
    run, unspaced, split = _patterns()
    words = []
    for w in run.findall(text):
        words.extend(split.findall(w) if unspaced.search(w) else (w,))
    return words


def shingles(text: str, n: int = 5) -> frozenset[str]:
    """Word ``n``-grams of the normalised, lower-cased text (the whole text if it has fewer words); in scripts
    written without spaces (Chinese, Japanese, Thai, ...) each letter is a word."""
    words = _words(normalise(INVISIBLE.sub("", text)).lower())  # as identity: a soft hyphen splits no word
    if len(words) < n:
        return frozenset([" ".join(words)]) if words else frozenset()
    return frozenset(" ".join(words[i:i + n]) for i in range(len(words) - n + 1))


def jaccard(a: frozenset, b: frozenset) -> float:
    return len(a & b) / len(a | b) if a or b else 1.0


@functools.lru_cache(maxsize=32)
def lsh_params(threshold: float, num_perm: int, *, miss_weight: float = 8.0) -> tuple[int, int]:
    """``(bands, rows)`` with ``bands * rows <= num_perm`` minimising candidate checks below the
    threshold plus ``miss_weight`` times the misses above it (areas under the S-curve)."""
    xs = np.linspace(0.0, 1.0, 201)
    best, best_cost = (1, num_perm), float("inf")
    for bands in range(1, num_perm + 1):
        for rows in range(1, num_perm // bands + 1):
            p = 1.0 - (1.0 - xs ** rows) ** bands  # chance that a pair of similarity x is a candidate
            below, above = xs <= threshold, xs >= threshold
            cost = np.trapezoid(p[below], xs[below]) + miss_weight * np.trapezoid(1.0 - p[above], xs[above])
            if cost < best_cost - 1e-12:
                best, best_cost = (bands, rows), cost
    return best


class NearDupIndex:
    """Texts added so far; :meth:`find` returns the key of one within the threshold, else None."""

    def __init__(self, threshold: float, *, num_perm: int = 128, shingle_words: int = 5):
        if not 0.0 < threshold <= 1.0:
            raise ValueError(f"threshold {threshold} is not in (0, 1]")
        self.threshold, self.shingle_words = threshold, shingle_words
        rng = np.random.default_rng(_SEED)
        self._a = rng.integers(1, 1 << 32, size=num_perm, dtype=np.uint64)
        self._b = rng.integers(0, 1 << 32, size=num_perm, dtype=np.uint64)
        self.bands, self.rows = lsh_params(threshold, num_perm)
        self._buckets: list[dict[bytes, list]] = [{} for _ in range(self.bands)]
        self._sets: dict = {}

    def sketch(self, text: str) -> tuple[frozenset, np.ndarray]:
        """``(shingles, MinHash signature)`` of ``text``: compute once, reuse for find and add."""
        sh = shingles(text, self.shingle_words)
        if not sh:
            return sh, np.full(self._a.shape, _P, dtype=np.uint64)
        x = np.fromiter((zlib.crc32(s.encode()) for s in sh), dtype=np.uint64, count=len(sh))
        sig = np.full(self._a.shape, _P, dtype=np.uint64)
        for i in range(0, len(x), _CHUNK):  # num_perm x _CHUNK products at a time: a huge prompt fits
            part = x[None, i:i + _CHUNK]
            np.minimum(sig, ((self._a[:, None] * part + self._b[:, None]) % _P).min(axis=1), out=sig)
        return sh, sig

    def _band_keys(self, sig: np.ndarray) -> list[bytes]:
        return [sig[i * self.rows:(i + 1) * self.rows].tobytes() for i in range(self.bands)]

    def find(self, sketch: tuple[frozenset, np.ndarray]):
        """The key of an added text with Jaccard >= threshold (the earliest added), or None. A text
        with no word (emoji, punctuation) has no shingles to compare: it is near no other."""
        sh, sig = sketch
        if not sh:
            return None
        cands = {k for band, bk in zip(self._buckets, self._band_keys(sig)) for k in band.get(bk, ())}
        hits = [k for k in cands if jaccard(sh, self._sets[k][0]) >= self.threshold]
        return min(hits, key=lambda k: self._sets[k][1]) if hits else None

    def add(self, key, sketch: tuple[frozenset, np.ndarray]) -> None:
        sh, sig = sketch
        self._sets[key] = (sh, len(self._sets))
        for band, bk in zip(self._buckets, self._band_keys(sig)):
            band.setdefault(bk, []).append(key)
