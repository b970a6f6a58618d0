"""What a :class:`~qeff_kv.runtime.session.Session` binds and runs: its :class:`GraphBinding` (``session.binding``).

The binding owns the executor (:mod:`.executor`: onnxruntime's ``IOBinding`` or the reference evaluator) and every
value bound to it, and runs the graph:

* the KV buffers of ``session.cache``, bound once as each input ``X`` and its output ``X_RetainedState`` (in place,
  or to the spare set of a graph that is not in-place safe, rebound after every swap), or as row views of them
  (lock step: :class:`~qeff_kv.runtime.execution.row_views.RowViews`, :meth:`GraphBinding.use_kv`);
* the small inputs (``input_ids``, ``position_ids``, the batching strategy's step inputs, ``num_logits_to_keep``)
  and ``logits``: buffers of their own made once per step shape ``(rows, seq_len, keep)`` on the session's device,
  bound when the shape changes (:meth:`GraphBinding.bind_small`);
* a CCL graph's ``comp_ctx_lengths`` at the smallest length a step needs (:meth:`GraphBinding.run`).

It serves one session and reads what the graph is from it (``session.graph``, ``session.cache``, ``session.media``,
``session.ccl``, ``session.device``) as the session is now: a test that makes the session describe its graph as
another kind (``session.speculative = True``) is read at the next step. Other runtime modules that run steps of
their own (:mod:`qeff_kv.runtime.decoding.speculative`, :mod:`~qeff_kv.runtime.decoding.prompt_rows`,
:mod:`qeff_kv.runtime.embeddings`) bind and run through it.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from qeff_kv.contract import naming
from qeff_kv.errors import ContractError, QeffKvError, RuntimeInputError
from qeff_kv.runtime import ccl as ccl_mod
from qeff_kv.runtime.execution.adapter_feeds import AdapterFeeds
from qeff_kv.runtime.execution.growing import GrowingKV
from qeff_kv.runtime.execution.row_views import RowViews

#: a step's shape: (rows, seq_len, logits rows kept)
StepShape = tuple[int, int, int]


def position_shape(mrope: bool, rows: int, seq_len: int) -> tuple[int, ...]:
    """The shape of ``position_ids``: ``[4, rows, seq_len]`` with multimodal RoPE
    (:mod:`qeff_kv.runtime.multimodal.positions`), else ``[rows, seq_len]``."""
    return (4, rows, seq_len) if mrope else (rows, seq_len)


class GraphBinding:
    """The executor of ``session`` and the values bound to it (see the module docstring).

    Args:
        session: the session served (its cache is allocated, its description resolved).
        io: the executor (IOBinding's shape: :class:`~qeff_kv.runtime.execution.executor.Executor`).
        executor_session: what ``io`` runs (onnxruntime's ``InferenceSession``, or the reference evaluator).
    """

    def __init__(self, session, io, executor_session):
        self.session = session
        self.io = io
        self.executor_session = executor_session
        #: batch-1 row views of the cache's buffers (lock step), made on first use
        self.rows = RowViews(session.cache.positional.arrays, session.device, session.cache.positional.graph_view)
        #: the KV dialect's control inputs (write_indices, nonpad_kv_seqlen, attention_mask), fed on every run
        self.feeds = session.graph.feeds.with_device(session.device)
        #: each KV input's output (the pair's, in the graph's dialect)
        self.outputs = {p.input_name: p.output_name for p in session.layout.pairs}
        #: a growing past/present graph's feeding from the fixed buffers (:mod:`.growing`), else None
        self.growing = (GrowingKV(session.cache.positional.arrays, self.outputs, session.device)
                        if session.graph.grows else None)
        #: the small inputs of each step shape, as numpy arrays (what a step writes) and as their bound values
        self.small: dict[StepShape, dict[str, np.ndarray]] = {}
        self.small_values: dict[StepShape, dict[str, ort.OrtValue]] = {}
        #: each step shape's logits buffer (array, value), when the vocabulary is known before the first run
        self.logits: dict[StepShape, tuple[np.ndarray, ort.OrtValue]] = {}
        self.logits_prebound = (session.vocab_size is not None and not full_logits(session.layout)
                                and self.growing is None)   # a growing step may be several runs of fewer rows
        #: the step shape whose small inputs are bound now, and the CCL length bound now
        self.bound: StepShape | None = None
        self.ccl_bound: int | None = None
        #: the outputs in the order first bound (IOBinding returns them in that order)
        self.out_order: list[str] = []
        self.kv_views: dict[str, ort.OrtValue] | None = None
        #: a graph with LoRA inputs: the session's adapters, their stacks bound once, each row's slot and scale
        self.adapters = (AdapterFeeds(session.graph.lora, session.device, session.files.source_name)
                         if session.graph.lora is not None else None)

    # ------------------------------------------------------------------------------------ outputs and state
    def bind(self) -> None:
        """Bind the buffers: every KV pair (in place, or to its spare), a vision-language graph's images."""
        self.out_order = []
        self.bind_kv()
        if self.session.media is not None:
            self.session.media.bind(self.io, self.bind_out)

    def rebind_outputs(self) -> None:
        """Every output bound again as :meth:`bind` binds them (onnxruntime's IOBinding unbinds outputs only all
        together); the next step binds its small inputs and logits again."""
        self.io.clear_binding_outputs()
        self.bind()
        self.bound = None

    def can_rebind_outputs(self) -> bool:
        """Whether the executor unbinds outputs (:meth:`rebind_outputs`): onnxruntime's does."""
        return hasattr(self.io, "clear_binding_outputs")

    def bind_kv(self) -> None:
        """The KV buffers as the whole buffers: each input, and its output in place or to its spare (a growing
        graph: its presents, the step's rows from the first)."""
        if self.growing is not None:
            self.growing.bind_outputs(self.bind_out)
            self.growing.use_rows(0)
            self.kv_views = None
            return
        for name, value, spare in self.session.cache.bindings():
            self.io.bind_ortvalue_input(name, value)
            self.bind_out(self.outputs[name], spare if spare is not None else value)
        self.kv_views = None

    def use_kv(self, views: dict[str, ort.OrtValue] | None) -> None:
        """Have the KV bound as ``views`` (lock step: rows of the buffers) or, with ``None``, as the whole
        buffers; binds only when that changes."""
        if views is self.kv_views:
            return
        if views is None:
            self.bind_kv()
        else:
            self.bind_views(views)
            self.kv_views = views

    def bind_views(self, views: dict[str, ort.OrtValue]) -> None:
        """Bind ``views`` (input name -> value) as both the KV inputs and their retained outputs (a growing
        graph: the step's rows are those of ``views``)."""
        if self.growing is not None:
            self.growing.use_rows(self.rows.span_of(views)[0])
            return
        for p in self.session.layout.pairs:
            self.io.bind_ortvalue_input(p.input_name, views[p.input_name])
            self.bind_out(p.output_name, views[p.input_name])

    def bind_out(self, name: str, value: ort.OrtValue | None) -> None:
        """Bind output ``name`` to ``value`` (``None``: a value the executor allocates on the CPU)."""
        # IOBinding lists outputs in the order they were first bound; rebinding a name keeps its place.
        if value is None:
            self.io.bind_output(name, "cpu")
        else:
            self.io.bind_ortvalue_output(name, value)
        if name not in self.out_order:
            self.out_order.append(name)

    def outputs_by_name(self) -> dict[str, ort.OrtValue]:
        """Every output of the last run, by name."""
        return dict(zip(self.out_order, self.io.get_outputs()))

    def output(self, name: str) -> np.ndarray:
        """The value of output ``name`` after the last run."""
        return self.io.get_outputs()[self.out_order.index(name)].numpy()

    # ------------------------------------------------------------------------------------ a step
    def bind_small(self, rows: int, seq_len: int, keep: int = 1) -> dict[str, np.ndarray]:
        """Bind the small inputs (and logits) of a ``[rows, seq_len]`` step; ``keep``: the logits rows a
        speculative-decoding graph returns (``num_logits_to_keep``). Returns the arrays a step writes."""
        key = (rows, seq_len, keep)
        arrays = self.small.get(key)
        if arrays is None:
            arrays = self._make_small(key)
        if self.bound != key:
            for k, v in self.small_values[key].items():
                self.io.bind_ortvalue_input(k, v)
            self.bind_out("logits", self.logits[key][1] if self.logits_prebound else None)
            self.bound = key
        return arrays

    def _make_small(self, key: StepShape) -> dict[str, np.ndarray]:
        s = self.session
        rows, seq_len, keep = key
        shapes = {"input_ids": (rows, seq_len), "position_ids": position_shape(s.mrope, rows, seq_len),
                  **{k: v.shape for k, v in s.graph.batching.step_inputs(rows).items()}}
        if s.speculative:
            shapes[naming.LOGITS_TO_KEEP_INPUT] = (keep, 1)
        pairs = {k: s.device.buffer(shape, np.int64) for k, shape in shapes.items()}
        if self.adapters is not None:
            pairs.update({k: s.device.buffer(shape, dt) for k, (shape, dt) in self.adapters.small_shapes(rows).items()})
        arrays = self.small[key] = {k: a for k, (a, _) in pairs.items()}
        self.small_values[key] = {k: v for k, (_, v) in pairs.items()}
        if self.logits_prebound:
            self.logits[key] = s.device.buffer((rows, keep, s.vocab_size), s.logits_dtype)
        return arrays

    def run(self, rows: int, seq_len: int, last_index: np.ndarray, needed: int | None = None,
            keep: int = 1) -> np.ndarray:
        """Run the bound graph; returns logits ``[rows, vocab]`` (a copy) at each row's last valid token, or with
        ``keep > 1`` (a speculative-decoding graph) the kept rows ``[rows, keep, vocab]``.
        ``needed``: 1 + the largest position the step writes (picks ``comp_ctx_lengths`` on a CCL graph)."""
        s = self.session
        if s.ccl is not None:
            length = s.ccl.length_for(s.ctx_len if needed is None else needed)
            if length != self.ccl_bound:
                self.io.bind_ortvalue_input(ccl_mod.INPUT, s.ccl.value(length))
                self.ccl_bound = length
        if s.graph.swaps_buffers:
            self.bind_kv()
        if self.adapters is not None:
            self.adapters.bind(self.io)
        key, out = (rows, seq_len, keep), None
        try:
            if self.growing is not None:
                out = self.growing.run(self.io, self.small[key], self.small_values[key], self.feeds,
                                       self.outputs_by_name)
            else:
                self.feeds.feed(self.io, self.small[key]["position_ids"])
                self.io.run()
        except QeffKvError:
            raise
        except Exception as exc:
            raise RuntimeInputError(f"onnxruntime failed: {' '.join(str(exc).split())[:400]}") from None
        s.cache.swap()
        if out is None:
            out = self.logits[key][0] if self.logits_prebound else self.output("logits")
        return _logits_rows(out, rows, keep, last_index)

    def adapt_rows(self, arrays: dict[str, np.ndarray], rows) -> None:
        """Each ``(row, sequence)`` of the step whose small inputs are ``arrays`` runs with its sequence's adapter,
        every other row as the base (a graph without adapters: nothing to write)."""
        if self.adapters is not None:
            self.adapters.fill(arrays, rows)

    # ------------------------------------------------------------------------------------ introspection
    def kv_data_pointers(self) -> dict[str, int]:
        """Address of every KV input buffer currently bound (for tests and diagnostics)."""
        return {n: v.data_ptr() for n, v, _ in self.session.cache.bindings()}

    def bound_output_pointers(self) -> dict[str, int]:
        """Address of every retained output after the last run."""
        outs = self.io.get_outputs()
        kv_outputs = set(self.outputs.values())
        return {n: v.data_ptr() for n, v in zip(self.out_order, outs)
                if n in kv_outputs or naming.retained_source(n) is not None}


def full_logits(layout) -> bool:
    """Whether the graph returns logits for every column (``[batch, seq_len, vocab]``, axis 1 that of
    ``input_ids``), whose shape changes with the step: not bound ahead, the executor allocates them."""
    logits, ids = layout.output(naming.LOGITS_OUTPUT), layout.input(naming.INPUT_IDS_INPUT)
    lshape, ishape = (logits.shape if logits else None) or (), (ids.shape if ids else None) or ()
    return len(lshape) == 3 and len(ishape) == 2 and lshape[1] == ishape[1] and lshape[1] != 1


def _logits_rows(out: np.ndarray, rows: int, keep: int, last_index: np.ndarray) -> np.ndarray:
    """A step's logits output as :meth:`GraphBinding.run` returns them (a copy)."""
    if keep > 1:
        if out.shape[:2] != (rows, keep):
            raise ContractError(f"logits have shape {out.shape}; expected [{rows}, {keep}, vocab]")
        return out.copy()
    if out.ndim == 3 and out.shape[1] == 1:
        return out[:, 0, :].copy()
    if out.ndim == 3:  # full logits [rows, seq_len, vocab]
        return out[np.arange(rows), last_index, :].copy()
    raise ContractError(f"logits have shape {out.shape}; expected [batch, 1, vocab]")
