"""Capture: a target's hidden states out of a vLLM engine and into a features table.

Owns the write path of ``featurestore capture``. Bottom to top: ``turns`` (loss spans of earlier
assistant turns), ``identity`` (the feature set's identity hash and where a stored set lives),
``policy`` (the on-policy guard: which target generated the responses), ``writer`` (rows to Lance
fragments within a memory budget), ``publish`` (the stream's frame format and the engine-side
publisher), ``connector`` (the KV connector vLLM loads by module path, inside the engine),
``engine`` (the capture engine: :class:`Capturer`, ``capture_llm``), ``build`` (the command body:
resumable capture into the store). Uses ``schema`` and ``table``.
"""
