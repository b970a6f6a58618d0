"""The contract layer: the naming contract (naming.py, the only code that spells buffer names and metadata keys),
what each layer retains (statespec.py), the KV layout, the VLM layouts, CCL lists, chunk plans and multimodal RoPE.
Numpy only: no onnx_ir, no onnxruntime, no torch."""
