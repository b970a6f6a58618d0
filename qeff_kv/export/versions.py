"""The versions an export writes: the ONNX opset, the IR version and the exporter's own version. No torch here.

The bottom room of the exporter: the options (their hash), the trace, the traced forms' symbolics, the graph
passes' metadata and the manifest read them, so they live below all of them."""

from __future__ import annotations

OPSET = 17
#: IR version written; onnxruntime 1.31 loads IR <= 13 while onnx 1.23 writes 14 by default.
IR_VERSION = 8
#: Bump when the exported graph changes for the same options (invalidates the export cache).
EXPORTER_VERSION = 11  # 2: the output head is a Gemm(transB=1) reading its weight as stored; 3: checkpoint identity;
# 4: sliding layers as ring buffers; 5: a negative image_idx merges no image rows; 6: onnxruntime targets' single
# vision-language graphs run the vision encoder only when they merge images; 7: onnxruntime-fused folds its
# attention output's Reshape pair (FoldLayoutPairsPass); 8: onnxruntime-fused removes the shape nodes the fold
# leaves unread and packs gate/up (PackSharedInputMatMulsPass); 9: the portable and onnxruntime targets zero the
# K/V of unwritten cache slots with Where (any contents, NaN included, give the same tokens), and an export writes
# genai_config.json and inference_metadata.yaml beside the graph (a cached export without them is not reused); 10:
# --gguf-grid takes a Q4_1 GGUF's own blocks (with block-sum offsets) instead of re-quantizing them; 11: an int8 KV
# cache's custom_io.yaml lists its buffers at int8 and inference_metadata.yaml seeds its cells with int8 zeros
