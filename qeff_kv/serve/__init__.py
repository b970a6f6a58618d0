"""An OpenAI-compatible HTTP server over the runtime (``qeff-kv serve``; needs the ``[serve]`` extra).

Rooms, bottom to top (each imports only the ones below it): :mod:`.wire` (the request vocabulary), :mod:`.structured`
(structured output and tools), :mod:`.engine` (the token-level interface, the local scheduler that owns the
``Session``), :mod:`.cluster` (Ray: disaggregated prefill/decode, the KV connector, KV events), :mod:`.http` (FastAPI
routes, metrics, errors), :mod:`.config` (:class:`~.config.ServeConfig`, the composition of the sections each room
keeps for its options), :mod:`.server` (resolve the export once, build the engine and the app, run uvicorn). See
``docs/serving.md``.
"""
