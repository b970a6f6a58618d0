"""The traced forms of a decoder: the retained-state cache object, masks, RoPE, the ops with ONNX symbolics,
MoE routing, MLA, recurrent mixers and vision-language graphs (torch, while tracing)."""
