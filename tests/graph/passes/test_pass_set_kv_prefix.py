"""SetKVPrefixPass: every KV buffer (input and its ``_RetainedState`` output together) takes exactly the asked
prefix, or loses it; every other input, output, node and value is as it was; a prefix the serving regex would
catch in a non-KV name is refused with nothing renamed; its ``ensures`` refuses a graph left with another prefix
or a changed non-KV input/output. The suite's small retained-state graphs (``tests/helpers/_kv_graphs.py``), no torch.
(The ``rewrite`` command built on it is tested in ``tests/tools/test_rewrite.py``.)"""

from __future__ import annotations

import onnx_ir as ir
import pytest

import _kv_graphs
from qeff_kv.errors import PassInvariantError, RewriteError
from qeff_kv.graph.graphio import layout_of
from qeff_kv.graph.passes import SetKVPrefixPass


def _model(prefix=None, **kw) -> ir.Model:
    return ir.serde.deserialize_model(_kv_graphs.build(2, prefix, **kw))


def _names(model: ir.Model) -> tuple[list[str], list[str]]:
    return [v.name for v in model.graph.inputs], [v.name for v in model.graph.outputs]


def test_every_kv_buffer_takes_the_prefix_and_nothing_else_changes():
    model = _model()
    nodes = [n.name for n in model.graph]
    assert SetKVPrefixPass("VLLM")(model).modified
    ins, outs = _names(model)
    assert ins == ["input_ids", "kv_update", "past_key.0_VLLM", "past_value.0_VLLM", "past_key.1_VLLM",
                   "past_value.1_VLLM"]
    assert outs == ["logits"] + [f"{n}_RetainedState" for n in ins[2:]]
    assert [n.name for n in model.graph] == nodes and layout_of(model).prefixes == ["VLLM"]


def test_none_strips_the_prefix_and_the_same_prefix_changes_nothing():
    model = _model("VLLM")
    assert not SetKVPrefixPass("VLLM")(model).modified
    assert SetKVPrefixPass(None)(model).modified and layout_of(model).prefixes == [None]
    assert _names(model) == _names(_model())


def test_a_prefix_the_regex_would_catch_in_a_non_kv_name_is_refused_untouched():
    model = _model()
    before = _names(model)
    with pytest.raises(RewriteError, match=r"^prefix 'update' occurs in the non-KV input 'kv_update', so the "
                                           r"serving regex '\.\*update\.\*' would select it$"):
        SetKVPrefixPass("update")(model)
    assert _names(model) == before


def test_ensures_refuses_buffers_left_without_the_prefix():
    class Idle(SetKVPrefixPass):
        def call(self, model):
            return ir.passes.PassResult(model, modified=False)

    with pytest.raises(PassInvariantError, match=r"^SetKVPrefixPass broke its invariant: prefixes \[None\], "
                                                 r"unpaired \[\]$"):
        Idle("VLLM")(_model())


def test_ensures_refuses_a_renamed_non_kv_output():
    class Renames(SetKVPrefixPass):
        def call(self, model):
            result = super().call(model)
            model.graph.outputs[0].name = "scores"
            return result

    with pytest.raises(PassInvariantError, match=r"^SetKVPrefixPass broke its invariant: it changed a graph input or "
                                                 r"output that is not a KV buffer$"):
        Renames("VLLM")(_model())
