"""The plainest correct runner of a retained-state graph in onnxruntime, shared by verification
(:mod:`qeff_kv.export.verify`) and the quantizer's check (:mod:`qeff_kv.export.weights.quantize`): numpy buffers fed back
after every step, sized from the graph's own layout. No torch."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from qeff_kv.support import capture
from qeff_kv.graph import graphio
from qeff_kv.contract import naming
from qeff_kv.errors import VerificationError


class ProbeRunner:
    """The plainest correct runner of a retained-state graph: numpy buffers fed back after every step."""

    def __init__(self, onnx_path: Path, ctx_len: int, kv_batch: int, ccl=None, *, float32_kernels: bool = False):
        """Weights stay in the memory-mapped external data file (onnxruntime's prepacking off). ``float32_kernels``:
        a graph with block-quantized MatMuls runs them prepacked at accuracy level 1 instead
        (:func:`float32_kernels_copy`: the same weights, computed in float32 as the unpacked path computes them,
        ~100x faster at 8B; a packed copy in memory); other graphs as without it."""
        import onnxruntime as ort

        from qeff_kv.graph.inplace import inplace_issues

        graph = graphio.load(onnx_path)
        layout = graphio.layout_of(graph).require_valid()
        window = graph.metadata_props.get(naming.SLIDING_WINDOW_META)
        #: the KV bound in place (one buffer per pair, input and output): the graph's updaters write into it, as the
        #: runtime binds it; a graph the in-place rule does not pass is fed copies as before
        self.in_place = bool(layout.pairs) and not inplace_issues(graph, layout)
        self._bound: dict | None = None
        del graph
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        copy, packed = float32_kernels_copy(onnx_path) if float32_kernels else (None, False)
        # the weights stay in the memory-mapped external data file instead of a prepacked copy (a 1.45 GB
        # float32 graph: 1.68 GB resident after loading with prepacking, 0.08 GB without; docs/export.md)
        if not packed:
            opts.add_session_config_entry("session.disable_prepacking", "1")
        try:
            with capture.library_output():   # onnxruntime's own log lines stay behind --debug
                self.sess = ort.InferenceSession(str(copy or onnx_path), opts, providers=["CPUExecutionProvider"])
        finally:
            if copy is not None:
                copy.unlink(missing_ok=True)
        self.out_names = [o.name for o in self.sess.get_outputs()]
        in_names = {i.name for i in self.sess.get_inputs()}
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
        positions = np.array([pos], dtype=np.int64)
        if rope_rows is not None:   # [4, 1, S]: text positions over the multimodal RoPE rows
            from qeff_kv.contract.mrope import graph_positions

            positions = graph_positions(pos, rope_rows)
        feeds = {"input_ids": np.array([ids], dtype=np.int64), "position_ids": positions, **self.kv, **self.extra}
        if self.has_batch_index:
            feeds["batch_index"] = np.array([[slot]], dtype=np.int64)
        if self.keeps_logits:
            feeds[naming.LOGITS_TO_KEEP_INPUT] = np.zeros((keep, 1), dtype=np.int64)
        if self.ccl is not None:
            need = max(pos) + 1
            feeds[naming.CCL_INPUT] = np.ones(next(v for v in self.ccl if v >= need), dtype=np.int64)
        if self.in_place:
            out = self._run_in_place(feeds)
        else:
            out = dict(zip(self.out_names, self.sess.run(None, feeds)))
            for i, o in self.pairs:
                self.kv[i] = out[o]
        if "image_idx" in self.extra and self.extra["image_idx"][0, 0] >= 0:   # the next chunk continues the image
            self.extra["image_idx"] = out[naming.NON_KV_OUTPUT_ALIASES["image_idx"]]
        return np.asarray(out["logits"])[0].astype(np.float64)

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
            opts.log_severity_level = 3
            with capture.library_output():
                vis = ort.InferenceSession(str(vision_path), opts, providers=["CPUExecutionProvider"])
            self.extra["vision_embeds"] = vis.run(None, {"pixel_values": pixel_values})[0]
        else:
            self.extra["pixel_values"] = pixel_values
        self.extra["image_idx"] = np.zeros((1, 1), dtype=np.int64)


def float32_kernels_copy(onnx_path: Path) -> tuple[Path | None, bool]:
    """``(copy, quantized)``: a copy of the graph beside it (its proto only: the external data file is shared)
    whose ``MatMulNBits`` nodes compute at accuracy level 1 (float32), None when none is at another level; and
    whether the graph has any ``MatMulNBits`` (only then is prepacking worth its memory). onnxruntime's
    prepacked float32 kernels compute the dequantized weight times the activations as the unpacked path does
    (to float32's rounding), so verification on it holds the graph's weights to the same tolerance; the level
    the graph ships (default 4: int8 activations) applies when it is served."""
    import onnx

    proto = onnx.load(str(onnx_path), load_external_data=False)
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
    if not changed:
        return None, quantized > 0
    copy = onnx_path.with_name(f".{onnx_path.stem}.float32-kernels.onnx")
    onnx.save(proto, str(copy))
    return copy, True


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:300]}" if text else type(exc).__name__
