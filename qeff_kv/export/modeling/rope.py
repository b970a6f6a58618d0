"""Rotary position embeddings while exporting: which ``rotate_half`` a model uses (measured from its own code),
the exact longrope switch as a graph, the patches that swap a modeling module's helper functions while tracing,
and GroupQueryAttention's cos/sin caches (:class:`RotaryCaches`) taken from the model's own rotary module.
"""

from __future__ import annotations

import contextlib
import inspect

import torch

from qeff_kv.export import transformers_adapter as hf
from qeff_kv.export.modeling.graph_ops import RotateHalf, RotateHalfInterleaved, export_symbolics


def rotate_half(x):
    return RotateHalf.apply(x, int(x.shape[-1]))


def rotate_half_interleaved(x):
    return RotateHalfInterleaved.apply(x, int(x.dim()))


def rotate_half_kind(fn) -> str | None:
    """What a modeling module's ``rotate_half`` does, from its behaviour on a probe vector: ``"split-half"``
    (``cat(-x2, x1)`` of the two halves, Llama), ``"interleaved"`` (pairs ``(x0, x1) -> (-x1, x0)``, Cohere,
    GLM) or ``None`` (anything else, or it fails on the probe)."""
    x = torch.arange(1.0, 9.0).reshape(1, 1, 1, 8)
    try:
        with torch.no_grad():
            y = fn(x)
    except Exception:  # noqa: BLE001 - a helper that does not take one tensor is not a rotate_half
        return None
    if not isinstance(y, torch.Tensor) or y.shape != x.shape:
        return None
    if torch.equal(y, RotateHalf.forward(None, x, 8)):
        return "split-half"
    if torch.equal(y, RotateHalfInterleaved.forward(None, x, 4)):
        return "interleaved"
    return None


#: rotate_half kind -> its static-size equivalent used while tracing the onnxruntime targets.
COMPACT_ROTATE_HALF = {"split-half": rotate_half, "interleaved": rotate_half_interleaved}


def _undecorated_rope_forward(fn):
    """The rotary ``forward`` inside transformers' ``dynamic_rope_update`` decorator, or ``None``."""
    decorator_code = hf.dynamic_rope_decorator_code()
    for _ in range(8):
        inner = getattr(fn, "__wrapped__", None)
        if inner is None:
            return None
        if getattr(fn, "__code__", None) is decorator_code:
            return inner
        fn = inner
    return None


def _longrope_forward(module: torch.nn.Module, inner, decorated):
    """A rotary module's forward computing transformers' longrope choice as a graph: both frequency sets as
    constants and ``Where(max(position_ids) + 1 > original_max_position_embeddings, long, short)``, exactly
    transformers' ``longrope_frequency_update`` without its in-place copy into the ``inv_freq`` buffer (which
    the TorchScript exporter cannot express)."""
    long_sets: dict = {}

    def forward(x, position_ids, layer_type=None):
        rope_type = module.rope_type if layer_type is None else module.rope_type[layer_type]
        kwargs = {} if layer_type is None else {"layer_type": layer_type}
        if rope_type != "longrope":
            return decorated(x, position_ids, **kwargs)
        prefix = "" if layer_type is None else f"{layer_type}_"
        params = module.config.rope_parameters if layer_type is None else module.config.rope_parameters[layer_type]
        limit = int(params["original_max_position_embeddings"])
        if layer_type not in long_sets:
            long_sets[layer_type] = getattr(module, f"{prefix}long_inv_freq", None)
            if long_sets[layer_type] is None:
                long_sets[layer_type] = hf.rope_init_functions()["longrope"](module.config, x.device, seq_len=limit + 1,
                                                                        **kwargs)[0]
        short = getattr(module, f"{prefix}original_inv_freq").to(x.device)
        chosen = torch.where(position_ids.max() + 1 > limit, long_sets[layer_type].to(x.device), short)
        name = f"{prefix}inv_freq"
        saved = getattr(module, name)
        setattr(module, name, chosen)   # the forward reads the traced choice instead of the buffer
        try:
            return inner(module, x, position_ids, **kwargs)
        finally:
            setattr(module, name, saved)

    return forward


@contextlib.contextmanager
def exact_longrope(model: torch.nn.Module):
    """While tracing, every longrope rotary module selects its short/long frequencies in the graph, per forward
    pass, from ``max(position_ids) + 1`` (as transformers does), so a graph is exact on both sides of
    ``original_max_position_embeddings``. Other rotary modules are left alone."""
    patched = []
    for m in model.modules():
        types = getattr(m, "rope_type", None)
        types = set(types.values()) if isinstance(types, dict) else {types}
        if "longrope" not in types or not hasattr(m, "config"):
            continue
        inner = _undecorated_rope_forward(type(m).forward)
        if inner is None:
            continue
        m.forward = _longrope_forward(m, inner, m.forward)
        patched.append(m)
    try:
        yield
    finally:
        for m in patched:
            del m.forward


def _real_rotary_forward(module: torch.nn.Module):
    """A complex rotary module's forward in real arithmetic: ``[..., D/2, 2]`` (cos, sin) pairs times its
    ``attention_scaling``, what ``view_as_real(polar(1, p * inv_freq) * attention_scaling)`` holds."""
    def forward(x, position_ids):
        freqs = position_ids[..., None].float() * module.inv_freq.to(device=x.device, dtype=torch.float)
        return torch.stack((freqs.cos(), freqs.sin()), dim=-1) * module.attention_scaling

    return forward


def _real_apply_rotary_emb(head_axis: int):
    """``apply_rotary_emb(xq, xk, freqs)`` over interleaved pairs ``(x0, x1)`` as complex numbers, in real
    arithmetic: ``freqs`` ``[B, S, D/2, 2]`` (cos, sin) broadcast over the heads axis ``head_axis`` of ``x``
    (1: ``[B, H, S, D]``, DeepSeek-V2; 2: ``[B, S, H, D]``, Llama4)."""
    def rotate(x, freqs):
        f = freqs.unsqueeze(head_axis)
        cos, sin = f[..., 0], f[..., 1]
        pairs = x.float().reshape(*x.shape[:-1], -1, 2)
        re, im = pairs[..., 0], pairs[..., 1]
        out = torch.stack((re * cos - im * sin, re * sin + im * cos), dim=-1).flatten(-2)
        return out.type_as(x)

    def apply_rotary_emb(xq, xk, freqs_cis):
        return rotate(xq, freqs_cis), rotate(xk, freqs_cis)

    return apply_rotary_emb


def complex_rope_kind(module: torch.nn.Module, apply_fn) -> int | None:
    """For a rotary module returning complex ``freqs_cis`` (``torch.polar``, which has no ONNX form) and its
    modeling module's ``apply_rotary_emb``: the heads axis (1 or 2) for which :func:`_real_rotary_forward` and
    :func:`_real_apply_rotary_emb` compute exactly what they do, measured on a probe; ``None`` if neither does."""
    pos = torch.arange(3, dtype=torch.int64).unsqueeze(0) + 5
    x = torch.zeros(1)
    try:
        with torch.no_grad():
            want = module(x, pos)
            real = _real_rotary_forward(module)(x, pos)
    except Exception:  # noqa: BLE001 - a module called some other way is not this kind
        return None
    if not (isinstance(want, torch.Tensor) and torch.is_complex(want)) or \
            not torch.allclose(torch.view_as_real(want), real, rtol=1e-6, atol=1e-6):
        return None
    dim = int(want.shape[-1]) * 2
    for axis in (1, 2):
        shape = [1, 3, 3, dim]
        shape[axis] = 2                     # heads: 2, positions: 3
        xq = torch.randn(shape, generator=torch.Generator().manual_seed(0))
        xk = xq.flip(-1)
        try:
            with torch.no_grad():
                got = _real_apply_rotary_emb(axis)(xq, xk, real)
                ref = apply_fn(xq, xk, want)
        except Exception:  # noqa: BLE001 - the helper broadcasts over the other axis
            continue
        if all(torch.allclose(g, r, rtol=1e-5, atol=1e-5) for g, r in zip(got, ref)):
            return axis
    return None


@contextlib.contextmanager
def real_complex_rope(model: torch.nn.Module):
    """While tracing, RoPE computed through complex numbers (``torch.polar`` in the rotary module, ``view_as_complex``
    in ``apply_rotary_emb``: DeepSeek-V2, Llama4) is computed as cos/sin pairs in real arithmetic, where
    :func:`complex_rope_kind` measured that the replacement computes the same values. Restored on exit."""
    patched_modules, patched_fns = [], []
    for m in model.modules():
        if not (hasattr(m, "inv_freq") and hasattr(m, "attention_scaling")):
            continue
        modeling = hf.modeling_module(m)
        apply_fn = getattr(modeling, "apply_rotary_emb", None)
        if not callable(apply_fn):
            continue
        axis = complex_rope_kind(m, apply_fn)
        if axis is None:
            continue
        m.forward = _real_rotary_forward(m)
        patched_modules.append(m)
        if all(mod is not modeling for mod, _ in patched_fns):
            patched_fns.append((modeling, apply_fn))
            modeling.apply_rotary_emb = _real_apply_rotary_emb(axis)
    try:
        yield
    finally:
        for m in patched_modules:
            del m.forward
        for modeling, fn in patched_fns:
            modeling.apply_rotary_emb = fn


@contextlib.contextmanager
def export_patches(model: torch.nn.Module):
    """Everything changed in torch and in the model while exporting, for every target: the symbolics of
    :func:`export_symbolics`, :func:`exact_longrope` and :func:`real_complex_rope`; all restored on exit."""
    with export_symbolics(), exact_longrope(model), real_complex_rope(model):
        yield


def _modeling_modules(model: torch.nn.Module) -> list:
    """The Python modules that define the classes of ``model``'s submodules, in name order."""
    types = sorted({type(m) for m in model.modules()}, key=lambda t: t.__module__)
    types = list({t.__module__: t for t in types}.values())
    return [m for m in (hf.modeling_module(t) for t in types) if m is not None]


def rope_layout(model: torch.nn.Module) -> str | None:
    """The kind of RoPE the model's modeling code applies, measured once from its own ``rotate_half``
    (:func:`rotate_half_kind`): ``"split-half"`` or ``"interleaved"`` when every modeling module that defines a
    ``rotate_half`` has that kind, else ``None`` (none defined, or mixed, or unrecognised)."""
    kinds = {rotate_half_kind(m.rotate_half) for m in _modeling_modules(model)
             if callable(getattr(m, "rotate_half", None))}
    return kinds.pop() if len(kinds) == 1 else None


@contextlib.contextmanager
def patch_modeling_function(model: torch.nn.Module, name: str, replacement=None, *, choose=None):
    """While tracing, replace the function ``name`` in every modeling module that ``model``'s layers come from.

    transformers' decoders define helpers such as ``rotate_half`` and ``apply_rotary_pos_emb`` in their
    modeling module and call them through the module's globals. Modules without ``name`` are left alone; the
    originals are restored on exit. ``choose(original)``, when given, picks the replacement per module from
    the module's own function (``None``: leave that module's function as it is).
    """
    patched = []
    for module in _modeling_modules(model):
        if callable(getattr(module, name, None)):
            original = getattr(module, name)
            new = choose(original) if choose is not None else replacement
            if new is None:
                continue
            patched.append((module, original))
            setattr(module, name, new)
    try:
        yield
    finally:
        for module, fn in patched:
            setattr(module, name, fn)


def compact_rotary(model: torch.nn.Module):
    """``rotate_half`` as its static-size equivalent while tracing: :func:`rotate_half` where the model's own
    is the split-half kind, :func:`rotate_half_interleaved` where it is the interleaved kind (decided by
    :func:`rotate_half_kind` from the module's own function); any other ``rotate_half`` is left as it is."""
    return patch_modeling_function(model, "rotate_half",
                                   choose=lambda fn: COMPACT_ROTATE_HALF.get(rotate_half_kind(fn)))


class RotaryCaches:
    """GroupQueryAttention's ``cos_cache``/``sin_cache`` ``[max_positions, D/2]`` per layer, from the model's own
    rotary embedding module: one pair for the whole model, or one pair per layer type where the module takes a
    ``layer_type`` (Gemma3's local and global RoPE bases)."""

    def __init__(self, tables: dict, layer_keys: list):
        self.tables = tables            # key -> (cos, sin)
        self.layer_keys = layer_keys    # layer index -> its key in tables

    def for_layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tables[self.layer_keys[layer_idx]]

    def check(self, layer_idx: int, cos, sin, position_ids: torch.Tensor) -> None:
        """Raise unless ``cos``/``sin``, the values the model passed to ``apply_rotary_pos_emb`` in layer
        ``layer_idx`` while tracing (batch 1), are this layer's caches at the traced positions (each frequency
        in both halves, rotate_half layout)."""
        pos = position_ids.reshape(-1)
        for got, table, name in zip((cos, sin), self.for_layer(layer_idx), ("cos", "sin")):
            want = table[pos].detach().float()                                           # [S, D/2]
            half = int(want.shape[-1])
            tol = 1e-5 if table.dtype == torch.float32 else 2e-3
            ok = isinstance(got, torch.Tensor) and int(got.shape[-1]) == 2 * half
            if ok:
                g = got.detach().float().reshape(-1, 2 * half)
                ok = g.shape[0] == want.shape[0] and bool(
                    torch.allclose(g[:, :half], want, rtol=0, atol=tol)
                    and torch.allclose(g[:, half:], want, rtol=0, atol=tol))
            if not ok:
                raise RuntimeError(f"layer {layer_idx}: the model's RoPE {name} values are not the "
                                   f"GroupQueryAttention {name} cache of this layer")


def _rope_param_sets(cfg) -> list[dict]:
    """The RoPE parameter dicts of a config: one, or one per layer type (``{layer_type: {...}}``)."""
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if rope and all(isinstance(v, dict) for v in rope.values()):
        return list(rope.values())
    return [rope]


def rotary_caches(model: torch.nn.Module, max_positions: int) -> RotaryCaches | None:
    """GroupQueryAttention's cos/sin caches for each layer from the model's own rotary embedding module, or
    ``None`` where GQA cannot apply this RoPE itself (partial rotary, interleaved or sequence-length-dependent
    scaling): the model's own rotary code then runs before GQA."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for rope in _rope_param_sets(cfg):
        if rope.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0)) not in (None, 1, 1.0):
            return None
        if rope.get("rope_type", "default") in ("dynamic", "longrope") or "mrope_section" in rope:
            return None   # sequence-length-dependent or multimodal (3-row) positions: the model rotates
    rotary = getattr(hf.decoder(model), "rotary_emb", None)
    if rotary is None or rope_layout(model) != "split-half":  # GQA rotates split halves (interleaved: Cohere, GLM)
        return None
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    num_layers = int(cfg.num_hidden_layers)
    layer_keys: list = [None] * num_layers
    layer_types = list(getattr(cfg, "layer_types", None) or [])
    if "layer_type" in inspect.signature(rotary.forward).parameters and len(layer_types) >= num_layers:
        layer_keys = layer_types[:num_layers]         # one RoPE per layer type (Gemma3)
    pos = torch.arange(max_positions, dtype=torch.int64).unsqueeze(0)
    x = torch.zeros(1, dtype=next(model.parameters()).dtype)
    half = head_dim // 2
    tables = {}
    with torch.no_grad():
        for key in dict.fromkeys(layer_keys):
            try:
                cos, sin = rotary(x, pos) if key is None else rotary(x, pos, key)
            except Exception:  # a rotary module called some other way: the model keeps rotating itself
                return None
            if cos.shape[-1] != head_dim:
                return None
            # rotate_half RoPE repeats each frequency in both halves; GQA takes one half.
            if not torch.equal(cos[0, :, :half], cos[0, :, half:]):
                return None
            tables[key] = (cos[0, :, :half].contiguous(), sin[0, :, :half].contiguous())
    return RotaryCaches(tables, layer_keys)
