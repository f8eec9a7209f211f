"""Table and tag names of a store, checked before they become paths.

The lowest module of the table room: no I/O, no Lance, nothing heavy, so a config module can check
``featurestore.table`` at load time without pulling in the storage stack. A table name becomes a
directory inside the store and a tag a file inside the table, so both are plain identifiers.
"""

from __future__ import annotations

import re

from eaglenest.config import short
from eaglenest.errors import ConfigError, StoreError

PROMPTS = "prompts"
FEATURES = "features"

#: A table name is one plain identifier: it becomes a directory name inside the store, so nothing
#: that could climb out of it (``..``, ``/``) or hide (a leading dot) is accepted.
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}")
#: A tag is a file name inside the table (Lance ``_refs/tags``): the same rule, single dots allowed
#: inside, and Lance's (git's) ref rules: no ``..``, no trailing ``.``, no ``.lock`` suffix.
TAG = re.compile(r"(?=.{1,128}\Z)(?!.*\.lock\Z)[A-Za-z](?:\.?[A-Za-z0-9_-])*")
#: A signed whole number (``-1``: Python's "the last one"; ``+3``): no version number, and no tag name.
SIGNED = re.compile(r"\s*[+-]\s*[0-9]+\s*")
#: The largest version number Lance stores (a signed 64-bit integer on its Python side).
MAX_VERSION = 2**63 - 1


def _identifier(value, pattern: re.Pattern, what: str) -> str:
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise StoreError(f"{what} {short(value)}: use 1-128 letters, digits, '_' or '-'"
                         f"{', or single inner dots' if pattern is TAG else ''}, starting with a letter"
                         f"{' (not ending in .lock)' if pattern is TAG else ' or digit'}")
    return value


def check_name(name: str) -> str:
    """``name`` if it is a valid table name, else a :class:`StoreError` naming the key."""
    return _identifier(name, NAME, "featurestore.table: bad table name")


def check_tag(tag: str) -> str:
    """``tag`` if it is a valid tag name, else a :class:`StoreError`."""
    return _identifier(tag, TAG, "bad tag name")


def version_arg(text: str | None, what: str = "--version") -> int | str | None:
    """A version given on the command line: None, a number (ASCII digits only, at most
    :data:`MAX_VERSION`) or a tag name (looked up as given); one-line :class:`ConfigError` else."""
    if text is not None and SIGNED.fullmatch(text):  # '-1' is no tag name (those start with a letter)
        raise ConfigError(f"{what} {short(text)}: not a version number (versions are numbered 1, 2, ...; "
                          "leave the option out for the latest, `featurestore versions` lists them)")
    if text is None or not text.isdigit():  # a tag (an unknown one is refused when opened)
        return text
    if not text.isascii():  # '²' or '٣' are digits to str.isdigit, and no version number
        raise ConfigError(f"{what} {short(text)}: a version number is written in the digits 0-9")
    if len(text.lstrip("0")) > len(str(MAX_VERSION)) or int(text) > MAX_VERSION:
        raise ConfigError(f"{what} {short(text)}: no such version (version numbers go up to {MAX_VERSION})")
    return int(text)


def is_features(name: str) -> bool:
    """Every table but ``prompts`` holds one feature set (``featurestore.table``, default features)."""
    return name != PROMPTS
