"""The plainest correct runner of a retained-state graph in onnxruntime, shared by verification
(:mod:`qeff_kv.export.verify`) and the quantizer's check (:mod:`qeff_kv.export.weights.quantize`): numpy buffers fed back
after every step, sized from the graph's own layout. No torch."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from qeff_kv.support import capture
from qeff_kv.graph import graphio
from qeff_kv.contract import naming
from qeff_kv.errors import ExportError, VerificationError


class ProbeRunner:
    """The plainest correct runner of a retained-state graph: numpy buffers fed back after every step."""

    def __init__(self, onnx_path: Path, ctx_len: int, kv_batch: int, ccl=None, *, float32_kernels: bool = False,
                 open_session: bool = True):
        """Weights stay in the memory-mapped external data file (onnxruntime's prepacking off). ``float32_kernels``:
        a graph with block-quantized MatMuls runs them prepacked at accuracy level 1 instead
        (:func:`float32_kernels_copy`: the same weights, computed in float32 as the unpacked path computes them,
        ~100x faster at 8B; a packed copy in memory); other graphs as without it. ``open_session`` False: the feeds
        and the states' first buffers only, no session (:class:`BlockProbeRunner` runs the graph a block at a time)."""
        from qeff_kv.graph.inplace import inplace_issues

        graph = graphio.load(onnx_path)
        layout = graphio.layout_of(graph).require_valid()
        window = graph.metadata_props.get(naming.SLIDING_WINDOW_META)
        #: the KV bound in place (one buffer per pair, input and output): the graph's updaters write into it, as the
        #: runtime binds it; a graph the in-place rule does not pass is fed copies as before
        self.in_place = bool(layout.pairs) and not inplace_issues(graph, layout)
        self._bound: dict | None = None
        del graph
        self.layout = layout
        if open_session:
            self.sess = open_session_on(onnx_path, float32_kernels)
            self.out_names = [o.name for o in self.sess.get_outputs()]
            in_names = {i.name for i in self.sess.get_inputs()}
        else:
            in_names = {i.name for i in layout.inputs}
        self._setup(layout, in_names, ctx_len, kv_batch, ccl, window)

    def _setup(self, layout, in_names: set[str], ctx_len: int, kv_batch: int, ccl, window) -> None:
        self.has_batch_index = "batch_index" in in_names
        # comp_ctx_lengths: the smallest listed length that holds the step's positions (exercises the Slice)
        self.ccl = (sorted(ccl or ()) + [ctx_len]) if naming.CCL_INPUT in in_names else None
        #: a speculative-decoding graph: ``num_logits_to_keep`` ``[n, 1]`` says how many last rows' logits to return
        self.keeps_logits = naming.LOGITS_TO_KEEP_INPUT in in_names
        self.pairs = [(p.input_name, p.output_name) for p in layout.pairs]
        #: inputs fed on every step beside the tokens and the KV: a graph with adapters runs as the base model
        #: (:meth:`~qeff_kv.contract.lora.LoraGeometry.zero_feeds`) unless a caller feeds adapters here
        self.extra: dict[str, np.ndarray] = {}
        self.lora = layout.lora
        if self.lora is not None:
            self.extra.update(self.lora.zero_feeds(1))
        self.kv: dict[str, np.ndarray] = {}
        spec = layout.state_spec   # each layer's kind and capacity (ring layers: the window)
        for p in layout.pairs:
            shape = []
            state = spec.layer(p.layer)
            for i, d in enumerate(p.input.shape or ()):
                if isinstance(d, int):
                    shape.append(d)
                elif i == 0:
                    shape.append(kv_batch)
                elif state is not None and i == state.position_axis:
                    shape.append(state.capacity_at(ctx_len, int(window) if window is not None else None) or ctx_len)
                else:
                    raise VerificationError(f"cannot size KV input {p.input_name!r}: symbolic dim {d!r} at axis {i}")
            self.kv[p.input_name] = np.zeros(shape, dtype=np.dtype(p.input.dtype))

    def step(self, ids: list[int], pos: list[int], slot: int, rope_rows: np.ndarray | None = None) -> np.ndarray:
        """The logits ``[vocab]`` (float64) at the step's last valid row."""
        return self.step_rows(ids, pos, slot, rope_rows)[-1]

    def step_rows(self, ids: list[int], pos: list[int], slot: int, rope_rows: np.ndarray | None = None,
                  keep: int = 1) -> np.ndarray:
        """The logits ``[n, vocab]`` (float64) of the step's last ``keep`` rows (a speculative-decoding graph;
        other graphs give their one row)."""
        feeds = self.feeds(ids, pos, slot, rope_rows, keep)
        if self.in_place:
            out = self._run_in_place(feeds)
        else:
            out = dict(zip(self.out_names, self.sess.run(None, {**feeds, **self.kv})))
            for i, o in self.pairs:
                self.kv[i] = out[o]
        if "image_idx" in self.extra and self.extra["image_idx"][0, 0] >= 0:   # the next chunk continues the image
            self.extra["image_idx"] = out[naming.NON_KV_OUTPUT_ALIASES["image_idx"]]
        return np.asarray(out["logits"])[0].astype(np.float64)

    def feeds(self, ids: list[int], pos: list[int], slot: int, rope_rows: np.ndarray | None = None,
              keep: int = 1) -> dict[str, np.ndarray]:
        """A step's inputs other than the states."""
        positions = np.array([pos], dtype=np.int64)
        if rope_rows is not None:   # [4, 1, S]: text positions over the multimodal RoPE rows
            from qeff_kv.contract.mrope import graph_positions

            positions = graph_positions(pos, rope_rows)
        feeds = {"input_ids": np.array([ids], dtype=np.int64), "position_ids": positions, **self.extra}
        if self.has_batch_index:
            feeds["batch_index"] = np.array([[slot]], dtype=np.int64)
        if self.keeps_logits:
            feeds[naming.LOGITS_TO_KEEP_INPUT] = np.zeros((keep, 1), dtype=np.int64)
        if self.ccl is not None:
            need = max(pos) + 1
            feeds[naming.CCL_INPUT] = np.ones(next(v for v in self.ccl if v >= need), dtype=np.int64)
        return feeds

    def _run_in_place(self, feeds: dict) -> dict:
        """One step with each KV buffer bound as its pair's input and output (the arrays of ``self.kv``, updated in
        place: no second copy of the cache per step, 0.27 GB at 8B and ctx 1024); the other outputs as arrays."""
        import onnxruntime as ort

        if self._bound is None:
            self._bound = {i: ort.OrtValue.ortvalue_from_numpy(self.kv[i]) for i, _o in self.pairs}
        binding = self.sess.io_binding()
        for name, value in feeds.items():
            if name not in self._bound:
                binding.bind_cpu_input(name, np.ascontiguousarray(value))
        kv_out = {}
        for i, o in self.pairs:
            binding.bind_ortvalue_input(i, self._bound[i])
            binding.bind_ortvalue_output(o, self._bound[i])
            kv_out[o] = i
        rest = [name for name in self.out_names if name not in kv_out]
        for name in rest:
            binding.bind_output(name, "cpu")
        self.sess.run_with_iobinding(binding)
        values = dict(zip([o for _i, o in self.pairs] + rest, binding.get_outputs()))
        return {name: values[name].numpy() for name in rest}

    def add_image(self, pixel_values: np.ndarray, vision_path: Path | None) -> None:
        """Feed a vision-language graph its image: ``vision_embeds`` from the vision graph (dual layout) or
        ``pixel_values`` (single), and ``image_idx`` from 0."""
        import onnxruntime as ort

        if vision_path is not None:
            opts = ort.SessionOptions()
            opts.log_severity_level = capture.onnxruntime_log_severity()
            with capture.library_output():
                vis = ort.InferenceSession(str(vision_path), opts, providers=["CPUExecutionProvider"])
            self.extra["vision_embeds"] = vis.run(None, {"pixel_values": pixel_values})[0]
        else:
            self.extra["pixel_values"] = pixel_values
        self.extra["image_idx"] = np.zeros((1, 1), dtype=np.int64)


class BlockProbeRunner:
    """The probe run a block of layers at a time (:mod:`qeff_kv.graph.blocks`): :meth:`step` and
    :meth:`step_rows` only record the step and hand back where its logits will be; :meth:`run` then runs each
    block over every recorded step (its own states carried from step to step, the values earlier blocks computed
    handed in) and frees its session before the next, so onnxruntime holds one block's weights at a time.
    Holds for probes whose feeds do not depend on the graph's outputs (teacher-forced decode, no image)."""

    def __init__(self, onnx_path: Path, ctx_len: int, kv_batch: int, ccl, per_block: int):
        import onnx

        from qeff_kv.graph import blocks

        self.path, self.per_block = Path(onnx_path), per_block
        self.base = ProbeRunner(onnx_path, ctx_len, kv_batch, ccl, open_session=False)
        self.keeps_logits, self.extra = self.base.keeps_logits, self.base.extra
        states = [(p.layer, p.input_name, p.output_name) for p in self.base.layout.pairs]
        try:
            self.cut = blocks.Cut(onnx.load(str(onnx_path), load_external_data=False), states)
        except blocks.BlockCutError as exc:
            raise BlockRunRefused(str(exc)) from None
        self.plan = self.cut.blocks(per_block)
        self.recorded: list[dict[str, np.ndarray]] = []

    def step(self, ids: list[int], pos: list[int], slot: int, rope_rows: np.ndarray | None = None):
        return self.step_rows(ids, pos, slot, rope_rows)[-1]

    def step_rows(self, ids: list[int], pos: list[int], slot: int, rope_rows: np.ndarray | None = None,
                  keep: int = 1) -> list[tuple[int, int]]:
        """``(step, row)`` of each of the step's ``keep`` last rows' logits, in :meth:`run`'s answer."""
        self.recorded.append(dict(self.base.feeds(ids, pos, slot, rope_rows, keep)))
        return [(len(self.recorded) - 1, j) for j in range(keep)]

    def run_steps(self, where: list[tuple[str, tuple[int, int]]]) -> list[tuple[str, np.ndarray]]:
        """``(label, logits)`` for each ``(label, (step, row))`` that :meth:`step_rows` handed out, once the blocks
        ran; onnxruntime failing on a block is a failed verification."""
        try:
            rows = self.run()
        except VerificationError:
            raise
        except Exception as exc:
            raise VerificationError(f"verification failed: onnxruntime could not run the exported graph "
                                    f"({first_line(exc)})") from None
        return [(label, rows[s][j]) for label, (s, j) in where]

    def run(self) -> list[np.ndarray]:
        """Each recorded step's logits ``[rows, vocab]`` (float64)."""
        carried: list[dict[str, np.ndarray]] = [{} for _ in self.recorded]
        logits: list[np.ndarray | None] = [None] * len(self.recorded)
        for b, block in enumerate(self.plan):
            sess = self._session(b, block, carried[0] if carried else {})
            names = [o.name for o in sess.get_outputs()]
            own = {p.input_name: p.output_name for p in self.base.layout.pairs if p.output_name in block.outputs}
            state = {i: self.base.kv[i] for i in own}
            for s, feeds in enumerate(self.recorded):
                feed = {n: feeds[n] if n in feeds else state.get(n, self.base.kv.get(n)) for n in block.inputs}
                feed.update((v, carried[s][v]) for v in block.carried_in)
                out = dict(zip(names, sess.run(None, feed)))
                state.update((i, out[o]) for i, o in own.items())
                carried[s].update((v, out[v]) for v in block.carried_out)
                if naming.LOGITS_OUTPUT in out:
                    logits[s] = np.asarray(out[naming.LOGITS_OUTPUT])[0].astype(np.float64)
            del sess, state
            later = {v for blk in self.plan[b + 1:] for v in blk.carried_in}
            for values in carried:
                for v in [v for v in values if v not in later]:
                    del values[v]
        if any(x is None for x in logits):
            raise VerificationError("verification failed: no block of the graph computes its logits")
        return logits

    def _session(self, b: int, block, carried: dict[str, np.ndarray]):
        import onnx

        types = {v: (onnx.helper.np_dtype_to_tensor_dtype(a.dtype), a.ndim) for v, a in carried.items()}
        proto = self.cut.block_model(block, types)
        _, quantized = float32_levels(proto)
        path = self.path.with_name(f".{self.path.stem}.block{b}.onnx")
        onnx.save(proto, str(path))
        del proto
        try:
            return open_session_on(path, packed=quantized > 0)
        finally:
            path.unlink(missing_ok=True)


#: ``QEFF_KV_VERIFY_BLOCK_LAYERS=k``: verification runs the graph ``k`` decoder layers at a time whatever the memory
#: (tests and comparisons); a graph that cannot be cut is then verified whole
BLOCK_ENV = "QEFF_KV_VERIFY_BLOCK_LAYERS"


def forced_block_layers() -> int | None:
    """:data:`BLOCK_ENV`'s layers per block, or None."""
    import os

    value = os.environ.get(BLOCK_ENV, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ExportError(f"{BLOCK_ENV}={value!r} is not a number of layers (1 or more): set a number, or unset it")
    return int(value)


class BlockRunRefused(VerificationError):
    """The graph cannot be run a block at a time (why: the message); the caller runs it whole or refuses."""


def float32_kernels_copy(onnx_path: Path) -> tuple[Path | None, bool]:
    """``(copy, quantized)``: a copy of the graph beside it (its proto only: the external data file is shared)
    whose ``MatMulNBits`` nodes compute at accuracy level 1 (float32), None when none is at another level; and
    whether the graph has any ``MatMulNBits`` (only then is prepacking worth its memory). onnxruntime's
    prepacked float32 kernels compute the dequantized weight times the activations as the unpacked path does
    (to float32's rounding), so verification on it holds the graph's weights to the same tolerance; the level
    the graph ships (default 4: int8 activations) applies when it is served."""
    import onnx

    proto = onnx.load(str(onnx_path), load_external_data=False)
    changed, quantized = float32_levels(proto)
    if not changed:
        return None, quantized > 0
    copy = onnx_path.with_name(f".{onnx_path.stem}.float32-kernels.onnx")
    onnx.save(proto, str(copy))
    return copy, True


def float32_levels(proto) -> tuple[int, int]:
    """Set the graph's ``MatMulNBits`` nodes at another accuracy level to level 1 (float32), in place:
    ``(how many changed, how many there are)``."""
    changed = quantized = 0
    for node in proto.graph.node:
        if node.op_type != "MatMulNBits":
            continue
        quantized += 1
        level = next((a for a in node.attribute if a.name == "accuracy_level"), None)
        if level is None:
            continue   # absent: onnxruntime's default, float32
        if level.i not in (0, 1):
            level.i = 1
            changed += 1
    return changed, quantized


def open_session_on(onnx_path: Path, float32_kernels: bool = False, *, packed: bool = False):
    """An onnxruntime CPU session on the graph (see :class:`ProbeRunner`); ``packed``: prepacking on (the graph
    was made with its block-quantized MatMuls at level 1 already)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = capture.onnxruntime_log_severity()   # a node failing at run time: our one line
    ort.set_default_logger_severity(capture.onnxruntime_log_severity())
    copy, quantized = float32_kernels_copy(onnx_path) if float32_kernels else (None, False)
    # the weights stay in the memory-mapped external data file instead of a prepacked copy (a 1.45 GB
    # float32 graph: 1.68 GB resident after loading with prepacking, 0.08 GB without; docs/export.md)
    if not (quantized or packed):
        opts.add_session_config_entry("session.disable_prepacking", "1")
    try:
        with capture.library_output():   # onnxruntime's own log lines stay behind --debug
            return ort.InferenceSession(str(copy or onnx_path), opts, providers=["CPUExecutionProvider"])
    finally:
        if copy is not None:
            copy.unlink(missing_ok=True)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:300]}" if text else type(exc).__name__
