"""The executor seam: what runs a graph given its bound inputs and outputs, for a
:class:`~qeff_kv.runtime.session.Session`.

An executor has IOBinding's shape, so the session (and :mod:`.media`) binds through it as through onnxruntime's
``IOBinding``: ``bind_ortvalue_input``, ``bind_ortvalue_output``, ``bind_output(name, "cpu")`` (an output the
executor allocates), ``get_outputs()`` (in the order first bound) and ``run()``. Every value the session binds is
an ``OrtValue`` allocated once on the session's device (:mod:`.device`): the KV and recurrent state,
bound as both an input and its retained output, so a step writes the state where it is; the small inputs and the
logits, which the session fills and reads without touching the state.

* :class:`OrtExecutor`: an onnxruntime ``InferenceSession`` with its ``IOBinding`` (what a session on the CPU
  runs: each input bound once, when its buffer changes);
* :class:`RebindingExecutor`: the same, binding every input again before each run, for an EP that copies a bound
  host input to its own device at bind time (CUDA: :func:`.device.staged`, whose ``rebind_each_run`` picks it);
* :class:`ReferenceExecutor`: onnx's own reference evaluator (``onnx.reference``: the ONNX spec's semantics) over
  the graph as written, unpatched, and *strict*: every index a ``Gather``/``GatherND``/``GatherElements``/
  ``ScatterND``/``ScatterElements`` node meets must be inside the spec's range, and a scatter without reduction
  must not repeat an index (the spec leaves both to each EP); every index feed (``position_ids``, ``batch_index``)
  is checked too. It is slow: tiny graphs only, for the conformance proof (``tests/runtime/test_ep_conformance.py``).

Which execution provider is allowed at all is :mod:`.ep_proofs`'s; :func:`open_executor` asks it.
"""

from __future__ import annotations

import gc
import os
from typing import Sequence as Seq

import numpy as np
import onnxruntime as ort

from qeff_kv.support import capture
from qeff_kv.errors import ContractError, GraphReadError, RuntimeInputError
from qeff_kv.runtime.execution import device as device_mod
from qeff_kv.runtime.execution import ep_proofs

_ORT_QUIET = False


def quiet_onnxruntime() -> None:
    """onnxruntime's default logger at :func:`~qeff_kv.support.capture.onnxruntime_log_severity` (fatal, unless
    ``--debug``): its warnings and error lines never print above our one-line errors."""
    global _ORT_QUIET
    if not _ORT_QUIET:
        ort.set_default_logger_severity(capture.onnxruntime_log_severity())
        _ORT_QUIET = True


class Executor:
    """Runs one graph over bound ``OrtValue`` objects (see the module docstring)."""

    def bind_ortvalue_input(self, name: str, value: ort.OrtValue) -> None:
        raise NotImplementedError

    def bind_ortvalue_output(self, name: str, value: ort.OrtValue) -> None:
        raise NotImplementedError

    def bind_output(self, name: str, device: str = "cpu") -> None:
        raise NotImplementedError

    def get_outputs(self) -> list[ort.OrtValue]:
        raise NotImplementedError

    def run(self) -> None:
        raise NotImplementedError


class OrtExecutor(Executor):
    """An onnxruntime ``InferenceSession`` and its ``IOBinding``."""

    def __init__(self, sess: ort.InferenceSession):
        self.sess = sess
        self._io = sess.io_binding()
        self.bind_ortvalue_input = self._io.bind_ortvalue_input
        self.bind_ortvalue_output = self._io.bind_ortvalue_output
        self.bind_output = self._io.bind_output
        self.get_outputs = self._io.get_outputs
        self.clear_binding_outputs = self._io.clear_binding_outputs   # every output unbound (runtime/embeddings.py)

    def run(self) -> None:
        self.sess.run_with_iobinding(self._io)


class RebindingExecutor(OrtExecutor):
    """An :class:`OrtExecutor` that binds every input again before each run, so that the EP gets the host
    buffers' current bytes: onnxruntime copies a host input to another device when it is bound, not when it runs
    (:mod:`.device`). Outputs bound to host buffers are copied back by onnxruntime after each run."""

    def __init__(self, sess: ort.InferenceSession):
        super().__init__(sess)
        self.inputs: dict[str, ort.OrtValue] = {}   # each input's value as last bound
        self.bind_ortvalue_input = self._bind_input

    def _bind_input(self, name: str, value: ort.OrtValue) -> None:
        self.inputs[name] = value
        self._io.bind_ortvalue_input(name, value)

    def run(self) -> None:
        for name, value in self.inputs.items():
            self._io.bind_ortvalue_input(name, value)
        self.sess.run_with_iobinding(self._io)


def open_onnxruntime(source: bytes | str, label: str, *, threads: int | None, providers: Seq[str],
                     external_folder: str | None = None) -> ort.InferenceSession:
    """An onnxruntime session over ``source`` on ``providers`` (already proved: :mod:`.ep_proofs`); its load
    failure is one line naming ``label``, and so is an EP onnxruntime did not start (it would fall back to the
    CPU without a word). For CUDA, the CUDA/cuDNN libraries of the machine's pip wheels (torch's) are loaded
    first where onnxruntime can (``preload_dlls``)."""
    _preload_cuda(providers)
    so = ort.SessionOptions()
    if threads:
        so.intra_op_num_threads = int(threads)
    # Errors are ours to report, in one line: onnxruntime's own log lines (a node failing at run time) stay quiet.
    so.log_severity_level = capture.onnxruntime_log_severity()
    quiet_onnxruntime()
    if external_folder is not None:
        so.add_session_config_entry("session.model_external_initializers_file_folder_path", external_folder)
    gc.collect()
    try:
        with capture.library_output():   # onnxruntime's own log lines stay out of the terminal
            sess = ort.InferenceSession(source, so, providers=list(providers))
    except Exception as exc:  # onnxruntime raises several pybind exception types
        msg = " ".join(str(exc).split())[:400]
        raise GraphReadError(f"{label}: onnxruntime cannot load it ({msg})") from None
    started = sess.get_providers()
    if providers[0] not in started:
        raise RuntimeInputError(f"{label}: onnxruntime could not start {providers[0]} (it would run on "
                                f"{', '.join(started)}); its libraries (CUDA, cuDNN) may be missing")
    return sess


_PRELOADED = False


def _preload_cuda(providers: Seq[str]) -> None:
    global _PRELOADED
    if _PRELOADED or providers[0] != ep_proofs.CUDA or not hasattr(ort, "preload_dlls"):
        return
    _PRELOADED = True
    with capture.library_output():   # it prints what it cannot find; a session that fails to start says so
        try:
            ort.preload_dlls()
        except Exception:  # noqa: BLE001  (best effort: the check after loading is the proof)
            pass


def open_executor(kind: str, source: bytes | str, path, *, external: bool, threads: int | None,
                  providers: Seq[str], index_limits: dict[str, int]) -> tuple[Executor, ort.InferenceSession | None]:
    """The executor of a session (``kind``: ``"onnxruntime"`` or ``"reference"``) over ``source`` (the graph at
    ``path``, or its patched bytes), and the onnxruntime session under it (``None`` for the reference): a
    :class:`RebindingExecutor` where the providers' device (:func:`.device.for_providers`, the session's own)
    asks for ``rebind_each_run``, else an :class:`OrtExecutor`."""
    if kind == "reference":
        return ReferenceExecutor(path, index_limits), None
    folder = str(path.parent.resolve()) if external else None
    sess = open_onnxruntime(source, str(path), threads=threads, providers=providers, external_folder=folder)
    rebind = device_mod.for_providers(list(providers)).rebind_each_run
    return (RebindingExecutor(sess) if rebind else OrtExecutor(sess)), sess


# ============================================================================================ the reference
def _strict_ops() -> list:
    """onnx reference implementations of the indexing ops that refuse what the spec leaves undefined."""
    from onnx.reference.ops.op_gather import Gather as _Gather
    from onnx.reference.ops.op_gather_elements import GatherElements as _GatherElements
    from onnx.reference.ops.op_gathernd import GatherND as _GatherND
    from onnx.reference.ops.op_scatter_elements import ScatterElements as _ScatterElements
    from onnx.reference.ops.op_scatternd import ScatterND as _ScatterND

    class Gather(_Gather):
        def _run(self, x, indices, axis=None):
            _in_range("Gather", indices, x.shape[axis or 0])
            return super()._run(x, indices, axis=axis)

    class GatherElements(_GatherElements):
        def _run(self, data, indices, axis=None):
            _in_range("GatherElements", indices, data.shape[axis or 0])
            return super()._run(data, indices, axis=axis)

    class GatherND(_GatherND):
        def _run(self, data, indices, batch_dims=None):
            _nd_rows("GatherND", data, indices, batch_dims or 0, unique=False)
            return super()._run(data, indices, batch_dims=batch_dims)

    class ScatterND(_ScatterND):
        def _run(self, data, indices, updates, reduction=None):
            _nd_rows("ScatterND", data, indices, 0, unique=reduction in (None, "none"))
            return super()._run(data, indices, updates, reduction=reduction)

    class ScatterElements(_ScatterElements):
        def _run(self, data, indices, updates, axis=None, reduction=None):
            ax = (axis or 0) % data.ndim
            _in_range("ScatterElements", indices, data.shape[ax])
            if reduction in (None, "none"):
                full = np.indices(indices.shape).copy()
                full[ax] = np.where(indices < 0, indices + data.shape[ax], indices)
                _unique("ScatterElements", full.reshape(indices.ndim, -1).T)
            return super()._run(data, indices, updates, axis=axis, reduction=reduction)

    return [Gather, GatherElements, GatherND, ScatterND, ScatterElements]


def _strict_evaluator(model):
    """onnx's reference evaluator over ``model`` with :func:`_strict_ops`, in its functions too (onnx builds a
    function's evaluator with the evaluator's own class, without its ``new_ops``)."""
    from onnx.reference import ReferenceEvaluator

    ops = _strict_ops()

    class StrictEvaluator(ReferenceEvaluator):
        def __init__(self, proto, *args, **kwargs):
            kwargs["new_ops"] = ops
            super().__init__(proto, *args, **kwargs)

    return StrictEvaluator(model)


def _in_range(op: str, indices: np.ndarray, size: int) -> None:
    if indices.size and (indices.min() < -size or indices.max() >= size):
        bad = indices[(indices < -size) | (indices >= size)].flat[0]
        raise ContractError(f"{op}: index {int(bad)} is outside [-{size}, {size - 1}] (undefined by the ONNX spec)")


def _nd_rows(op: str, data: np.ndarray, indices: np.ndarray, batch_dims: int, *, unique: bool) -> None:
    """``indices [..., k]`` into ``data``'s axes ``batch_dims .. batch_dims + k``: each in range, distinct rows
    (with the batch position) when ``unique``."""
    k = indices.shape[-1]
    rows = indices.reshape(-1, k).astype(np.int64)
    for j in range(k):
        size = data.shape[batch_dims + j]
        _in_range(op, rows[:, j], size)
        rows[:, j] %= size
    if unique:
        batch = np.repeat(np.arange(int(np.prod(indices.shape[:batch_dims], dtype=np.int64))),
                          rows.shape[0] // max(1, int(np.prod(indices.shape[:batch_dims], dtype=np.int64))))
        _unique(op, np.column_stack([batch, rows]))


def _unique(op: str, rows: np.ndarray) -> None:
    if len(np.unique(rows, axis=0)) != len(rows):
        raise ContractError(f"{op}: an index is written twice in one scatter (its order is undefined by the ONNX "
                            "spec)")


class ReferenceExecutor(Executor):
    """The graph at ``path`` run by onnx's reference evaluator with strict indexing (module docstring);
    ``index_limits``: an index feed's name -> the exclusive upper bound of its values (``position_ids`` may also
    be ``-1``, padding)."""

    def __init__(self, path: str | os.PathLike, index_limits: dict[str, int]):
        import onnx

        model = onnx.load(str(path))
        try:
            self.evaluator = _strict_evaluator(model)
        except (NotImplementedError, RuntimeError) as exc:   # an op outside the spec's operator sets
            custom = sorted({f"{n.domain}.{n.op_type}" for n in model.graph.node if n.domain not in ("", "ai.onnx")})
            raise ContractError(f"{path}: onnx's reference evaluator cannot run it (custom ops: "
                                f"{', '.join(custom) or 'none'}; {' '.join(str(exc).split())[:160]})") from None
        self.output_names = [o.name for o in model.graph.output]
        self.index_limits = dict(index_limits)
        self.inputs: dict[str, ort.OrtValue] = {}
        self.outputs: dict[str, ort.OrtValue | None] = {}
        self.runs = 0

    def bind_ortvalue_input(self, name: str, value: ort.OrtValue) -> None:
        self.inputs[name] = value

    def bind_ortvalue_output(self, name: str, value: ort.OrtValue) -> None:
        self.outputs[name] = value

    def bind_output(self, name: str, device: str = "cpu") -> None:
        self.outputs[name] = None

    def get_outputs(self) -> list[ort.OrtValue]:
        return [v for v in self.outputs.values()]

    def run(self) -> None:
        feeds = {n: v.numpy() for n, v in self.inputs.items()}
        self._check_feeds(feeds)
        try:
            results = dict(zip(self.output_names, self.evaluator.run(None, feeds)))
        except ContractError:
            raise
        except Exception as exc:   # numpy's errors inside an op
            raise ContractError(f"onnx's reference evaluator failed: {' '.join(str(exc).split())[:300]}") from None
        for name, value in self.outputs.items():   # every result computed before any buffer is written
            out = np.asarray(results[name])
            if value is None:
                self.outputs[name] = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(out))
                continue
            target = value.numpy()
            if target.shape != out.shape:
                raise ContractError(f"{name}: the graph returns shape {list(out.shape)}; the bound buffer is "
                                    f"{list(target.shape)}")
            np.copyto(target, out)
        self.runs += 1

    def _check_feeds(self, feeds: dict[str, np.ndarray]) -> None:
        """Every index feed inside its range; ``batch_index`` rows distinct (each a sequence's own slot)."""
        for name, limit in self.index_limits.items():
            a = feeds.get(name)
            if a is None:
                continue
            if name == "position_ids" and a.ndim == 3:
                a = a[0]   # multimodal RoPE: row 0 is the text position (the cache slot); rows 1-3 are RoPE's
            low = -1 if name == "position_ids" else 0
            if a.size and (a.min() < low or a.max() >= limit):
                raise ContractError(f"{name} holds {int(a.min())}..{int(a.max())}; the graph takes [{low}, {limit})")
            if name == "batch_index" and len(np.unique(a)) != a.size:
                raise ContractError(f"batch_index repeats a slot: {a.ravel().tolist()}")
