"""Which files make a model (an ``.onnx`` file or an export folder with its manifest), and the identities a
state file is checked against: the KV contract (names, dtypes, heads, head sizes) and the model, either its
checkpoint identity (recorded at export) or, for graphs without one, a sampled fingerprint of the weights.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx_ir as ir

from qeff_kv.support import fsutil
from qeff_kv.contract import naming
from qeff_kv.errors import GraphReadError, RuntimeInputError
from qeff_kv.contract.layout import KVLayout

MANIFEST = "manifest.json"
#: ``metadata_props`` key under which an export records its checkpoint identity (``qeff_kv.export.checkpoint``).
CHECKPOINT_METADATA_KEY = naming.CHECKPOINT_META
#: A checkpoint identity: ``<SHA-256 of the source weights>:<dtype the graph computes in>``.
_CHECKPOINT_RE = re.compile(r"^[0-9a-f]{64}:[a-z0-9]+$")


# ============================================================================================ model files
@dataclass
class ModelFiles:
    """Where a model's files are: the graph, its export manifest (if any) and its folder."""

    onnx_path: Path
    folder: Path
    manifest: dict | None = None

    @property
    def source_name(self) -> str | None:
        """The model the graph was exported from (the manifest's ``source``, its last path component), else None."""
        source = (self.manifest or {}).get("source")
        return None if not isinstance(source, str) else source.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1]

    @property
    def tokenizer_path(self) -> Path | None:
        p = self.folder / "tokenizer.json"
        return p if p.is_file() else None


def resolve_model(model: str | os.PathLike) -> ModelFiles:
    """An ``.onnx`` file, or an export folder with ``manifest.json`` (or exactly one ``.onnx`` file)."""
    if not isinstance(model, (str, os.PathLike)):
        raise RuntimeInputError(f"model must be a path to an .onnx file or an export folder, got "
                                f"{type(model).__name__}")
    path = Path(model)
    if not path.exists():
        raise GraphReadError(f"{path}: no such file or folder")
    if path.is_dir():
        man_path = path / MANIFEST
        manifest = None
        if man_path.is_file():
            manifest = fsutil.read_json_object(man_path, GraphReadError)
        if manifest is not None and manifest.get("onnx"):
            onnx_path = path / str(manifest["onnx"])
            if not onnx_path.is_file():
                raise GraphReadError(f"{man_path}: names {manifest['onnx']!r}, which is not in {path}")
        else:
            found = sorted(path.glob("*.onnx"))
            if len(found) != 1:
                raise GraphReadError(
                    f"{path}: expected an export folder with {MANIFEST} or exactly one .onnx file, "
                    f"found {len(found)} .onnx files")
            onnx_path = found[0]
        return ModelFiles(onnx_path, path, manifest)
    manifest = None
    man_path = path.parent / MANIFEST
    if man_path.is_file():
        try:
            data = json.loads(man_path.read_text(encoding="utf-8"))
            if isinstance(data, dict) and data.get("onnx") == path.name:
                manifest = data
        except (OSError, ValueError):
            manifest = None
    return ModelFiles(path, path.parent, manifest)


# ============================================================================================ fingerprints
def kv_contract(layout: KVLayout) -> dict:
    """What a state file must agree on: buffer names (prefix included), dtypes, heads and head_dim; a recurrent
    state's whole shape after the batch axis (it has no position axis)."""
    pairs = []
    for p in layout.pairs:
        shape = p.view_shape(p.input.shape) or ()   # a static cache's packed buffer as [batch, 1, positions, h*d]
        entry = {
            "input": p.input_name, "retained": p.output_name, "dtype": p.input.dtype,
            "heads": shape[1] if len(shape) == 4 else None, "head_dim": shape[3] if len(shape) == 4 else None,
        }
        if p.recurrent:   # only these: every other graph's fingerprint stays what it was
            entry["state_shape"] = list(shape[1:])
        pairs.append(entry)
    return {"prefix": layout.prefix, "num_layers": layout.num_layers, "pairs": pairs}


def kv_fingerprint(layout: KVLayout) -> str:
    blob = json.dumps(kv_contract(layout), sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()


def model_fingerprint(model: ir.Model, sample_bytes: int = 64, min_elements: int = 1024) -> str:
    """A cheap identity of the *weights*: for every initializer of at least ``min_elements`` elements, its
    dtype, shape and ``sample_bytes`` bytes from its start, middle and end (external data is memory-mapped,
    never read in full), hashed as a sorted multiset.

    Names and graph structure do not enter, so two graphs of the same checkpoint (with and without
    continuous batching, or from two exporters) accept each other's state files, and graphs of different
    checkpoints do not.
    """
    items = []
    for v in model.graph.initializers.values():
        t = v.const_value
        if t is None or t.size < min_elements:
            continue
        try:
            arr = np.asarray(t.numpy()).reshape(-1)
        except Exception:  # pragma: no cover - exotic tensor types
            continue
        k = max(1, sample_bytes // max(1, arr.itemsize))
        mid = arr.size // 2
        h = hashlib.sha256(f"{arr.dtype.str}:{tuple(t.shape)}".encode())
        for part in (arr[:k], arr[mid:mid + k], arr[-k:]):
            h.update(np.ascontiguousarray(part).tobytes())
        items.append(h.hexdigest())
    return hashlib.sha256("".join(sorted(items)).encode()).hexdigest()


def checkpoint_identity(model: ir.Model, manifest: dict | None) -> str | None:
    """The checkpoint identity the export recorded: the graph's ``qeff_kv.checkpoint`` metadata (it travels with a
    bare ``.onnx``), else the manifest's ``checkpoint.identity``; ``None`` when neither holds a well-formed one
    (graphs of other exporters, exports made before identities were recorded)."""
    value = model.metadata_props.get(CHECKPOINT_METADATA_KEY)
    if is_checkpoint_identity(value):
        return value
    record = (manifest or {}).get("checkpoint")
    value = record.get("identity") if isinstance(record, dict) else None
    return value if is_checkpoint_identity(value) else None


def is_checkpoint_identity(value) -> bool:
    """Whether ``value`` is a well-formed checkpoint identity (anything else counts as absent)."""
    return isinstance(value, str) and bool(_CHECKPOINT_RE.match(value))
