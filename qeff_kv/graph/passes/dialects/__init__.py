"""The KV-dialect conversions (``qeff-kv rewrite --to``), one graph pass per file: retained state <-> shared-buffer
past/present (:mod:`.to_dialect`, which also picks the pass for a conversion), static cache -> retained state
(:mod:`.static_to_retained`), retained state or shared past/present -> static cache (:mod:`.retained_to_static`)."""
