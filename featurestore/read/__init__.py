"""Reading the store: the trainer's sample reader and read-only SQL.

Owns the read paths above the table mechanics: ``reader`` (:class:`SampleReader`, rows of a
pinned version as zero-copy tensors, local files by ``pread`` or object-store blobs through Lance,
each data file checked against its CRC first) and ``query`` (DuckDB over table versions, for
``featurestore query`` and the vocabulary counts). Uses ``schema`` and ``table``; writes nothing.
"""
