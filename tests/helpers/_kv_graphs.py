"""Small retained-state graphs built with onnx.helper for the rewrite/check/buffers tests.

Every layer's KV input is updated by one ``ScatterND`` straight into its retained output (in-place safe),
and the graph runs in onnxruntime. Options let a test break one rule at a time.

Sliding-window layers (``sliding_layers``): their KV buffers have axis 2 ``sliding_window`` (a ring buffer), their
update comes from the input ``kv_update_sw`` ``[1, 2, "sliding_window", 4]``; ``sliding_window=W`` writes the graph
metadata ``qeff_kv.sliding_window``.

An *ordered reader* (``ordered_reader="past_key.0"``) reads ``X`` like a ring-buffer layer's attention does:
``cat = Concat(X, new, axis=2)`` (a graph output, ``ordered_cat``) and the ScatterND's ``updates`` are
``Slice(cat, Shape(X)[2]:)``: the update depends on the reader (in-place safe). With ``ordered_via_view`` the
Concat reads ``Unsqueeze(X)`` (a view: still safe); ``view_extra_reader`` adds a ReduceSum of that Unsqueeze that
the update does not depend on (refused). ``ordered_in_function`` moves Concat/Slice/ScatterND into a function
``RingUpdate`` called by the graph; ``caller_reader`` adds a reader of ``X`` in the graph whose output feeds the
call's ``new`` argument (safe: the body's update depends on it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qeff_kv.contract import naming

KV_DIMS = ["batch_size", 2, "ctx_len", 4]
SW_DIMS = ["batch_size", 2, "sliding_window", 4]
#: a recurrent layer's states (contract section 12): only axis 0 dynamic
REC_DIMS = {"conv_state": ["batch_size", 8, 4], "recurrent_state": ["batch_size", 2, 4, 8]}
RING_DOMAIN = "qeff.tests"


def build(layers: int = 2, prefix: str | None | Sequence[str | None] = None, *,
          stems: Sequence[str] = naming.EXPORT_STEMS,
          extra_inputs: Sequence[str] = (), extra_outputs: Sequence[str] = (),
          initializer_inputs: Sequence[str] = (), intermediate: Sequence[str] = (),
          drop_outputs: Sequence[str] = (), drop_inputs: Sequence[str] = (),
          output_dims: dict[str, list] | None = None, output_dtype: dict[str, int] | None = None,
          extra_reader: str | None = None, non_kv_retained: Sequence[str] = (),
          layer_ids: Sequence[int] | None = None, ir_version: int = 8,
          sliding_layers: Sequence[int] = (), sliding_window: int | str | None = None,
          input_dims: dict[str, list] | None = None,
          ordered_reader: str | None = None, ordered_via_view: bool = False, view_extra_reader: bool = False,
          ordered_in_function: bool = False, caller_reader: bool = False) -> onnx.ModelProto:
    """A retained-state graph with ``layers`` layers of ``stems``; ``prefix`` may be one per layer."""
    layer_ids = list(range(layers)) if layer_ids is None else list(layer_ids)
    prefixes = list(prefix) if isinstance(prefix, (list, tuple)) else [prefix] * len(layer_ids)
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", "seq_len"]),
              helper.make_tensor_value_info("kv_update", TensorProto.FLOAT, [1, 2, "ctx_len", 4])]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch_size", "seq_len"])]
    nodes = [helper.make_node("Cast", ["input_ids"], ["logits"], to=TensorProto.FLOAT, name="cast_logits")]
    inits = [numpy_helper.from_array(np.array([[0]], dtype=np.int64), "scatter_idx")]
    output_dims = output_dims or {}
    output_dtype = output_dtype or {}
    input_dims = input_dims or {}
    functions = []
    if sliding_layers:
        inputs.append(helper.make_tensor_value_info("kv_update_sw", TensorProto.FLOAT, [1, 2, "sliding_window", 4]))
    for stem in stems:   # recurrent states (contract section 12): their own shapes, no position axis
        if stem in REC_DIMS:
            inputs.append(helper.make_tensor_value_info(f"kv_update_{stem}", TensorProto.FLOAT,
                                                        [1] + REC_DIMS[stem][1:]))
    for layer, p in zip(layer_ids, prefixes):
        for stem in stems:
            dims = SW_DIMS if layer in sliding_layers else KV_DIMS
            update = "kv_update_sw" if layer in sliding_layers else "kv_update"
            if stem in REC_DIMS:
                dims, update = REC_DIMS[stem], f"kv_update_{stem}"
            x = naming.kv_input_name(stem, layer, p)
            y = naming.retained_name(x)
            if x not in drop_inputs:
                inputs.append(helper.make_tensor_value_info(x, TensorProto.FLOAT, input_dims.get(x, dims)))
            if y not in drop_outputs:
                outputs.append(helper.make_tensor_value_info(
                    y, output_dtype.get(y, TensorProto.FLOAT), output_dims.get(y, dims)))
            if x == ordered_reader and ordered_in_function:
                new = update
                if caller_reader:  # X * 0 + update: a reader of X in the graph that the call's update depends on
                    inits.append(numpy_helper.from_array(np.array(0.0, np.float32), "zero_f"))
                    nodes += [helper.make_node("Mul", [x, "zero_f"], ["caller_read"], name="caller_reader"),
                              helper.make_node("Add", [update, "caller_read"], ["caller_new"], name="caller_add")]
                    new = "caller_new"
                nodes.append(helper.make_node("RingUpdate", [x, "scatter_idx", new], [y, "ordered_cat"],
                                              domain=RING_DOMAIN, name=f"ring_{x}"))
                outputs.append(helper.make_tensor_value_info("ordered_cat", TensorProto.FLOAT, ["batch_size", 2, "cat_len", 4]))
                functions.append(_ring_function())
            elif x == ordered_reader:
                nodes += _ordered_nodes(x, y, update, via_view=ordered_via_view, view_extra=view_extra_reader, inits=inits)
                outputs.append(helper.make_tensor_value_info("ordered_cat", TensorProto.FLOAT, ["batch_size", 2, "cat_len", 4]))
                if view_extra_reader:
                    outputs.append(helper.make_tensor_value_info("view_extra_sum", TensorProto.FLOAT, []))
            elif x not in drop_inputs and y not in drop_outputs:
                nodes.append(helper.make_node("ScatterND", [x, "scatter_idx", update], [y], name=f"scatter_{x}"))
            elif x not in drop_inputs:
                nodes.append(helper.make_node("Shape", [x], [f"shape_of_{x}"], name=f"shape_{x}"))
            elif y not in drop_outputs:
                nodes.append(helper.make_node("Identity", ["kv_update"], [y], name=f"id_{y}"))
    if extra_reader is not None:  # a second reader of a KV input: breaks in-place safety
        nodes.append(helper.make_node("ReduceSum", [extra_reader], ["extra_sum"], keepdims=0, name="extra_reader"))
        outputs.append(helper.make_tensor_value_info("extra_sum", TensorProto.FLOAT, []))
    for n in extra_inputs:
        inputs.append(helper.make_tensor_value_info(n, TensorProto.FLOAT, [1]))
        nodes.append(helper.make_node("Identity", [n], [f"{n}__copy"], name=f"use_{n}"))
    for n in extra_outputs:
        outputs.append(helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch_size", "seq_len"]))
        nodes.append(helper.make_node("Identity", ["logits"], [n], name=f"make_{n}"))
    for n in non_kv_retained:  # e.g. vision_embeds / vision_embeds_RetainedState (names given in full)
        src = naming.retained_source(n)
        # image_idx / image_idx_output: int64 [1, 1] (contract section 6); the others float [1]
        elem, dims = ((TensorProto.INT64, [1, 1]) if (src or n) == "image_idx" else (TensorProto.FLOAT, [1]))
        if src is None:
            inputs.append(helper.make_tensor_value_info(n, elem, dims))
        else:
            outputs.append(helper.make_tensor_value_info(n, elem, dims))
            nodes.append(helper.make_node("Identity", [src], [n], name=f"keep_{n}"))
    for n in initializer_inputs:
        inits.append(numpy_helper.from_array(np.zeros([1], dtype=np.float32), n))
        inputs.append(helper.make_tensor_value_info(n, TensorProto.FLOAT, [1]))
        nodes.append(helper.make_node("Identity", [n], [f"{n}__copy"], name=f"use_{n}"))
    for n in intermediate:
        nodes.append(helper.make_node("Identity", ["logits"], [n], name=f"mid_{n}"))
        nodes.append(helper.make_node("Identity", [n], [f"{n}__sink"], name=f"sink_{n}"))
    graph = helper.make_graph(nodes, "kv_test", inputs, outputs, initializer=inits)
    opsets = [helper.make_opsetid("", 17)] + ([helper.make_opsetid(RING_DOMAIN, 1)] if functions else [])
    model = helper.make_model(graph, opset_imports=opsets, producer_name="qeff-kv-tests", functions=functions)
    model.ir_version = ir_version
    props = {"origin": "tests"}
    if sliding_window is not None:
        props[naming.SLIDING_WINDOW_META] = str(sliding_window)
    helper.set_model_props(model, props)
    return model


def _ordered_nodes(x: str, y: str, update: str, *, via_view: bool, view_extra: bool, inits: list) -> list:
    """``cat = Concat(X, update)`` (graph output ``ordered_cat``), ``updates = Slice(cat, Shape(X)[2]:)``,
    ``ScatterND(X, idx, updates) -> Y``; optionally through ``Unsqueeze(X)`` (axis 0), with a second reader of it."""
    inits += [numpy_helper.from_array(np.array([2**62], np.int64), "slice_end"),
              numpy_helper.from_array(np.array([0], np.int64), "axes0")]
    nodes = [helper.make_node("Shape", [x], ["ordered_start"], start=2, end=3, name="ordered_shape")]
    if via_view:
        inits.append(numpy_helper.from_array(np.array([3], np.int64), "axes3"))
        nodes += [helper.make_node("Unsqueeze", [x, "axes0"], ["x_view"], name="ordered_view"),
                  helper.make_node("Unsqueeze", [update, "axes0"], ["upd_view"], name="update_view"),
                  helper.make_node("Concat", ["x_view", "upd_view"], ["cat5"], axis=3, name="ordered_concat"),
                  helper.make_node("Squeeze", ["cat5", "axes0"], ["ordered_cat"], name="ordered_squeeze"),
                  helper.make_node("Slice", ["cat5", "ordered_start", "slice_end", "axes3"], ["upd5"],
                                   name="ordered_slice"),
                  helper.make_node("Squeeze", ["upd5", "axes0"], ["ordered_upd"], name="ordered_upd_squeeze")]
        if view_extra:
            nodes.append(helper.make_node("ReduceSum", ["x_view"], ["view_extra_sum"], keepdims=0,
                                          name="view_extra_reader"))
    else:
        inits.append(numpy_helper.from_array(np.array([2], np.int64), "axes2"))
        nodes += [helper.make_node("Concat", [x, update], ["ordered_cat"], axis=2, name="ordered_concat"),
                  helper.make_node("Slice", ["ordered_cat", "ordered_start", "slice_end", "axes2"], ["ordered_upd"],
                                   name="ordered_slice")]
    nodes.append(helper.make_node("ScatterND", [x, "scatter_idx", "ordered_upd"], [y], name=f"scatter_{x}"))
    return nodes


def _ring_function() -> onnx.FunctionProto:
    """``RingUpdate(data, idx, new) -> (out, cat)``: the ordered reader inside a function body."""
    body = [
        helper.make_node("Constant", [], ["end"], value=numpy_helper.from_array(np.array([2**62], np.int64))),
        helper.make_node("Constant", [], ["axes"], value=numpy_helper.from_array(np.array([2], np.int64))),
        helper.make_node("Concat", ["data", "new"], ["cat"], axis=2, name="fn_concat"),
        helper.make_node("Shape", ["data"], ["start"], start=2, end=3, name="fn_shape"),
        helper.make_node("Slice", ["cat", "start", "end", "axes"], ["upd"], name="fn_slice"),
        helper.make_node("ScatterND", ["data", "idx", "upd"], ["out"], name="fn_scatter"),
    ]
    return helper.make_function(RING_DOMAIN, "RingUpdate", ["data", "idx", "new"], ["out", "cat"], body,
                                [helper.make_opsetid("", 17)])


def save(model: onnx.ModelProto, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def io_signature(path_or_proto) -> tuple[list, list]:
    """(inputs, outputs) as lists of (name, elem_type, dims) with dim names kept; initializer inputs skipped."""
    m = path_or_proto if isinstance(path_or_proto, onnx.ModelProto) else onnx.load(str(path_or_proto),
                                                                                     load_external_data=False)
    inits = {i.name for i in m.graph.initializer}

    def sig(vi):
        t = vi.type.tensor_type
        dims = None if not t.HasField("shape") else [
            d.dim_param if d.HasField("dim_param") else (d.dim_value if d.HasField("dim_value") else None)
            for d in t.shape.dim]
        return (vi.name, t.elem_type, dims)

    return ([sig(v) for v in m.graph.input if v.name not in inits], [sig(v) for v in m.graph.output])


# ------------------------------------------------------------------------------------------ vision-language
VISION_HIDDEN = 8


def build_vlm(layers: int = 2, prefix: str | None = None, *, layout: str = "dual", name_prefix: str | None = None,
              drop: Sequence[str] = (), retained_dims: dict[str, list] | None = None,
              image_idx_dtype: int = TensorProto.INT64, image_idx_dims: list | None = None,
              **kw) -> onnx.ModelProto:
    """A peer-style vision-language language graph (contract section 6) around :func:`build`'s KV layers.

    ``layout="dual"``: inputs ``input_ids, vision_embeds [vision_batch_size, vision_size, 8], position_ids,
    image_idx [1, 1]`` before the KV; outputs ``logits, vision_embeds_RetainedState, image_idx_output`` before the
    KV. ``layout="single"``: ``pixel_values [vision_batch_size, 3, img_size, img_size]`` instead (after
    ``position_ids``), retained as ``pixel_values_RetainedState``. ``name_prefix`` puts a prefix on the vision
    buffer's names (a broken graph); ``drop`` leaves out inputs/outputs by name; ``retained_dims`` replaces the dims
    of an output.
    """
    m = build(layers, prefix, **kw)
    g = m.graph
    retained_dims = retained_dims or {}
    base = "vision_embeds" if layout == "dual" else "pixel_values"
    dims = (["vision_batch_size", "vision_size", VISION_HIDDEN] if layout == "dual"
            else ["vision_batch_size", 3, "img_size", "img_size"])
    vin = base if name_prefix is None else f"{base}_{name_prefix}"
    vout = naming.retained_name(vin)
    idx_dims = [1, 1] if image_idx_dims is None else image_idx_dims
    new_in = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", "seq_len"])]
    lead = [helper.make_tensor_value_info(vin, TensorProto.FLOAT, dims),
            helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch_size", "seq_len"])]
    if layout == "single":
        lead.reverse()
    new_in += lead + [helper.make_tensor_value_info("image_idx", image_idx_dtype, idx_dims)]
    rest_in = [v for v in g.input if v.name != "input_ids"]
    new_out = [g.output[0],
               helper.make_tensor_value_info(vout, TensorProto.FLOAT, retained_dims.get(vout, dims)),
               helper.make_tensor_value_info("image_idx_output", image_idx_dtype, retained_dims.get("image_idx_output", idx_dims))]
    rest_out = list(g.output[1:])
    nodes = [helper.make_node("Identity", [vin], [vout], name="keep_vision"),
             helper.make_node("Identity", ["image_idx"], ["image_idx_output"], name="chain_image_idx"),
             helper.make_node("Identity", ["position_ids"], ["position_ids__copy"], name="use_position_ids")]
    ins = [v for v in new_in + rest_in if v.name not in drop]
    outs = [v for v in new_out + rest_out if v.name not in drop]
    keep_in = {v.name for v in ins}
    kept = []
    for n in nodes:
        if any(o in drop for o in n.output):
            continue
        if all(i in keep_in for i in n.input):
            kept.append(n)
        elif n.output[0] != "position_ids__copy":  # an output whose input was dropped: a constant stands in
            zero = (np.zeros([1, 1], np.int64 if image_idx_dtype == TensorProto.INT64 else np.int32)
                    if n.output[0] == "image_idx_output" else np.zeros([1, 1, VISION_HIDDEN], np.float32))
            kept.append(helper.make_node("Constant", [], [n.output[0]], value=numpy_helper.from_array(zero),
                                         name=f"const_{n.output[0]}"))
    nodes = kept
    del g.input[:]
    g.input.extend(ins)
    del g.output[:]
    g.output.extend(outs)
    g.node.extend(nodes)
    return m


def build_vision_encoder(*, output: str = "vision_embeds", extra_output: str | None = None) -> onnx.ModelProto:
    """A peer-style dual-layout vision graph: ``pixel_values [batch_size, 3, img_size, img_size] -> vision_embeds
    [batch_size, vision_size, 8]`` (a ReduceMean and a Tile stand in for the encoder)."""
    ins = [helper.make_tensor_value_info("pixel_values", TensorProto.FLOAT, ["batch_size", 3, "img_size", "img_size"])]
    outs = [helper.make_tensor_value_info(output, TensorProto.FLOAT, ["batch_size", "vision_size", VISION_HIDDEN])]
    nodes = [helper.make_node("ReduceMean", ["pixel_values"], ["pooled"], axes=[1], keepdims=0, name="pool"),
             helper.make_node("Flatten", ["pooled"], ["flat"], axis=1, name="flatten"),
             helper.make_node("Unsqueeze", ["flat", "axes2"], ["col"], name="col"),
             helper.make_node("Tile", ["col", "reps"], [output], name="tile")]
    inits = [numpy_helper.from_array(np.array([2], np.int64), "axes2"),
             numpy_helper.from_array(np.array([1, 1, VISION_HIDDEN], np.int64), "reps")]
    if extra_output is not None:
        outs.append(helper.make_tensor_value_info(extra_output, TensorProto.FLOAT, ["batch_size", 3, "img_size", "img_size"]))
        nodes.append(helper.make_node("Identity", ["pixel_values"], [extra_output], name="extra"))
    graph = helper.make_graph(nodes, "vision_test", ins, outs, initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], producer_name="qeff-kv-tests")
    model.ir_version = 8
    return model


def torchscript_output(graph: onnx.GraphProto, name: str, declare: dict[int, object] | None = None) -> None:
    """Route the graph output ``name`` through a ``Reshape`` to a shape computed at run time (``Abs(Shape(x))``: its
    own shape, by an op shape inference does not propagate) and declare it with TorchScript's made-up dims
    (``Reshape<name>_dim_<k>``), as torch's exporter does where it cannot tie an output dim to an input; ``declare``
    sets some axes to a value instead (``{1: 7}``, ``{2: 'ctx_len'}``). The values computed stay the same."""
    declare = declare or {}
    inner = name + "_inner"
    for n in graph.node:
        n.output[:] = [inner if o == name else o for o in n.output]
    graph.node.extend([helper.make_node("Shape", [inner], [name + "_shape"], name=f"shape_{name}"),
                       helper.make_node("Abs", [name + "_shape"], [name + "_shape_abs"], name=f"abs_{name}"),
                       helper.make_node("Reshape", [inner, name + "_shape_abs"], [name], name=f"Reshape_{name}")])
    out = next(o for o in graph.output if o.name == name)
    for k, d in enumerate(out.type.tensor_type.shape.dim):
        value = declare.get(k, f"Reshape{name}_dim_{k}")
        d.Clear()
        if isinstance(value, int):
            d.dim_value = value
        else:
            d.dim_param = value
