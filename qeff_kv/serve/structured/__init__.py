"""Structured output and tools: the request fields (structured_io.py, tool_io.py), JSON schemas as grammars
(schemas.py), the per-request token mask (constrained.py) and the tool-call formats (toolcalls/)."""
