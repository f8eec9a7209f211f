"""The ``eaglenest-tiny-target`` console script: :mod:`eaglenest.tinytarget.build` imported under
:func:`eaglenest.entry.enter`, so a Ctrl-C while it imports ends with one line, not a traceback."""

from __future__ import annotations

from eaglenest.entry import enter


def main(argv: list[str] | None = None) -> int:
    return enter("eaglenest-tiny-target", "eaglenest.tinytarget.build", argv)
