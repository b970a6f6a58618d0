"""Tiny pre-quantized int4 checkpoints written in the test, from the formats' published descriptions (not from the
exporter's readers): a seeded random-weight Llama's Linear weights quantized (min-max, float16 or bfloat16 scales),
packed as AutoAWQ GEMM, GPTQ (v1 zero points minus one, or v2; with or without act-order ``g_idx``) or
compressed-tensors ``pack-quantized`` stores them, with the ``quantization_config`` each writes; and beside it the
float reference: the same model with every Linear's exact dequantization ``scale * (q - zero)`` (float32) and the
other tensors as the int4 checkpoint stores them (float16), saved as a plain float checkpoint.

torch/transformers are imported inside the functions.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


@dataclass
class Quantized:
    """One Linear: ``q [N, K]``, ``zeros [N, G]`` (unsigned 0..15), ``scales [N, G]`` (as stored), ``g_idx [K]``."""

    q: np.ndarray
    zeros: np.ndarray
    scales: np.ndarray
    g_idx: np.ndarray

    def dequantize(self) -> np.ndarray:
        s = self.scales.astype(np.float32)[:, self.g_idx]
        return s * (self.q.astype(np.float32) - self.zeros[:, self.g_idx].astype(np.float32))


def quantize(w: np.ndarray, group: int, sym: bool, act_order: bool, rng, scale_dtype="float16") -> Quantized:
    """Min-max int4 of ``w [N, K]`` in groups of ``group`` input features (-1: one group); act-order: the groups are
    a random permutation's runs (``g_idx`` scattered)."""
    import torch

    n, k = w.shape
    g = k if group == -1 else group
    perm = rng.permutation(k) if act_order else np.arange(k)
    g_idx = np.empty(k, np.int64)
    g_idx[perm] = np.arange(k) // g
    groups = k // g
    scales = np.empty((n, groups), np.float32)
    zeros = np.empty((n, groups), np.int64)
    for j in range(groups):
        cols = w[:, g_idx == j]
        if sym:
            s = np.abs(cols).max(axis=1) / 7.0
            z = np.full(n, 8)
        else:
            lo, hi = np.minimum(cols.min(axis=1), 0), np.maximum(cols.max(axis=1), 0)
            s = (hi - lo) / 15.0
            z = np.clip(np.round(-lo / s), 0, 15)
        scales[:, j], zeros[:, j] = s, z
    tdt = getattr(torch, scale_dtype)
    scales = torch.from_numpy(scales).to(tdt).float().numpy()           # the stored scales, exactly
    sg, zg = scales[:, g_idx], zeros[:, g_idx]
    q = np.clip(np.round(w / sg) + zg, 0, 15).astype(np.uint8)
    return Quantized(q, zeros.astype(np.uint8), scales, g_idx)


def pack_along(values: np.ndarray, axis: int, order=tuple(range(8))) -> np.ndarray:
    """Eight 4-bit values per int32 along ``axis``: nibble ``i`` of int32 ``j`` holds element ``8j + order[i]``."""
    v = np.moveaxis(values.astype(np.uint32) & 0xF, axis, 0)
    out = np.zeros((v.shape[0] // 8,) + v.shape[1:], np.uint32)
    for i in range(8):
        out |= v[order[i]::8] << np.uint32(4 * i)
    return np.ascontiguousarray(np.moveaxis(out, 0, axis)).view(np.int32)


def awq_tensors(ql: Quantized) -> dict:
    return {"qweight": pack_along(ql.q.T, 1, AWQ_ORDER), "qzeros": pack_along(ql.zeros.T, 1, AWQ_ORDER),
            "scales": ql.scales.T.astype(np.float16)}


def gptq_tensors(ql: Quantized, v1: bool) -> dict:
    z = ql.zeros.T.astype(np.int64) - (1 if v1 else 0)            # v1: zero points stored minus one
    return {"qweight": pack_along(ql.q.T, 0), "qzeros": pack_along(z, 1), "scales": ql.scales.T.astype(np.float16),
            "g_idx": ql.g_idx.astype(np.int32)}


def compressed_tensors(ql: Quantized, sym: bool) -> dict:
    import torch

    n, k = ql.q.shape
    out = {"weight_packed": pack_along(ql.q, 1),               # signed q + 8: the unsigned nibble itself
           "weight_scale": torch.from_numpy(ql.scales).to(torch.bfloat16),
           "weight_shape": np.array([n, k], np.int64)}
    if not sym:
        out["weight_zero_point"] = pack_along(ql.zeros, 0)     # packed along the outputs (packed_dim=0)
    if not np.array_equal(ql.g_idx, np.arange(k) // (k // ql.scales.shape[1])):
        out["weight_g_idx"] = ql.g_idx.astype(np.int32)
    return out


def quantization_config(kind: str, group: int, sym: bool, act_order: bool, v1: bool = True) -> dict:
    if kind == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "version": "gemm", "zero_point": True}
    if kind == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": act_order, "sym": sym,
                "checkpoint_format": "gptq" if v1 else "gptq_v2", "true_sequential": True}
    weights = {"num_bits": 4, "type": "int", "symmetric": sym, "dynamic": False,
               "strategy": "channel" if group == -1 else "group", "group_size": None if group == -1 else group,
               "actorder": "group" if act_order else None, "observer": "minmax"}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None}},
            "ignore": ["lm_head"], "kv_cache_scheme": None}


@dataclass
class Checkpoint:
    folder: Path
    reference: Path
    linears: dict = field(default_factory=dict)   # module name -> Quantized


def make_checkpoint(kind: str, root: Path, *, group: int = 32, sym: bool = False, act_order: bool = False,
                    v1: bool = True, seed: int = 0, arch: str = "llama", keep_float: tuple = (),
                    **overrides) -> Checkpoint:
    """Write the int4 checkpoint ``root/<kind>-ckpt`` and its float reference ``root/<kind>-ref``; the Linears
    named in ``keep_float`` stay float16 (AWQ's ``modules_to_not_convert``, compressed-tensors' ``ignore``)."""
    import torch
    import transformers
    from safetensors.torch import save_file

    from hf_models import make_model_dir

    src = make_model_dir(arch, root / "src", seed=seed, **overrides)
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    rng = np.random.default_rng(seed + 100)
    stored, reference, linears = {}, {}, {}
    for key, t in model.state_dict().items():
        name = key[: -len(".weight")]
        if key.endswith(".weight") and name.split("layers.")[-1].split(".", 1)[-1] in LINEARS \
                and name not in keep_float:
            ql = quantize(t.numpy(), group, sym, act_order, rng,
                          "bfloat16" if kind == "compressed-tensors" else "float16")
            linears[name] = ql
            reference[key] = torch.from_numpy(ql.dequantize())
            parts = (awq_tensors(ql) if kind == "awq" else gptq_tensors(ql, v1) if kind == "gptq"
                     else compressed_tensors(ql, sym))
            for p, v in parts.items():
                stored[f"{name}.{p}"] = v if isinstance(v, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(v))
        else:
            stored[key] = t.to(torch.float16)
            reference[key] = stored[key].float()
    folder = root / f"{kind}-ckpt"
    folder.mkdir(parents=True)
    save_file(stored, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = quantization_config(kind, group, sym, act_order, v1)
    if keep_float:
        cfg["quantization_config"]["modules_to_not_convert" if kind != "compressed-tensors" else "ignore"] = \
            list(keep_float)
    cfg["torch_dtype"] = "float16"
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    model.load_state_dict(reference)
    model.save_pretrained(root / f"{kind}-ref", safe_serialization=True)
    return Checkpoint(folder, root / f"{kind}-ref", linears)
