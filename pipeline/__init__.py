"""What orchestrates several stages, above all of them.

The stages depend in one direction (``ingest -> featurestore -> train -> serve -> evaluate``, each
also on ``featurestore`` and the shared ``eaglenest`` plumbing). Anything that needs a later stage
while an earlier one runs lives here: served-AL checkpoint selection during training
(:mod:`eaglenest.pipeline.served_al`, which exports and serves snapshots) and the ``train`` command
that wires it in (:mod:`eaglenest.pipeline.train_cli`; ``train run`` itself is
:mod:`eaglenest.pipeline.commands`). ``tests/test_layering.py`` checks the graph.
"""
