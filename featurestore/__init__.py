"""eaglenest.featurestore: the versioned feature store, in rooms with one direction of dependency.

Bottom to top (a module may import only what is listed before it, and its own room's lower modules):

* :mod:`~eaglenest.featurestore.schema`: the Arrow contract (columns, feature metadata, tensor
  encoding); uses only ``eaglenest.errors``.
* :mod:`~eaglenest.featurestore.table`: table mechanics on Lance: names, object-store access, opening
  a table and the head record at the bottom; leases, integrity, fragments, versions and
  maintenance above; the :mod:`~eaglenest.featurestore.table.store` facade on top.
* :mod:`~eaglenest.featurestore.read`: reading for training and inspection (``SampleReader``,
  DuckDB queries); uses ``table``.
* :mod:`~eaglenest.featurestore.capture`: hidden states out of a vLLM engine and into the store
  (engine, connector, writer, identity, on-policy guard, the ``featurestore capture`` body); uses
  ``table``.
* :mod:`~eaglenest.featurestore.stream`: hidden states from a live engine straight to the trainer,
  on one host and across hosts; uses ``capture``.
* :mod:`~eaglenest.featurestore.config` (the recipe section; uses ``table.names`` only),
  :mod:`~eaglenest.featurestore.commands` (the subcommands' bodies; any room) and
  :mod:`~eaglenest.featurestore.cli` (the argument table) on top.

The feature store uses no stage; ``ingest`` and every later stage may use it.
``tests/test_layering.py`` checks this order from the source.
"""
