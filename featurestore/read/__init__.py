"""Reading the store: the trainer's sample reader and read-only SQL.

Owns the read paths above the table mechanics: ``reader`` (:class:`SampleReader`, rows of a
pinned version as zero-copy tensors, local files by ``pread`` or object-store blobs through Lance,
each data file checked against its CRC first) on its parts, bottom to top: ``profile`` (where a
read's time goes), ``window`` (samples in flight, from the measured rate), ``pread`` (buffers and
the system calls), ``sample`` (one sample and where its tensors go); and ``query`` (DuckDB over table versions, for
``featurestore query`` and the vocabulary counts). Uses ``schema`` and ``table``; writes nothing.
"""
