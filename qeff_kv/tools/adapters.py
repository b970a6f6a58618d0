"""PEFT LoRA adapters read without torch, checked against a graph's adapter inputs, and stacked into them.

* :func:`read_adapter` reads a PEFT folder (``adapter_config.json`` + ``adapter_model.safetensors``: the pickle
  ``adapter_model.bin`` is never opened) into an :class:`Adapter`: per ``(layer, module)`` its ``A [in, r]`` and
  ``B [r, out]`` as float32, with the module's PEFT scaling (``lora_alpha / r``, ``lora_alpha / sqrt(r)`` with
  ``use_rslora``; per module with ``rank_pattern``/``alpha_pattern``) folded into ``B``. Variants whose math is not
  ``x @ A @ B`` (DoRA, biases, trained full modules, ...) are refused in one line.
* :func:`fit` says why an adapter does not fit a graph's :class:`~qeff_kv.contract.lora.LoraGeometry`.
* :func:`stack` builds the graph's ``lora_A.*``/``lora_B.*`` inputs: slot 0 the zero adapter, then one slot per
  adapter, smaller ranks zero-padded (exact).
* :func:`summary`: an adapter's description for manifests and ``/v1/models``.

numpy and the standard library only: a serving host has no torch, transformers or peft.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from qeff_kv.contract.lora import LoraGeometry
from qeff_kv.errors import AdapterError
from qeff_kv.support import fsutil, safetensors_header

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILE = "adapter_model.bin"

#: the prefix PEFT's state dict puts before the wrapped model's module names (``PeftModel.base_model.model``)
PEFT_PREFIX = "base_model.model."

#: ``<stack>.<layer>.<module>.lora_A|B[.<adapter name>].weight``: the first numbered segment is the layer (PEFT's
#: own rule for ``layers_to_transform``), ``module`` the path inside it (``self_attn.q_proj``)
_KEY_RE = re.compile(r"(?P<stack>(?:.*?\.)?[A-Za-z_]\w*)\.(?P<layer>0|[1-9][0-9]*)\.(?P<module>[A-Za-z_][\w.]*?)"
                     r"\.lora_(?P<part>[AB])(?:\.(?P<adapter>[A-Za-z_][\w-]*))?\.weight")

#: config fields whose value, when set, changes the math or adds weights a stacked ``x @ A @ B`` cannot hold
_REFUSED = (
    ("use_dora", "DoRA (use_dora)"),
    ("use_qalora", "QA-LoRA (use_qalora)"),
    ("lora_bias", "a trained bias on lora_B (lora_bias)"),
    ("fan_in_fan_out", "fan_in_fan_out (Conv1D weights stored [in, out])"),
    ("modules_to_save", "fully trained modules (modules_to_save)"),
    ("layer_replication", "layer replication (layer_replication)"),
    ("trainable_token_indices", "trained token embeddings (trainable_token_indices)"),
    ("alora_invocation_tokens", "activated LoRA (alora_invocation_tokens)"),
    ("target_parameters", "LoRA on parameters (target_parameters)"),
    ("use_bdlora", "block-diagonal LoRA (use_bdlora)"),
    ("monteclora_config", "Monte Carlo LoRA (monteclora_config)"),
    ("arrow_config", "Arrow routing (arrow_config)"),
    ("kasa_config", "KaSA (kasa_config)"),
)

#: ``init_lora_weights`` values that also rewrite the base model's weights: the adapter alone is not the delta
_BASE_CHANGING_INITS = ("pissa", "corda", "olora", "loftq", "lora_ga")

#: safetensors dtype -> (little-endian storage type, bytes per element)
_STORAGE = {"F32": ("<f4", 4), "F16": ("<f2", 2), "BF16": ("<u2", 2), "F64": ("<f8", 8)}


@dataclass(frozen=True, eq=False)
class Adapter:
    """A PEFT LoRA adapter read by :func:`read_adapter`.

    ``weights[(layer, module)]`` is ``(A [in_features, r_m], B [r_m, out_features])`` (float32, read-only), the
    module's PEFT scaling folded into ``B``: the module's delta is ``x @ A @ B``. ``rank`` is the largest ``r_m``;
    ``alpha`` the config's ``lora_alpha``; ``modules`` the adapted module paths inside a layer (sorted);
    ``layers`` the adapted layers (sorted); ``base_model`` the config's ``base_model_name_or_path``."""

    name: str
    path: Path
    rank: int
    alpha: float
    rslora: bool
    modules: tuple[str, ...]
    layers: tuple[int, ...]
    base_model: str | None
    weights: dict = field(repr=False)

    @property
    def nbytes(self) -> int:
        """Bytes of the adapter's own weights (float32)."""
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


# ------------------------------------------------------------------------------------------------ reading
def read_adapter(path, name: str | None = None) -> Adapter:
    """The PEFT LoRA adapter in folder ``path`` (named ``name``, else the folder's name). Raises
    :class:`~qeff_kv.errors.AdapterError` (one line) for a folder that is not a plain LoRA adapter."""
    folder = Path(path)
    name = name if name is not None else folder.resolve().name
    if not name:
        raise AdapterError(f"adapter {folder}: the adapter name is empty")
    config = _read_config(folder, name)
    _check_config(config, name)
    tensors = _read_safetensors(_weights_file(folder, name), name)
    weights = _weights(tensors, config, name)
    return Adapter(
        name=name, path=folder, rank=max(a.shape[1] for a, _ in weights.values()),
        alpha=float(config.get("lora_alpha", 8)), rslora=bool(config.get("use_rslora")),
        modules=tuple(sorted({m for _, m in weights})), layers=tuple(sorted({layer for layer, _ in weights})),
        base_model=config.get("base_model_name_or_path") or None, weights=weights)


def _read_config(folder: Path, name: str) -> dict:
    if not folder.is_dir():
        raise AdapterError(f"adapter {name}: {folder} is not a folder")
    file = folder / CONFIG_FILE
    if not file.is_file():
        raise AdapterError(f"adapter {name}: {folder} has no {CONFIG_FILE} (not a PEFT adapter folder)")
    return fsutil.read_json_object(file, AdapterError)


def _weights_file(folder: Path, name: str) -> Path:
    file = folder / WEIGHTS_FILE
    if file.is_file():
        return file
    if (folder / PICKLE_FILE).is_file():
        raise AdapterError(f"adapter {name}: {folder} holds only {PICKLE_FILE} (a pickle, unsafe to load): save the "
                           f"adapter with safetensors (save_pretrained(..., safe_serialization=True))")
    raise AdapterError(f"adapter {name}: {folder} has no {WEIGHTS_FILE}")


def _check_config(config: dict, name: str) -> None:
    """Refuse an adapter that is not plain LoRA (one line naming the field)."""
    kind = config.get("peft_type")
    if str(kind).upper() != "LORA":
        raise AdapterError(f"adapter {name}: peft_type is {kind!r}, not LORA: only LoRA adapters are supported")
    for key, what in _REFUSED:
        if config.get(key):
            raise AdapterError(f"adapter {name}: {what} is not supported ({key}: {json.dumps(config[key])}): "
                               f"only plain LoRA adapters can be stacked")
    bias = config.get("bias", "none")
    if bias not in (None, "none"):
        raise AdapterError(f"adapter {name}: bias={bias!r} is not supported (it trains the base model's biases): "
                           f"only bias='none' adapters can be stacked")
    init = config.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS):
        raise AdapterError(f"adapter {name}: init_lora_weights={init!r} changes the base model's weights: convert "
                           f"it to a plain LoRA adapter first (PEFT's path_initial_model_for_weight_conversion)")
    for key in ("r", "lora_alpha"):
        value = config.get(key, 8)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise AdapterError(f"adapter {name}: {key} must be a positive number, not {value!r}")
    for key in ("rank_pattern", "alpha_pattern"):
        if not isinstance(config.get(key) or {}, dict):
            raise AdapterError(f"adapter {name}: {key} must be a mapping, not {config[key]!r}")


def _read_safetensors(file: Path, name: str) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file as float32, read without torch (numpy cannot hold bfloat16: its bits
    are widened into float32's upper half, which is exact); the header validated first
    (:mod:`qeff_kv.support.safetensors_header`: a regular file, in-order ranges covering the data)."""
    start, header, _size = safetensors_header.read_header(file, lambda msg: AdapterError(f"adapter {name}: {msg}"))
    with open(file, "rb") as fh:
        return {key: _read_tensor(fh, start, key, info, f"adapter {name}: {file}") for key, info in header.items()}


def _read_tensor(fh, base: int, key: str, info: dict, where: str) -> np.ndarray:
    """One tensor of a validated header (its range lies in the file and matches its shape)."""
    if info["dtype"] not in _STORAGE:
        raise AdapterError(f"{where}: tensor {key} is {info['dtype']}, not F32, F16 or BF16")
    storage, _width = _STORAGE[info["dtype"]]
    begin, end = info["data_offsets"]
    fh.seek(base + begin)
    raw = np.frombuffer(fh.read(end - begin), dtype=storage).reshape(info["shape"])
    if info["dtype"] == "BF16":
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return raw.astype(np.float32)


def _weights(tensors: dict[str, np.ndarray], config: dict, name: str) -> dict:
    """``{(layer, module): (A [in, r], B [r, out] * scaling)}`` of the file's tensors, every key checked against
    the config (targeted, ranks as configured)."""
    if not tensors:
        raise AdapterError(f"adapter {name}: {WEIGHTS_FILE} holds no tensors")
    parts: dict = {}
    stacks: dict[str, str] = {}
    for key, value in tensors.items():
        match = _KEY_RE.fullmatch(key)
        if match is None:
            raise AdapterError(f"adapter {name}: tensor {key} is not a lora_A/lora_B weight of a decoder layer's "
                               f"module (embedding, lm_head, bias, magnitude or saved-module tensors are refused)")
        stacks.setdefault(match["stack"], key)
        if len(stacks) > 1:
            raise AdapterError(f"adapter {name}: tensors {' and '.join(stacks.values())} adapt two different "
                               f"layer stacks")
        layer, module, part = int(match["layer"]), match["module"], match["part"]
        if (layer, module, part) in parts:
            raise AdapterError(f"adapter {name}: two lora_{part} tensors for {module} of layer {layer} "
                               f"(a file with several adapters): save one adapter per folder")
        parts[(layer, module, part)] = (key, value)
    weights = {}
    for (layer, module, part), (key, a) in sorted(parts.items()):
        if part == "A":
            if (layer, module, "B") not in parts:
                raise AdapterError(f"adapter {name}: {key} has no lora_B tensor")
            weights[(layer, module)] = _module_weights(key, a, parts[(layer, module, "B")][1], config, name)
        elif (layer, module, "A") not in parts:
            raise AdapterError(f"adapter {name}: {key} has no lora_A tensor")
    return weights


def _module_weights(key: str, a: np.ndarray, b: np.ndarray, config: dict, name: str):
    """``(A.T, B.T * scaling)`` of one module, its key checked against ``target_modules`` and its shapes against
    the configured rank."""
    module_key = _module_key(key)
    if not _targeted(config, module_key, name):
        raise AdapterError(f"adapter {name}: tensor {key} adapts {module_key}, which target_modules "
                           f"{config.get('target_modules')!r} does not name")
    r = _pattern_value(config.get("rank_pattern") or {}, module_key, config.get("r", 8), name)
    alpha = _pattern_value(config.get("alpha_pattern") or {}, module_key, config.get("lora_alpha", 8), name)
    if a.ndim != 2 or b.ndim != 2 or a.shape[0] != r or b.shape[1] != r:
        raise AdapterError(f"adapter {name}: {module_key} has lora_A {list(a.shape)} and lora_B {list(b.shape)}, "
                           f"not [r, in] and [out, r] with r = {r} as configured")
    scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    fan_in = np.ascontiguousarray(a.T, dtype=np.float32)
    fan_out = (b.T.astype(np.float64) * scaling).astype(np.float32)
    fan_in.setflags(write=False)
    fan_out.setflags(write=False)
    return fan_in, fan_out


def _module_key(key: str) -> str:
    """The module's name in the wrapped model (what PEFT matches ``target_modules`` and the patterns against)."""
    stem = re.sub(r"\.lora_[AB](?:\.[A-Za-z_][\w-]*)?\.weight$", "", key)
    return stem[len(PEFT_PREFIX):] if stem.startswith(PEFT_PREFIX) else stem


def _targeted(config: dict, key: str, name: str) -> bool:
    """Whether PEFT's ``target_modules``/``exclude_modules``/``layers_to_transform`` select module ``key``."""
    excluded = config.get("exclude_modules")
    if excluded and _names(excluded, key, name):
        return False
    targets = config.get("target_modules")
    if targets is None or (isinstance(targets, str) and targets.lower() == "all-linear"):
        return True
    if isinstance(targets, str):
        return _fullmatch(targets, key, name)
    if not _names(targets, key, name):
        return False
    wanted = config.get("layers_to_transform")
    if wanted is None or wanted == []:
        return True
    wanted = [wanted] if isinstance(wanted, int) else wanted
    match = _KEY_RE.fullmatch(key + ".lora_A.weight")
    return match is not None and int(match["layer"]) in wanted


def _names(patterns, key: str, name: str) -> bool:
    """PEFT's list-or-regex rule: a string is a regex matched on the whole key, a list names modules by suffix."""
    if isinstance(patterns, str):
        return _fullmatch(patterns, key, name)
    return key in patterns or any(key.endswith(f".{p}") for p in patterns)


def _fullmatch(pattern: str, key: str, name: str) -> bool:
    try:
        return re.fullmatch(pattern, key) is not None
    except re.error as exc:
        raise AdapterError(f"adapter {name}: {pattern!r} is not a regular expression ({exc})") from None


def _pattern_value(pattern: dict, key: str, default, name: str):
    """PEFT's ``get_pattern_key``: the first pattern (in the config's order) that ends module ``key`` at a dot."""
    for raw, value in pattern.items():
        try:
            hit = re.match(rf"(.*\.)?({raw})$", key)
        except re.error as exc:
            raise AdapterError(f"adapter {name}: pattern {raw!r} is not a regular expression ({exc})") from None
        if hit:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise AdapterError(f"adapter {name}: pattern {raw!r} has value {value!r}, not a positive number")
            return value
    return default


# ------------------------------------------------------------------------------------------------ the graph
def fit(adapter: Adapter, geometry: LoraGeometry, base_name: str | None = None) -> None:
    """Raise :class:`~qeff_kv.errors.AdapterError` (one line) when ``adapter`` does not fit a graph of
    ``geometry`` (exported from the model ``base_name``, when given)."""
    who = f"adapter {adapter.name}"
    if base_name and adapter.base_model and _last_part(base_name) != _last_part(adapter.base_model):
        raise AdapterError(f"{who} was trained on {adapter.base_model}, not on the graph's model {base_name}")
    graph_modules = geometry.module_names
    unknown = [m for m in adapter.modules if m not in graph_modules]
    if unknown:
        raise AdapterError(f"{who} adapts {unknown[0]}, which the graph does not adapt (the graph adapts "
                           f"{', '.join(graph_modules)})")
    if adapter.layers[-1] >= geometry.num_layers:
        raise AdapterError(f"{who} adapts layer {adapter.layers[-1]}, but the graph's adapted layers end at "
                           f"{geometry.num_layers - 1}")
    if geometry.max_rank is not None and adapter.rank > geometry.max_rank:
        raise AdapterError(f"{who} has rank {adapter.rank}, more than the graph's max_rank {geometry.max_rank} "
                           f"(export with a larger --max-lora-rank)")
    for (layer, module), (a, b) in sorted(adapter.weights.items()):
        target = geometry.get(layer, module)
        if target is None:
            raise AdapterError(f"{who} adapts {module} of layer {layer}, which the graph does not adapt")
        if (a.shape[0], b.shape[1]) != (target.in_features, target.out_features):
            raise AdapterError(f"{who}: hidden sizes do not match: {module} of layer {layer} maps {a.shape[0]} -> "
                               f"{b.shape[1]} features in the adapter, {target.in_features} -> "
                               f"{target.out_features} in the graph")


def _last_part(name: str) -> str:
    return re.split(r"[\\/]", name.rstrip("/\\"))[-1].lower()


def stack(adapters: Sequence[Adapter], geometry: LoraGeometry, rank: int | None = None) -> dict[str, np.ndarray]:
    """The graph's ``lora_A.*``/``lora_B.*`` inputs for slots ``[zero adapter, adapters[0], adapters[1], ...]``,
    in the graph's float type, rank axis ``rank`` (else the graph's ``max_rank``, else the largest adapter rank, at
    least 1). Every adapter is checked with :func:`fit`; a module an adapter leaves alone stays zero in its slot."""
    adapters = list(adapters)
    dtype = _float_type(geometry.dtype)
    for adapter in adapters:
        fit(adapter, geometry)
    width = _rank_axis(adapters, geometry, rank)
    slots = 1 + len(adapters)
    out: dict[str, np.ndarray] = {}
    for m in geometry.modules:
        out[m.a_name] = np.zeros((slots, m.in_features, width), dtype)
        out[m.b_name] = np.zeros((slots, width, m.out_features), dtype)
    for slot, adapter in enumerate(adapters, start=1):
        for (layer, module), (a, b) in adapter.weights.items():
            target = geometry.get(layer, module)
            r = a.shape[1]
            out[target.a_name][slot, :, :r] = a
            out[target.b_name][slot, :r, :] = b
            if dtype == np.float16 and not (np.isfinite(out[target.a_name][slot]).all()
                                            and np.isfinite(out[target.b_name][slot]).all()):
                raise AdapterError(f"adapter {adapter.name}: {module} of layer {layer} overflows float16")
    return out


def _float_type(dtype: str) -> np.dtype:
    try:
        kind = np.dtype(dtype)
    except TypeError:
        kind = None
    if kind not in (np.dtype(np.float32), np.dtype(np.float16)):
        raise AdapterError(f"the graph's LoRA weights are {dtype}, not float32 or float16")
    return kind


def _rank_axis(adapters: Iterable[Adapter], geometry: LoraGeometry, rank: int | None) -> int:
    largest = max((a.rank for a in adapters), default=0)
    if rank is None:
        return geometry.max_rank or max(largest, 1)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"the LoRA rank axis must be a positive integer, not {rank!r}")
    if geometry.max_rank is not None and rank > geometry.max_rank:
        raise AdapterError(f"rank axis {rank} is more than the graph's max_rank {geometry.max_rank}")
    if rank < largest:
        raise AdapterError(f"rank axis {rank} is less than the largest adapter rank {largest}")
    return rank


def summary(adapter: Adapter) -> dict:
    """The adapter's description for manifests and ``/v1/models`` (JSON values)."""
    return {"name": adapter.name, "path": str(adapter.path), "rank": adapter.rank, "alpha": adapter.alpha,
            "rslora": adapter.rslora, "modules": list(adapter.modules), "bytes": adapter.nbytes,
            "base_model": adapter.base_model}
