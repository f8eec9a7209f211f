"""eaglenest: a data-centric pipeline that trains EAGLE-3 draft models through a versioned feature store.

This package (folder ``common/``) holds the shared plumbing only: errors, recipe loading, CLI
plumbing, provenance. Stage packages live beside it as ``eaglenest.ingest``, ``eaglenest.featurestore``,
``eaglenest.train``, ``eaglenest.serve`` and ``eaglenest.evaluate``.
"""

__version__ = "0.1.0"
