"""The tools layer: the library halves of the graph commands (rewrite, check, buffers, compile-config) and the
assert-style helpers for other projects' suites (testing.py). onnx_ir only: no torch, no onnxruntime."""
