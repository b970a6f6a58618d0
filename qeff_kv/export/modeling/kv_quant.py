"""A quantized KV cache (``--kv-cache-dtype int8``, ``int4``): the static per-channel scales, calibrated at export,
and the emulation of the cache's quantization in the PyTorch reference.

The graph keeps its retained KV buffers in int8; onnxruntime's GroupQueryAttention writes ``q = saturate(round(x /
scale))`` (round half to even, as ``QuantizeLinear``; measured on its CPU kernel) and attends over ``q * scale``,
prompt included. The scales are static: one per layer, per KV head and per channel (``[1, kv_heads, 1, head_dim]``,
GroupQueryAttention's ``PER_CHANNEL``), calibrated as :data:`MARGIN` times the absolute maximum of each key/value
channel over one forward pass of the model on :data:`CALIBRATION_TEXT` (seeded random token ids where the export has
no tokenizer), divided by 127. Values beyond the margin saturate at +-127 in the graph and in the emulation alike.

``int4`` (the fused target only) is the same with GroupQueryAttention's ``kv_cache_bit_width=4``: the absmax over 7,
``x / scale`` rounded half to even and saturated to [-8, 7], kept offset by 8 as two nibbles per uint8 byte (element
``2i`` in the low nibble; :func:`.graph_ops.quantize_int4`, measured on onnxruntime 1.32's CPU kernel).

The verification reference is the transformers model with every cache write quantized then dequantized with the
same scales and rounding (:func:`emulated_cache`), so the graph is exact to it as a float export is to the float
model. Their names are the contract's (:func:`qeff_kv.contract.naming.kv_scale_name`).
"""

from __future__ import annotations

import contextlib

import numpy as np

from qeff_kv.errors import ExportError

#: the calibrated absmax is stretched by this factor before it becomes the int8 range: keys/values the calibration
#: pass did not reach up to 25% past its largest one are kept; a value beyond that saturates
MARGIN = 1.25
QMAX = 127
#: the largest code of each bit width's symmetric range (the scale maps the margin's absmax onto it)
QMAX_BY_BITS = {8: QMAX, 4: 7}
#: the calibration pass's text (with the export's tokenizer): a paragraph of plain English prose
CALIBRATION_TEXT = (
    "The committee met on a grey Tuesday morning to decide what the town would do with the old mill by the river. "
    "Some wanted it turned into a library, others a market hall; an engineer explained that the floors would need "
    "new beams, and that the water wheel, if restored, could light the building in winter. By noon they agreed to "
    "ask the people, and a notice was printed in the paper that evening: 1,204 votes were counted a week later.")
#: without a tokenizer: this many seeded random token ids
CALIBRATION_TOKENS = 96
#: at most this many tokens are read: the scales depend on the checkpoint and its tokenizer only (not on ctx_len),
#: so the int8 exports of one checkpoint hold one cache and accept each other's state files
CALIBRATION_MAX = 128
CALIBRATION_SEED = 4321


def calibration_ids(tokenizer, vocab_size: int, max_positions: int) -> list[int]:
    """The calibration pass's token ids: :data:`CALIBRATION_TEXT` through ``tokenizer`` (a ``tokenizers``
    object), else :data:`CALIBRATION_TOKENS` seeded random ids; at most :data:`CALIBRATION_MAX` and the model's
    ``max_positions``."""
    ids = list(tokenizer.encode(CALIBRATION_TEXT).ids) if tokenizer is not None else []
    if not ids:
        rng = np.random.default_rng(CALIBRATION_SEED)
        ids = [int(t) for t in rng.integers(3 if vocab_size > 8 else 0, vocab_size, size=CALIBRATION_TOKENS)]
    return ids[:min(CALIBRATION_MAX, max_positions)]


def calibrate(model, ids: list[int], num_layers: int, bits: int = 8) -> list[tuple]:
    """Per layer, ``(k_scale, v_scale)`` float32 torch tensors ``[1, kv_heads, 1, head_dim]``: :data:`MARGIN` times
    the absmax of each channel of what the layer writes to its cache over one forward pass on ``ids``, over 127
    (over 7 for ``bits=4``)."""
    import torch

    from qeff_kv.export import transformers_adapter as hf

    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids], dtype=torch.int64), use_cache=True)
    cache = hf.returned_cache(out)
    layers = getattr(cache, "layers", None) or []
    scales = []
    for i in range(num_layers):
        keys = getattr(layers[i], "keys", None) if i < len(layers) else None
        values = getattr(layers[i], "values", None) if i < len(layers) else None
        if keys is None or values is None or keys.dim() != 4 or keys.shape[-1] != values.shape[-1]:
            raise ExportError(f"{type(model).__name__}: layer {i} keeps no plain key/value cache to calibrate; "
                              f"--kv-cache-dtype int{bits} cannot be used with this model (export without it)")
        scales.append(tuple(_scale(t.float(), QMAX_BY_BITS[bits]) for t in (keys, values)))
    return scales


def _scale(states, qmax: int = QMAX):
    """``[B, H, S, D]`` -> ``[1, H, 1, D]``: MARGIN * absmax over batch and positions / ``qmax`` (a channel that is
    always zero gets the smallest normal scale, so its zeros stay zeros)."""
    import torch

    amax = states.abs().amax(dim=(0, 2)).unsqueeze(0).unsqueeze(2)
    return torch.clamp(amax * MARGIN / qmax, min=torch.finfo(torch.float32).tiny).to(torch.float32)


def fake_quantize(x, scale, bits: int = 8):
    """``x`` as the int8 (``bits=4``: int4) cache gives it back: quantized then dequantized
    (:func:`.graph_ops.kv_codec`, the fused target's own), in ``x``'s dtype."""
    from qeff_kv.export.modeling.graph_ops import kv_codec

    quantize, dequantize = kv_codec(bits)
    return dequantize(quantize(x, scale), scale, x.dtype)


@contextlib.contextmanager
def emulated_cache(scales: list[tuple] | None, bits: int = 8):
    """While active, every transformers cache write is quantized then dequantized with layer ``i``'s scales (the
    verification reference of an int8-cache graph; ``bits=4``: an int4 one); ``None``: nothing changes."""
    if scales is None:
        yield
        return
    from qeff_kv.export import transformers_adapter as hf

    def write(layer_idx, keys, values):
        k_scale, v_scale = scales[layer_idx]
        return fake_quantize(keys, k_scale, bits), fake_quantize(values, v_scale, bits)

    with hf.cache_writes_through(write):
        yield


def scales_record(scales: list[tuple], bits: int = 8) -> dict:
    """What the manifest says of the scales (how they were chosen; the values are the graph's initializers)."""
    low, high = (-128, 127) if bits == 8 else (-8, 7)
    return {"dtype": f"int{bits}", "granularity": "per layer, per kv head, per channel", "margin": MARGIN,
            "rounding": f"half to even, saturated to [{low}, {high}]", "layers": len(scales),
            **({"packing": "two values per uint8 byte, element 2i in the low nibble, stored as value + 8"}
               if bits == 4 else {})}
