"""Reading and writing ONNX graphs with onnx_ir, without loading external weights into memory.

* :func:`load` refuses a missing, non-ONNX or truncated file and unsafe external-data locations (absolute,
  or escaping the model's folder through ``..``), with one-line typed errors.
* :func:`save` writes the graph atomically; external tensors keep pointing at their data files, which are
  linked or copied beside the new graph when it goes to another folder (never a silently broken reference).
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath, PureWindowsPath

import onnx
import onnx_ir as ir

from qeff_kv.support import fsutil
from qeff_kv.graph import madeup_dims
from qeff_kv.errors import ExternalDataError, GraphReadError
from qeff_kv.contract import naming
from qeff_kv.contract.layout import KVLayout, TensorInfo, dtype_from_onnx

#: Highest IR version the supported onnxruntime (1.31) loads.
MAX_ORT_IR_VERSION = 10


def _check_location(location: str, model_dir: Path, tensor: str) -> Path:
    if not location:
        raise ExternalDataError(f"initializer {tensor!r} has external data with an empty location")
    if os.path.isabs(location) or PureWindowsPath(location).is_absolute() or location.startswith(("/", "\\")):
        raise ExternalDataError(
            f"initializer {tensor!r} has an absolute external-data location {location!r}; "
            "locations must be relative to the model's folder")
    parts = PurePosixPath(location.replace("\\", "/")).parts
    if ".." in parts:
        raise ExternalDataError(
            f"initializer {tensor!r} has external-data location {location!r} that escapes the model's folder")
    path = (model_dir / location).resolve()
    root = model_dir.resolve()
    if root != path and root not in path.parents:
        raise ExternalDataError(
            f"initializer {tensor!r} has external-data location {location!r} that resolves outside the "
            "model's folder")
    return path


def external_tensors(model: ir.Model) -> list[ir.ExternalTensor]:
    """Every external tensor of the model (graph and subgraph initializers, constant attributes)."""
    out: list[ir.ExternalTensor] = []
    for graph in _all_graphs(model):
        for v in graph.initializers.values():
            if isinstance(v.const_value, ir.ExternalTensor):
                out.append(v.const_value)
        for node in graph:
            for attr in node.attributes.values():
                if attr.type == ir.AttributeType.TENSOR and isinstance(attr.value, ir.ExternalTensor):
                    out.append(attr.value)
    return out


def _all_graphs(model: ir.Model):
    yield from model.graphs()
    for fn in model.functions.values():
        # Function bodies hold no initializers but may hold Constant nodes with tensors.
        yield fn.graph


def load(path: str | os.PathLike) -> ir.Model:
    """Load an ONNX model for rewriting or inspection; external data stays on disk (memory-mapped lazily)."""
    path = Path(path)
    if not path.exists():
        raise GraphReadError(f"{path}: no such file")
    if path.is_dir():
        raise GraphReadError(f"{path}: is a folder, not an .onnx file")
    if not path.is_file():  # a FIFO or a device would block the read, or never end
        raise GraphReadError(f"{path}: not a regular file (a FIFO, device or socket), not an .onnx file")
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # protobuf DecodeError and friends
        raise GraphReadError(f"{path}: not an ONNX model or truncated ({type(exc).__name__}: {exc})") from None
    if not proto.HasField("graph") or (len(proto.graph.node) == 0 and len(proto.graph.output) == 0):
        raise GraphReadError(f"{path}: not an ONNX model or truncated (no graph)")
    if not proto.opset_import:
        raise GraphReadError(f"{path}: not an ONNX model or truncated (no opset import)")
    try:
        model = ir.serde.deserialize_model(proto)
    except Exception as exc:
        raise GraphReadError(f"{path}: cannot be read as ONNX ({type(exc).__name__}: {exc})") from None
    del proto
    model_dir = path.parent
    sizes: dict[Path, int] = {}
    for t in external_tensors(model):
        data_path = _check_location(str(t.location), model_dir, t.name or "?")
        if data_path not in sizes:
            if not data_path.is_file():
                raise ExternalDataError(
                    f"initializer {t.name!r}: external-data file {t.location!r} not found beside {path.name}")
            sizes[data_path] = data_path.stat().st_size
        end = (t.offset or 0) + (t.length if t.length is not None else t.nbytes)
        if end > sizes[data_path]:
            raise GraphReadError(
                f"{path}: initializer {t.name!r} needs bytes up to {end} of {t.location!r}, which has only "
                f"{sizes[data_path]} (truncated external data)")
    ir.external_data.set_base_dir(model.graph, model_dir)
    model.meta[naming.SOURCE_PATH_META] = str(path)
    return model


def io_of(model: ir.Model) -> tuple[list[TensorInfo], list[TensorInfo]]:
    """The graph's inputs and outputs as :class:`TensorInfo` (initializers listed as inputs excluded)."""
    return ([_info(v) for v in model.graph.inputs if not v.is_initializer()],
            [_info(v) for v in model.graph.outputs])


def _info(v: ir.Value) -> TensorInfo:
    dtype = dtype_from_onnx(v.dtype.value) if v.dtype is not None else "unknown"
    shape = None
    if v.shape is not None:
        dims: list[int | str | None] = []
        for d in v.shape:
            if isinstance(d, int):
                dims.append(d)
            else:
                dims.append(d.value if isinstance(d, ir.SymbolicDim) else None)
        shape = tuple(dims)
    return TensorInfo(v.name or "", dtype, shape)


def metadata_of(model: ir.Model) -> dict[str, str]:
    """The model's ``metadata_props`` (``qeff_kv.sliding_window``...) as a plain dict."""
    return {str(k): str(v) for k, v in model.metadata_props.items()}


def layout_of(model: ir.Model) -> KVLayout:
    """The KV layout of ``model``, with its graph metadata (the sliding window ``W`` of ring buffers). Symbolic dims
    an exporter made up on retained outputs are matched to the inputs (:mod:`qeff_kv.graph.madeup_dims`); the axes it
    could not match are in ``layout.made_up``."""
    ins, outs = io_of(model)
    outs, made_up = madeup_dims.resolve(model, ins, outs)
    layout = KVLayout.from_io(ins, outs, metadata_of(model))
    layout.made_up = made_up
    return layout


def save(model: ir.Model, path: str | os.PathLike, *, source_dir: str | os.PathLike | None = None) -> Path:
    """Write ``model`` to ``path`` atomically, keeping external data reachable from the new file.

    ``source_dir`` is the folder the model was read from. When ``path`` is in that folder, external tensors
    keep their locations. Otherwise every referenced data file is cloned (reflink) or copied to the same
    relative location beside the new file before the graph file is renamed into place (never hard-linked:
    onnx refuses external data with several links).
    """
    path = Path(path)
    fsutil.make_dirs(path.parent)
    fsutil.check_output_file(path)  # a folder, FIFO or device node is never replaced
    externals = external_tensors(model)
    if externals:
        if source_dir is None:
            src = model.meta.get(naming.SOURCE_PATH_META)
            source_dir = Path(src).parent if src else path.parent
        source_dir = Path(source_dir).resolve()
        dest_dir = path.parent.resolve()
        if source_dir != dest_dir:
            for location in sorted({str(t.location) for t in externals}):
                src_file = _check_location(location, source_dir, "?")
                dst_file = _check_location(location, dest_dir, "?")
                if dst_file.exists() and (_same_file(src_file, dst_file) or same_content(src_file, dst_file)):
                    continue
                if dst_file.exists():
                    raise ExternalDataError(
                        f"{dst_file} already exists and is not the external data of the input model; "
                        "refusing to overwrite it (choose another output folder)")
                fsutil.make_dirs(dst_file.parent)
                # A copy (reflink where the file system can), never a hard link: onnx refuses to load external
                # data files with several links, which would break the new model and the original.
                fsutil.clone_or_copy(src_file, dst_file)
    model.meta.pop(naming.SOURCE_PATH_META, None)
    proto = ir.serde.serialize_model(model)
    fsutil.write_bytes(path, proto.SerializeToString(deterministic=True))
    return path


def same_content(a: Path, b: Path, chunk: int = 16 << 20) -> bool:
    """Same size and bytes (streamed, constant memory): a copy placed by an earlier save."""
    try:
        if a.stat().st_size != b.stat().st_size:
            return False
        with open(a, "rb") as fa, open(b, "rb") as fb:
            while True:
                x, y = fa.read(chunk), fb.read(chunk)
                if x != y:
                    return False
                if not x:
                    return True
    except OSError:
        return False


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False
