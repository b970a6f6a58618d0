"""The request vocabulary of qeff-kv serve, below every other room of the wing: OpenAI's request bodies parsed into
:class:`~.openai_io.Params`, the one-line API error (:class:`~.openai_io.APIError`, :func:`~.openai_io.bad`) and the
JSON limits of values read from a request (:mod:`.json_values`). Structured output, the engine, the cluster and the
HTTP routes all speak it; it imports none of them."""
