"""The memory a whole-model export needs, estimated before any weight is read, and the refusal where it does not fit.

Where streaming is not possible (a GGUF file, a vision-language model, a pre-quantized checkpoint, a family on
a checkpoint the streamed plan refuses, ``QEFF_KV_EXPORT_STREAM=0``, a model transformers cannot build
from its config alone...), the exporter loads the whole model in the export dtype and traces it; at 8B and above
that is the kernel's OOM kill, minutes in. :func:`require_whole_fits` refuses it first, in one line
(:class:`~qeff_kv.errors.WholeModelMemoryError`, the size needed, what is available, why streaming was not possible
and the way out), from the checkpoint's headers alone:

* a safetensors folder: each file's JSON header (shapes and dtypes; a pre-quantized Linear's packed int4 tensor
  counts its 8 values per int32, its scales, zero points and ``g_idx`` not at all: the dequantized model's count);
* a GGUF file: its tensor table (:func:`~qeff_kv.export.weights.gguf_header.tensor_table`);
* the bundled tiny model is not checked.

The estimate is ``parameters x bytes of the export dtype x`` :data:`WHOLE_FACTOR` ``+`` :data:`BASE_BYTES`.
Measured (``/usr/bin/time -v``, ``QEFF_KV_EXPORT_STREAM=0 qeff-kv export ... --no-verify``, ctx_len 256) on the
smollm2-360m shape of ``benchmarks/make_checkpoint.py`` (361.8 M parameters, bf16 safetensors): peak RSS 6.27 GB
in float32 (1.45 GB of weights) and 3.39 GB in float16 (0.72 GB); the bundled tiny model's whole export peaks at
0.42 GB (the Python, torch and onnx baseline). (6.27 - 0.42) / 1.45 = 4.05 and (3.39 - 0.42) / 0.72 = 4.11: the
model, the traced graph's initializers, their serialized copy and the checkpoint's pages as they are read. The
shipped SmolLM2-135M Q4_1 GGUF (134.5 M parameters) peaks at 2.65 GB in float32: (2.65 - 0.42) / 0.54 = 4.14, the
same factor; what a reader holds beside the model while it loads (transformers' float32 dequantized GGUF tensors,
a pre-quantized folder's dequantized state dict: at most two copies of the weights) is gone before the trace's
peak. Verification's own copies are checked later by :func:`qeff_kv.export.verify.verification_bytes` (its room);
this is the load and the trace.

Memory available is :func:`qeff_kv.support.limits.available_memory` (``QEFF_KV_MEMORY_AVAILABLE_GB`` fakes it).
No torch at import time.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from qeff_kv.errors import ExportError, WholeModelMemoryError
from qeff_kv.export.weights import gguf_header
from qeff_kv.export.weights.checkpoint_store import tensor_files
from qeff_kv.support import limits

#: peak bytes of a whole-model load and trace per byte of the model's weights in the export dtype (measured above)
WHOLE_FACTOR = 4.1
#: the interpreter, torch, transformers and onnx before any weight
BASE_BYTES = 450 * 10**6
#: bytes per parameter of each export dtype
DTYPE_BYTES = {"float32": 4, "float16": 2}
#: values per stored element of a pre-quantized checkpoint's packed int4 tensors (int32 words)
PACKED_PER_WORD = 8
PACKED_MARKS = ("qweight", "weight_packed")


@dataclass(frozen=True)
class WholeEstimate:
    """What a whole-model export of a source needs: ``parameters`` (from the headers), ``dtype``, ``nbytes``."""

    parameters: int
    dtype: str
    nbytes: int
    reader: str


def safetensors_parameters(folder: Path) -> int:
    """The parameters of a safetensors folder from its files' headers (the index's files where it has one)."""
    shapes = {name: (str(info["dtype"]), list(info["shape"]))
              for name, (_path, _start, info) in tensor_files(Path(folder)).items()}
    packed = {name.rsplit(".", 1)[0] for name, (dtype, _shape) in shapes.items()
              if dtype == "I32" and name.rsplit(".", 1)[-1] in PACKED_MARKS}
    total = 0
    for name, (dtype, shape) in shapes.items():
        module, _dot, part = name.rpartition(".")
        if module in packed and part not in PACKED_MARKS:
            continue   # a packed Linear's scales, zero points, g_idx: not parameters of the loaded model
        count = 1
        for d in shape:
            count *= int(d)
        total += count * (PACKED_PER_WORD if module in packed else 1)
    return total


def gguf_parameters(path: Path) -> int:
    """The parameters of a GGUF file from its tensor table (dims only; no tensor data is read)."""
    total = 0
    for _name, dims, _type in gguf_header.tensor_table(path, error=ExportError):
        count = 1
        for d in dims:
            count *= int(d)
        total += count
    return total


def estimate(source, dtype: str, prequantized: bool = False) -> WholeEstimate | None:
    """The peak of a whole-model load and trace of ``source`` in ``dtype``; ``None`` for the bundled model."""
    if source.kind == "gguf":
        params, reader = gguf_parameters(source.path), "gguf"
    elif source.kind == "folder":
        params, reader = safetensors_parameters(source.path), "prequant" if prequantized else "folder"
    else:
        return None
    return WholeEstimate(params, dtype, int(params * DTYPE_BYTES[dtype] * WHOLE_FACTOR) + BASE_BYTES, reader)


def way_out(source, options, reason: str, fits_half: bool) -> str:
    """The concrete way out for a model that cannot load whole here (``reason``: why it did not stream)."""
    from qeff_kv.export.weights.stream import STREAM_ENV

    outs = []
    if reason == f"{STREAM_ENV}=0":
        outs.append(f"unset {STREAM_ENV} (the streamed export holds a few tensors at a time)")
    elif source.kind == "gguf":   # a GGUF that does not stream (MoE experts merged at load, a newer conversion)
        outs.append("export the model's safetensors folder instead (it streams tensor by tensor)")
    elif getattr(options, "prequant", None):
        outs.append("export the model's float release with --weights int4 instead (it streams)")
    if fits_half:
        outs.append("pass --dtype float16 (half the memory)")
    outs.append("free memory or use a machine with more (--no-verify does not lower this)")
    return "; ".join(outs)


def require_whole_fits(source, options, reason: str) -> WholeEstimate | None:
    """Refuse (:class:`~qeff_kv.errors.WholeModelMemoryError`, one line) a whole-model load that would not fit in
    the memory available now, before any weight is read; ``reason``: why streaming was not possible."""
    est = estimate(source, options.dtype, prequantized=bool(getattr(options, "prequant", None)))
    avail = limits.available_memory()
    if est is None or avail is None or est.nbytes <= avail:
        return est
    half = estimate(source, "float16", prequantized=est.reader == "prequant") if options.dtype == "float32" else None
    raise WholeModelMemoryError(
        f"{source.name}: loading the whole model needs about {est.nbytes / 1e9:.1f} GB "
        f"({_count(est.parameters)} parameters in {est.dtype}; streaming is not possible: {reason}), "
        f"{avail / 1e9:.1f} GB available; {way_out(source, options, reason, half is not None and half.nbytes <= avail)}")


def _count(n: int) -> str:
    for unit, size in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return str(n)


def reason_without_say(source) -> str:
    """Why a source never tries to stream (no line says it): the cases :func:`stream.open_streamed` returns
    ``None`` for before it looks at the checkpoint."""
    from qeff_kv.export.weights.stream import STREAM_ENV

    if os.environ.get(STREAM_ENV, "1") == "0":
        return f"{STREAM_ENV}=0"
    return "the model loads whole"


class StreamReasons:
    """A progress callback that passes every line on and keeps the last reason streaming was refused (the text
    inside ``streaming is not possible (...): loading the whole model``, as stream.py and api.py say it)."""

    HEAD, TAIL = "streaming is not possible (", "): loading the whole model"

    def __init__(self, say):
        self.say = say
        self.reason: str | None = None

    def __call__(self, msg: str) -> None:
        if msg.startswith(self.HEAD) and msg.endswith(self.TAIL):
            self.reason = msg[len(self.HEAD): -len(self.TAIL)]
        self.say(msg)
