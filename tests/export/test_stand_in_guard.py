"""The stand-ins' guards (qeff_kv/export/weights/stand_ins.py, issue 51): a streamed capture never carries a
stand-in's value, whatever verification would say.

* the constant folding: arithmetic on a weight stays in the graph (Gemma's ``1 + w``, a product of two views of
  a weight: unchanged when both stand-ins change sign, which the old negation test missed), and a fold that still
  depends on a stand-in refuses the capture;
* Python reads of a stand-in's value while tracing are refused;
* the streamed reference gives an operation the checkpoint's tensor where a model reads a child's weight outside
  the child's forward (LFM2's short convolution, JetMoe's attention experts).

The families these cover end to end (DiffLlama, JetMoe, LFM2, Gemma) stream in the family matrix
(tests/export/test_families.py asserts that every exact cell streamed).
"""

from __future__ import annotations

import numpy as np
import pytest

from suite import requires_torch

pytestmark = [requires_torch]


def _plan_of(module):
    """A plan whose stand-ins replace ``module``'s parameters (keys: their names), tagged with distinct values."""
    import torch

    from qeff_kv.export.weights import stream

    the_plan = stream.Plan()
    for i, (name, p) in enumerate(list(module.named_parameters())):
        owner = module.get_submodule(name.rpartition(".")[0]) if "." in name else module
        standin = torch.nn.Parameter(stream.stand_in(p.shape, p.dtype, value=float(i + 2)), requires_grad=False)
        owner._parameters[name.rpartition(".")[2]] = standin
        ptr = standin.untyped_storage().data_ptr()
        the_plan.keys[ptr], the_plan.shapes[ptr], the_plan.names[ptr] = name, tuple(p.shape), name
        the_plan.params.append(standin)
        the_plan.dtype = p.dtype
    return the_plan


def _capture(module, the_plan, path):
    import torch

    from qeff_kv.export.weights.stand_ins import recorded_parameters

    with recorded_parameters(the_plan) as box:
        torch.onnx.export(module, (torch.ones(2, 4),), str(path), dynamo=False, export_params=False,
                          do_constant_folding=True, opset_version=17)
    return box


class _Product:
    """``x @ (W.T * W.T)``: the transposes are views (folded, allowed), their product a fold of stand-ins."""

    @staticmethod
    def make():
        import torch

        class M(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.w = torch.nn.Parameter(torch.randn(4, 4))

            def forward(self, x):
                return x @ (self.w.t() * self.w.t())

        return M().eval()


def test_a_product_of_two_views_stays_in_the_graph(tmp_path):
    """``W.T * W.T`` reads the weight through views: it is not folded (the negation test this guard replaced missed
    it: the product is unchanged when both factors change sign); the graph multiplies the real weight."""
    import onnx

    module = _Product.make()
    the_plan = _plan_of(module)
    box = _capture(module, the_plan, tmp_path / "m.onnx")
    assert [t.untyped_storage().data_ptr() in the_plan.keys for t in box["params"].values()] == [True]
    ops = [n.op_type for n in onnx.load(tmp_path / "m.onnx").graph.node]
    assert ops.count("Mul") == 1 and "Transpose" in ops


def test_the_guard_refuses_a_fold_that_depends_on_a_stand_in(tmp_path, monkeypatch):
    """The backstop: were the analysis of what may fold to miss a computation (here: told that nothing is
    computed from a stand-in), the second folding without stand-ins finds the product and refuses the capture."""
    from qeff_kv.errors import ExportError
    from qeff_kv.export.weights import stand_ins
    from qeff_kv.export.weights.stand_ins import StandInValue

    module = _Product.make()
    the_plan = _plan_of(module)
    monkeypatch.setattr(stand_ins, "computed_from", lambda *_args: set())
    with pytest.raises(StandInValue, match=r"^the constant folding computed \S+ \(and 0 more\) from a weight's "
                                           r"stand-in$"):
        _capture(module, the_plan, tmp_path / "m.onnx")
    assert issubclass(StandInValue, ExportError)


def test_arithmetic_on_a_weight_stays_in_the_graph(tmp_path):
    """Gemma's ``x * (1 + w)``: ``w`` stays a parameter (its initializer is the checkpoint's), the ``Add`` a node."""
    import onnx
    import torch

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4))

        def forward(self, x):
            return x * (1.0 + self.w)

    module = M().eval()
    the_plan = _plan_of(module)
    box = _capture(module, the_plan, tmp_path / "m.onnx")
    stand_ins = {name for name, t in box["params"].items() if t.untyped_storage().data_ptr() in the_plan.keys}
    assert len(stand_ins) == 1 and len(box["params"]) == 1
    graph = onnx.load(tmp_path / "m.onnx").graph
    (name,) = stand_ins
    assert [n.op_type for n in graph.node if name in n.input] == ["Add"]


def test_a_python_read_of_a_weight_while_tracing_is_refused(tmp_path):
    import torch

    from qeff_kv.export.weights.stand_ins import StandInValue

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4))

        def forward(self, x):
            scale = float(self.w.abs().sum())   # a weight's value baked into the trace
            return x * scale

    module = M().eval()
    the_plan = _plan_of(module)
    with pytest.raises(StandInValue, match=r"^the model reads a value computed from w in Python while it is "
                                           r"traced$"):
        _capture(module, the_plan, tmp_path / "m.onnx")


class _Store:
    """A checkpoint of arrays by key (what :func:`.stream.streamed_weights` reads)."""

    def __init__(self, arrays: dict):
        self.arrays = arrays
        self.reads: list[str] = []

    def array(self, key, dtype):
        self.reads.append(key)
        return self.arrays[key].copy()


def test_the_reference_reads_a_weight_used_outside_its_module(tmp_path):
    """The parent reads ``conv.weight`` itself (as LFM2's decode step does): the reference computes with the
    checkpoint's weight, equal to the model with its real weights."""
    import torch

    from qeff_kv.export.weights import stream

    class Parent(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Linear(4, 4, bias=False)
            self.own = torch.nn.Linear(4, 4, bias=False)

        def forward(self, x):
            return self.own(x) + x @ self.conv.weight.t()

    torch.manual_seed(0)
    real = Parent().eval()
    x = torch.randn(3, 4)
    with torch.no_grad():
        want = real(x)
    store = _Store({name: p.detach().numpy().copy() for name, p in real.named_parameters()})
    skel = Parent().eval()
    the_plan = _plan_of(skel)
    with torch.no_grad(), stream.streamed_weights(skel, the_plan, store):
        got = skel(x)
    np.testing.assert_array_equal(got.numpy(), want.numpy())
    assert sorted(set(store.reads)) == ["conv.weight", "own.weight"]
    with torch.no_grad():   # outside the guard the stand-in's values are what the parent would read
        assert not torch.equal(skel(x), want)


def test_a_strided_choice_of_rows_is_read_back_as_that_view():
    """MLA's per-head halves of ``kv_b_proj`` (``weight.view(H, n + v, r)[:, :n]``, maybe transposed) fold to views
    whose strides name the rows they show: read back from the checkpoint, they equal the same ops on the weight."""
    import torch

    from qeff_kv.export.weights import stream
    from qeff_kv.export.weights.views import read_rows, row_view

    heads, nope, v, r = 3, 4, 2, 5
    real = torch.arange(heads * (nope + v) * r, dtype=torch.float32).reshape(heads * (nope + v), r)
    stand = stream.stand_in(real.shape, torch.float32)
    for op in (lambda w: w.view(heads, nope + v, r)[:, :nope], lambda w: w.view(heads, nope + v, r)[:, nope:],
               lambda w: w.view(heads, nope + v, r)[:, nope:].transpose(1, 2), lambda w: w.t()):
        view = row_view(op(stand), tuple(real.shape))
        assert view is not None
        np.testing.assert_array_equal(read_rows(real.numpy(), view), op(real).numpy())
    assert row_view(stand.reshape(-1)[:3], tuple(real.shape)) is None   # the last axis cut: not a row view
