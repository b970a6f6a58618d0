"""An export with LoRA adapters (docs/lora.md): what it adapts (:mod:`.plan`, no torch) and its proof with each
adapter (:mod:`.proof`)."""
