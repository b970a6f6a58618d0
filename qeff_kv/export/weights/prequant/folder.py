"""A pre-quantized checkpoint folder: its safetensors tensors by name, every quantized Linear unpacked by its
layout's reader (:data:`READERS`), and the model the PyTorch reference runs: transformers' class built from
``config.json`` **without** its ``quantization_config`` (no AutoAWQ/GPTQ/compressed-tensors package is needed),
every quantized Linear's ``weight`` its exact float32 dequantization, every other tensor as the checkpoint holds it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np

from qeff_kv.errors import ExportError
from qeff_kv.export import transformers_adapter as hf
from qeff_kv.export.weights.checkpoint_store import tensor_files
from qeff_kv.export.weights.prequant import awq, compressed, gptq
from qeff_kv.export.weights.prequant.blocks import QuantizedLinear
from qeff_kv.export.weights.prequant.scheme import PrequantScheme

#: the reader of each format: ``MARK`` (the tensor that marks a quantized Linear), ``ALL`` (its tensors), ``read``
READERS = {"awq": awq, "gptq": gptq, "compressed-tensors": compressed}
_EXACT_NUMPY = ("int8", "uint8", "int16", "int32", "int64", "float16", "float32", "float64", "bool")


class Tensors:
    """The folder's safetensors tensors by name, each from the file :func:`.checkpoint_store.tensor_files` says
    holds it (the index's choice; a tensor in two files refused), files memory-mapped."""

    def __init__(self, folder: Path):
        from safetensors import safe_open

        self.files: dict[Path, object] = {}
        self.where: dict[str, Path] = {key: path for key, (path, _start, _info) in tensor_files(folder).items()}
        for f in sorted(set(self.where.values())):
            try:
                self.files[f] = safe_open(str(f), framework="pt")
            except Exception as exc:   # noqa: BLE001 - a truncated or foreign file: one line
                raise ExportError(f"{f}: unreadable safetensors file ({str(exc).splitlines()[0]})") from None

    def has(self, key: str) -> bool:
        return key in self.where

    def torch(self, key: str):
        if key not in self.where:
            raise ExportError(f"the checkpoint has no tensor {key!r}")
        return self.files[self.where[key]].get_tensor(key)

    def numpy(self, key: str) -> np.ndarray:
        """The tensor as numpy: integers as stored, bfloat16 widened to float32 (exactly)."""
        t = self.torch(key)
        return t.numpy() if str(t.dtype).removeprefix("torch.") in _EXACT_NUMPY else t.float().numpy()


def quantized_names(tensors: Tensors, scheme: PrequantScheme) -> list[str]:
    """The module names of the checkpoint's quantized Linears, in file order."""
    mark = "." + READERS[scheme.format].MARK
    return [k[: -len(mark)] for k in tensors.where if k.endswith(mark)]


def read_linear(tensors: Tensors, scheme: PrequantScheme, name: str) -> QuantizedLinear:
    """The quantized Linear ``name`` (a module name), unpacked by its layout's reader."""
    return READERS[scheme.format].read(name, tensors.numpy, scheme, tensors.has)


def quantized_linears(tensors: Tensors, scheme: PrequantScheme) -> Iterator[QuantizedLinear]:
    """Every quantized Linear of the checkpoint, unpacked, one at a time."""
    names = quantized_names(tensors, scheme)
    if not names:
        raise ExportError(f"the config says {scheme.describe()}, but the checkpoint holds no "
                          f"'*.{READERS[scheme.format].MARK}' tensor")
    for name in names:
        yield read_linear(tensors, scheme, name)


def float_tensors(tensors: Tensors, scheme: PrequantScheme, dtype) -> Iterator[tuple[str, object]]:
    """The model's tensors one at a time, ``(state-dict key, torch tensor in dtype)``: each quantized Linear's
    ``weight`` dequantized, every other tensor as stored (a streaming loader takes them in this order)."""
    import torch

    parts = READERS[scheme.format].ALL
    taken = set()
    for ql in quantized_linears(tensors, scheme):
        taken |= {f"{ql.name}.{p}" for p in parts}
        yield f"{ql.name}.weight", torch.from_numpy(ql.dequantize()).to(dtype)
    for key in tensors.where:
        if key not in taken:
            t = tensors.torch(key)
            yield key, t.to(dtype) if t.is_floating_point() else t


def float_state_dict(tensors: Tensors, scheme: PrequantScheme, dtype) -> dict:
    """The model's state dict in ``dtype`` (:func:`float_tensors`)."""
    return dict(float_tensors(tensors, scheme, dtype))


def load_dequantized(folder: Path, config: dict, scheme: PrequantScheme, dtype, say):
    """The transformers model of ``folder`` with the dequantized weights, eager attention, eval mode."""
    torch, transformers = hf.import_transformers()
    say(f"loading {folder} ({scheme.describe()}: the int4 weights dequantized exactly to float32 for the "
        "reference)")
    cfg = transformers.AutoConfig.from_pretrained(folder)
    for part in (cfg, getattr(cfg, "text_config", None)):
        if part is not None and hasattr(part, "quantization_config"):
            delattr(part, "quantization_config")
    auto = transformers.AutoModelForImageTextToText if isinstance(config.get("vision_config"), dict) \
        else hf.causal_lm_loader(transformers, config)
    try:
        model = auto.from_config(cfg, attn_implementation="eager", dtype=dtype)
    except Exception as exc:   # noqa: BLE001 - bad config values: one line
        raise ExportError(f"{folder}: cannot build the model from config.json ({str(exc).splitlines()[0]})") from None
    state = float_state_dict(Tensors(folder), scheme, dtype)
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as exc:   # size mismatch: the first line naming a tensor
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        raise ExportError(f"{folder}: the weights do not match config.json ({lines[min(1, len(lines) - 1)]})") \
            from None
    if unexpected:
        raise ExportError(f"{folder}: {len(unexpected)} tensors of the checkpoint are not weights of the model "
                          f"(e.g. {sorted(unexpected)[0]!r})")
    model.tie_weights()
    loaded = {p.data_ptr() for k, p in model.state_dict().items() if k in state}
    missing = [k for k in missing if model.state_dict()[k].data_ptr() not in loaded]
    if missing:
        raise ExportError(f"{folder}: the weights do not match config.json: {len(missing)} tensors are missing "
                          f"(e.g. {sorted(missing)[0]!r})")
    return model.eval()
