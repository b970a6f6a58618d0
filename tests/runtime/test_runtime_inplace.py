"""A graph that is not in-place safe runs correctly with separate output buffers, and says so."""

from __future__ import annotations

import warnings

import onnx
import pytest
from onnx import TensorProto, helper

from qeff_kv.errors import ContractError
from qeff_kv.runtime import Session

V = 5


def _toy(path, *, unsafe: bool):
    """next token = (sum of every token fed so far) mod 5, computed from the cache.

    The safe variant reads the scattered cache; the unsafe one reads the raw ``past_key.0`` input (and
    adds the new tokens itself): correct with separate buffers, wrong if the update already happened.
    """
    kv = ["batch_size", 1, "ctx_len", 1]
    inputs = [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", "seq_len"]),
        helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch_size", "seq_len"]),
        helper.make_tensor_value_info("past_key.0", TensorProto.FLOAT, kv),
        helper.make_tensor_value_info("past_value.0", TensorProto.FLOAT, kv),
    ]
    outputs = [
        helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch_size", "one", "vocab"]),
        helper.make_tensor_value_info("past_key.0_RetainedState", TensorProto.FLOAT, kv),
        helper.make_tensor_value_info("past_value.0_RetainedState", TensorProto.FLOAT, kv),
    ]
    inits = [
        helper.make_tensor("axes_last", TensorProto.INT64, [1], [-1]),
        helper.make_tensor("zero", TensorProto.INT64, [], [0]),
        helper.make_tensor("vocab", TensorProto.FLOAT, [], [float(V)]),
        helper.make_tensor("arange", TensorProto.FLOAT, [V], list(map(float, range(V)))),
        helper.make_tensor("shape_out", TensorProto.INT64, [3], [1, 1, V]),
    ]
    nodes = [
        helper.make_node("Unsqueeze", ["position_ids", "axes_last"], ["p"]),
        helper.make_node("Mul", ["p", "zero"], ["z"]),
        helper.make_node("Concat", ["z", "z", "p"], ["idx"], axis=-1),
        helper.make_node("Cast", ["input_ids"], ["ids_f"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["ids_f", "axes_last"], ["upd"]),
        helper.make_node("ScatterND", ["past_key.0", "idx", "upd"], ["past_key.0_RetainedState"]),
        helper.make_node("ScatterND", ["past_value.0", "idx", "upd"], ["past_value.0_RetainedState"]),
    ]
    if unsafe:
        nodes += [helper.make_node("ReduceSum", ["past_key.0"], ["raw"], keepdims=0),
                  helper.make_node("ReduceSum", ["ids_f"], ["new"], keepdims=0),
                  helper.make_node("Add", ["raw", "new"], ["total"])]
    else:
        nodes += [helper.make_node("ReduceSum", ["past_value.0_RetainedState"], ["total"], keepdims=0)]
    nodes += [
        helper.make_node("Mod", ["total", "vocab"], ["m"], fmod=1),
        helper.make_node("Sub", ["arange", "m"], ["d"]),
        helper.make_node("Abs", ["d"], ["ad"]),
        helper.make_node("Neg", ["ad"], ["nd"]),
        helper.make_node("Reshape", ["nd", "shape_out"], ["logits"]),
    ]
    graph = helper.make_graph(nodes, "toy", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def _expected(prompt, n):
    total, out = sum(prompt), []
    for _ in range(n):
        t = int(total % V)
        out.append(t)
        total += t
    return out


@pytest.mark.parametrize("unsafe", [False, True])
def test_toy_graph_tokens(tmp_path, unsafe):
    path = _toy(tmp_path / "toy.onnx", unsafe=unsafe)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s = Session(path, ctx_len=12, prefill_seq_len=4)
    assert s.inplace is (not unsafe)
    assert bool(s.inplace_issues) is unsafe
    said = [w for w in caught if "not in-place safe" in str(w.message)]
    assert bool(said) is unsafe
    if unsafe:
        assert "ReduceSum" in s.inplace_issues[0]
        assert s.describe()["inplace"] is False
    [g] = s.generate([[1, 2, 3, 4, 0, 2]], max_new_tokens=6, stop_tokens=[])
    assert g.tokens == _expected([1, 2, 3, 4, 0, 2], 6)


def test_unsafe_graph_refused_when_inplace_demanded(tmp_path):
    path = _toy(tmp_path / "toy.onnx", unsafe=True)
    with pytest.raises(ContractError, match="not in-place safe"):
        Session(path, ctx_len=12, prefill_seq_len=4, inplace=True)


def test_separate_buffers_can_be_forced(tmp_path):
    path = _toy(tmp_path / "toy.onnx", unsafe=False)
    s = Session(path, ctx_len=12, prefill_seq_len=4, inplace=False)
    assert not s.inplace and s.cache.positional.double_buffer
    [g] = s.generate([[3, 3]], max_new_tokens=5, stop_tokens=[])
    assert g.tokens == _expected([3, 3], 5)
