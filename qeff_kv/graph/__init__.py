"""The graph layer: onnx_ir reading and writing without loading weights (graphio.py), in-place safety (inplace.py),
exporter-made dims (madeup_dims.py), and the graph rewrites as onnx_ir passes, one per file (passes/)."""
