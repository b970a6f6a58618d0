"""The export's pass pipeline (``qeff_kv.export.graph_passes.pipeline``): one ``ir.passes.Sequential`` per target
and options, made from the pass classes the target registry lists (each an :class:`InvariantPass` whose
``ensures`` checks its invariant), filtered by the dtypes each pass applies to; a pass's typed refusal leaves the
pipeline as it is (not wrapped in onnx_ir's ``PassError``). No torch."""

from __future__ import annotations

import onnx_ir as ir
import pytest

import _kv_graphs
from qeff_kv.errors import RewriteError
from qeff_kv.export import graph_passes, targets
from qeff_kv.export.options import ExportOptions
from qeff_kv.graph.passes import (FoldLayoutPairsPass, FuseSkipRMSNormPass, GateVisionEncoderPass, PackGQAQKVPass,
                                  PackSharedInputMatMulsPass, RemovePassThroughPass, SetKVPrefixPass)
from qeff_kv.graph.passes._invariants import InvariantPass

FUSED = [PackGQAQKVPass, FuseSkipRMSNormPass, FoldLayoutPairsPass, PackSharedInputMatMulsPass]


def _classes(**kw) -> list[type]:
    passes = graph_passes.pipeline(ExportOptions(ctx_len=16, prefill_seq_len=4, **kw))
    assert isinstance(passes, ir.passes.Sequential)
    return [type(p) for p in passes.passes]


def test_the_registry_lists_pass_classes_with_ensures():
    assert list(targets.info("onnxruntime-fused").passes) == FUSED
    for name in targets.NAMES:
        for cls in targets.info(name).passes:
            assert issubclass(cls, InvariantPass) and cls.ensures is InvariantPass.ensures


@pytest.mark.parametrize("target, dtype, single, prefix, expected", [
    ("portable", "float32", False, None, [RemovePassThroughPass]),
    ("onnxruntime", "float32", False, None, [RemovePassThroughPass]),
    ("onnxruntime-fused", "float32", False, None, [RemovePassThroughPass] + FUSED),
    ("onnxruntime-fused", "float16", False, None,
     [RemovePassThroughPass, PackGQAQKVPass, FoldLayoutPairsPass, PackSharedInputMatMulsPass]),
    ("portable", "float32", True, "VLLM", [RemovePassThroughPass, SetKVPrefixPass]),   # portable keeps the plain graph
    ("onnxruntime", "float32", True, "VLLM", [RemovePassThroughPass, GateVisionEncoderPass, SetKVPrefixPass]),
    ("onnxruntime-fused", "float32", True, None, [RemovePassThroughPass] + FUSED + [GateVisionEncoderPass]),
])
def test_one_sequential_per_target_and_options(target, dtype, single, prefix, expected):
    assert _classes(target=target, dtype=dtype, single_graph=single, kv_cache_prefix=prefix) == expected


def test_a_pass_refusal_leaves_the_pipeline_as_it_is():
    model = ir.serde.deserialize_model(_kv_graphs.build(2))
    passes = graph_passes.pipeline(ExportOptions(ctx_len=16, prefill_seq_len=4, kv_cache_prefix="update"))
    with pytest.raises(RewriteError, match=r"^prefix 'update' occurs in the non-KV input 'kv_update'"):
        passes(model)


def test_a_bug_in_a_pass_is_onnx_irs_pass_error():
    class Broken(RemovePassThroughPass):
        def call(self, model):
            raise KeyError("a bug")

    with pytest.raises(ir.passes.PassError):
        graph_passes.Pipeline(Broken())(ir.serde.deserialize_model(_kv_graphs.build(1)))
