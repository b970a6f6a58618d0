"""RemovePassThroughPass: no-op nodes between a KV update and its retained output are removed, nothing else.

Hand-made onnx_ir graphs: ``past_key.0 -> ScatterND -> <no-ops> -> past_key.0_RetainedState`` with another
reader of the no-op's output, as the TorchScript tracer makes of GPT-J's ``key.to(torch.float32)``.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from qeff_kv.errors import PassInvariantError
from qeff_kv.graph import graphio
from qeff_kv.graph.inplace import inplace_issues
from qeff_kv.graph.passes import RemovePassThroughPass

FLOAT, F16 = ir.DataType.FLOAT, ir.DataType.FLOAT16
KV_SHAPE = ["batch_size", 2, "ctx_len", 4]


def _const(graph_nodes: list, array: np.ndarray, name: str) -> ir.Value:
    node = ir.node("Constant", [], attributes={"value": ir.tensor(array, name=name)}, name=name)
    node.outputs[0].name = name
    graph_nodes.append(node)
    return node.outputs[0]


def _graph(no_ops, dtype=FLOAT, annotate_scatter=False, logits_cast=True) -> ir.Model:
    """``past_key.0``/``past_value.0`` updated by ScatterND at ``position``; the key's update goes through
    ``no_ops`` (a list of ``(op_type, extra inputs, attributes)``) before its retained output, and the last
    no-op's output is also read by a ReduceSum into ``logits`` (through a float->float Cast, a non-KV output)."""
    kv = {n: ir.Value(name=n, type=ir.TensorType(dtype), shape=ir.Shape(KV_SHAPE))
          for n in ("past_key.0", "past_value.0")}
    upd = ir.Value(name="update", type=ir.TensorType(dtype), shape=ir.Shape(["batch_size", 2, 1, 4]))
    position = ir.Value(name="position_ids", type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape(["batch_size", 1]))
    nodes: list[ir.Node] = []
    # indices [B, 2, 1, 3] = (batch 0, head h, position)
    pos = ir.node("Reshape", [position, _const(nodes, np.array([1, 1, 1, 1], np.int64), "pos_shape")])
    nodes.append(pos)
    pos4 = ir.node("Expand", [pos.outputs[0], _const(nodes, np.array([1, 2, 1, 1], np.int64), "expand_shape")])
    nodes.append(pos4)
    bh = _const(nodes, np.array([[[[0, 0]]], [[[0, 1]]]], np.int64).reshape(1, 2, 1, 2), "batch_head")
    idx = ir.node("Concat", [bh, pos4.outputs[0]], attributes={"axis": -1})
    nodes.append(idx)
    outs = []
    value = None
    for name in ("past_key.0", "past_value.0"):
        sc = ir.node("ScatterND", [kv[name], idx.outputs[0], upd], name=f"scatter_{name}")
        if annotate_scatter:
            sc.outputs[0].dtype, sc.outputs[0].shape = dtype, ir.Shape(KV_SHAPE)
        nodes.append(sc)
        out = sc.outputs[0]
        if name == "past_key.0":
            for i, (op, extra, attrs) in enumerate(no_ops):
                inputs = [out] + [_const(nodes, a, f"{op}_{i}_arg") for a in extra]
                n = ir.node(op, inputs, attributes=attrs, name=f"noop_{i}_{op}")
                nodes.append(n)
                out = n.outputs[0]
            value = out
        out.name = f"{name}_RetainedState"
        out.dtype, out.shape = dtype, ir.Shape(KV_SHAPE)
        outs.append(out)
    red = ir.node("ReduceSum", [value], attributes={"keepdims": 1}, name="reader")
    nodes.append(red)
    logits = red.outputs[0]
    if logits_cast:
        cast = ir.node("Cast", [logits], attributes={"to": dtype.value}, name="logits_cast")
        nodes.append(cast)
        logits = cast.outputs[0]
    logits.name, logits.dtype, logits.shape = "logits", dtype, ir.Shape([1, 1, 1, 1])
    graph = ir.Graph([position, upd, *kv.values()], [logits, *outs], nodes=nodes, opset_imports={"": 17},
                     name="g")
    return ir.Model(graph, ir_version=8)


def _run(model: ir.Model, feeds: dict) -> dict:
    import onnxruntime as ort

    proto = ir.serde.serialize_model(model)
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


def _feeds(dtype=np.float32) -> dict:
    rng = np.random.default_rng(0)
    return {"position_ids": np.array([[3]], np.int64), "update": rng.standard_normal((1, 2, 1, 4)).astype(dtype),
            "past_key.0": rng.standard_normal((1, 2, 8, 4)).astype(dtype),
            "past_value.0": rng.standard_normal((1, 2, 8, 4)).astype(dtype)}


def _io(model: ir.Model):
    return graphio.io_of(model)


CAST_F32 = [("Cast", [], {"to": FLOAT.value})]
CHAIN = [("Identity", [], {}),
         ("Reshape", [np.array([0, 2, -1, 4], np.int64)], {}),
         ("Transpose", [], {"perm": [0, 1, 2, 3]}),
         ("Expand", [np.array([1, 1, 1], np.int64)], {}),
         ("Cast", [], {"to": FLOAT.value})]


@pytest.mark.parametrize("no_ops", [CAST_F32, CHAIN], ids=["cast", "chain"])
def test_no_op_after_scatter_fails_inplace_before_and_passes_after(no_ops):
    model = _graph(no_ops)
    issues = inplace_issues(model, graphio.layout_of(model))
    assert [i.buffer for i in issues] == ["past_key.0", "past_key.0"]
    before_io, before = _io(model), _run(model, _feeds())
    p = RemovePassThroughPass()
    result = p(model)
    assert result.modified and p.removed == len(no_ops)
    assert inplace_issues(model, graphio.layout_of(model)) == []
    out = model.graph.outputs[1]
    assert out.name == "past_key.0_RetainedState" and out.producer().op_type == "ScatterND"
    assert _io(model) == before_io                                       # names, dtypes, shapes, order
    after = _run(model, _feeds())
    for name, arr in before.items():                                     # bit-identical
        assert arr.dtype == after[name].dtype and np.array_equal(arr, after[name]), name
    # the other reader now reads the update itself; the non-KV Cast before ``logits`` is untouched
    assert model.graph.node("reader").inputs[0] is out
    assert model.graph.outputs[0].producer().name == "logits_cast"


def test_cast_of_an_unannotated_scatter_output_is_known_from_its_data_input():
    model = _graph(CAST_F32, annotate_scatter=False)
    assert model.graph.node("scatter_past_key.0").outputs[0].dtype is None
    assert RemovePassThroughPass()(model).modified
    assert inplace_issues(model, graphio.layout_of(model)) == []


@pytest.mark.parametrize("no_ops", [
    [("Cast", [], {"to": F16.value})],                                  # a real conversion
    [("Reshape", [np.array([0, 4, -1, 2], np.int64)], {})],             # a real reshape
    [("Reshape", [np.array([0, -1, -1, 4], np.int64)], {})],            # two -1: not provably the same
    [("Transpose", [], {"perm": [0, 2, 1, 3]})],
    [("Expand", [np.array([2, 1, 1, 1], np.int64)], {})],
    [("Neg", [], {})],
], ids=["cast-f16", "reshape", "reshape-2x-1", "transpose", "expand", "neg"])
def test_nodes_that_change_values_are_kept(no_ops):
    model = _graph(no_ops)
    nodes_before = [n.name for n in model.graph]
    result = RemovePassThroughPass()(model)
    assert not result.modified
    assert [n.name for n in model.graph] == nodes_before


def test_graph_without_no_ops_is_unchanged():
    model = _graph([])
    assert inplace_issues(model, graphio.layout_of(model)) == []
    assert not RemovePassThroughPass()(model).modified


def test_float16_graph():
    model = _graph([("Cast", [], {"to": F16.value})], dtype=F16)
    before = _run(model, _feeds(np.float16))
    assert RemovePassThroughPass()(model).modified
    after = _run(model, _feeds(np.float16))
    assert all(np.array_equal(before[k], after[k]) for k in before)
    assert inplace_issues(model, graphio.layout_of(model)) == []


# ------------------------------------------------------------------------------------------------ ensures
def test_ensures_refuses_a_retained_output_left_behind_a_no_op():
    class Idle(RemovePassThroughPass):   # a pass that forgot its job
        def call(self, model):
            return ir.passes.PassResult(model, modified=False)

    with pytest.raises(PassInvariantError, match=r"^RemovePassThroughPass broke its invariant: the retained outputs "
                                                 r"past_key\.0_RetainedState are still produced by a no-op node$"):
        Idle()(_graph(CAST_F32))
    assert not Idle()(_graph([])).modified   # nothing to remove: nothing to refuse


def test_ensures_refuses_a_renamed_graph_output():
    class Renames(RemovePassThroughPass):
        def call(self, model):
            result = super().call(model)
            model.graph.outputs[0].name = "logits_renamed"
            return result

    with pytest.raises(PassInvariantError, match=r"it changed the graph outputs \(logits, past_key\.0_RetainedState, "
                                                 r"past_value\.0_RetainedState -> logits_renamed, "):
        Renames()(_graph(CAST_F32))
