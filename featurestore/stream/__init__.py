"""Streaming: hidden states from a live capture engine straight to the trainer, no disk between.

Owns the bypass for targets whose features are too large to store. Bottom to top: ``producer``
(the child process running a capture engine in publish mode, started as
``python -m eaglenest.featurestore.stream.producer``), ``local`` (one host: the consumer's socket,
credits and in-order hand-out, :class:`CaptureStream`), ``hostcheck`` (what an engine host
checks of its model before it joins), ``group`` (across hosts: the store at ``train.stream.addr``, the
gloo group, the abort flag), ``xhost`` (across hosts: M engine hosts feeding N trainer ranks over
gloo, ``featurestore stream-serve``). Uses ``capture``.
"""
