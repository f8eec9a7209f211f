"""eaglenest.featurestore.interop: the store as the hub between trainers.

A features table version goes out to a peer trainer's offline format (speculators, SpecForge) or
to a Hugging Face ``datasets`` directory, and a peer's hidden-state dump comes in as a new table
version (one atomic commit). The formats, their sources in the peers' code and the layer-id
conventions are in docs/export.md and docs/import.md. This package sits above ``table``, ``read``
and ``capture``; nothing below it imports it.
"""
