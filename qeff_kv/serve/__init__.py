"""An OpenAI-compatible HTTP server over the runtime (``qeff-kv serve``; needs the ``[serve]`` extra).

Layers: :mod:`.engine` (the token-level interface), :mod:`.scheduler` (the local engine: one thread owns the
``Session``, continuous batching, chunked prefill, prompt reuse), :mod:`.text` (incremental detokenizer, stop
strings), :mod:`.app` (FastAPI routes, metrics, errors), :mod:`.server` (build an engine from a
:class:`~.config.ServeConfig`, run uvicorn). See ``docs/serving.md``.
"""
