"""Weights as the exporter reads and writes them: checkpoints tensor by tensor (checkpoint_store.py), the
streaming export (stream.py), int4/int8 (quantize.py, quantize_stream.py), the GGUF's own blocks (gguf_grid.py,
gguf_header.py) and pre-quantized checkpoints (prequant/)."""
