"""Family facts read from a model's config.json, and every refusal, before anything is loaded (no torch)."""
