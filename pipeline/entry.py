"""The console scripts of the stage commands (``[project.scripts]``): each imports its CLI module under
:func:`eaglenest.entry.enter`, so a Ctrl-C while it imports ends with one line, not a traceback. Here, above
every stage, because each names one."""

from __future__ import annotations

from eaglenest.entry import enter


def ingest(argv: list[str] | None = None) -> int:
    return enter("ingest", "eaglenest.ingest.cli", argv)


def featurestore(argv: list[str] | None = None) -> int:
    return enter("featurestore", "eaglenest.featurestore.cli", argv)


def train(argv: list[str] | None = None) -> int:
    return enter("train", "eaglenest.pipeline.train_cli", argv)


def serve(argv: list[str] | None = None) -> int:
    return enter("serve", "eaglenest.serve.cli", argv)


def evaluate(argv: list[str] | None = None) -> int:
    return enter("evaluate", "eaglenest.evaluate.cli", argv)
