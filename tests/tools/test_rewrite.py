"""`qeff-kv rewrite`: our exports and the peer's graphs, external data, every refusal, atomicity, CLI,
hypothesis round trips."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import numpy_helper

import _kv_graphs as kvg
from suite import ALL_GRAPHS
from qeff_kv.tools import check as qcheck
from qeff_kv.support import fsutil
from qeff_kv.contract import naming
from qeff_kv.errors import ContractError, ExternalDataError, GraphReadError, PrefixError, RewriteError
from qeff_kv.graph.passes import SetKVPrefixPass
from qeff_kv.tools.rewrite import rewrite
from qeff_kv_cli.main import main

INT32_MAX = 2**31 - 1
CTX_LEN = 16
PROMPT = [5, 17, 42, 99, 130, 7, 201, 64]


# ------------------------------------------------------------------------------------------------ helpers
def digest(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def graph_prefix(path: Path) -> str | None:
    from qeff_kv.graph import graphio

    return graphio.layout_of(graphio.load(path)).prefix


def patched_session(path: Path) -> ort.InferenceSession:
    """The graph with the peer's INT32_MAX "invalid index" constants set to 0 (onnxruntime rejects them)."""
    m = onnx.load(str(path))
    for g in [m.graph, *m.functions]:
        for node in g.node:
            if node.op_type != "Constant":
                continue
            for a in node.attribute:
                if a.name == "value" and a.t.data_type in (onnx.TensorProto.INT32, onnx.TensorProto.INT64):
                    arr = numpy_helper.to_array(a.t)
                    if arr.size and np.all(arr == INT32_MAX):
                        a.t.CopyFrom(numpy_helper.from_array(np.zeros_like(arr), a.t.name))
    for init in m.graph.initializer:
        if init.data_type in (onnx.TensorProto.INT32, onnx.TensorProto.INT64):
            arr = numpy_helper.to_array(init)
            if arr.size and np.all(arr == INT32_MAX):
                init.CopyFrom(numpy_helper.from_array(np.zeros_like(arr), init.name))
    return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])


def peer_feeds(sess: ort.InferenceSession) -> dict[str, np.ndarray]:
    """Prompt A at positions 0..7, batch slot 0, zero KV buffers of capacity CTX_LEN (any graph of the contract)."""
    feeds = {}
    for i in sess.get_inputs():
        if i.name == "input_ids":
            feeds[i.name] = np.array([PROMPT], dtype=np.int64)
        elif i.name == "position_ids":
            feeds[i.name] = np.arange(len(PROMPT), dtype=np.int64)[None]
        elif i.name == "batch_index":
            feeds[i.name] = np.array([[0]], dtype=np.int64)
        else:
            assert naming.parse_kv_name(i.name) is not None, i.name
            shape = [d if isinstance(d, int) else CTX_LEN if d == "ctx_len" else 1 for d in i.shape]
            feeds[i.name] = np.zeros(shape, dtype=np.float32)
    return feeds


def run_renamed(sess: ort.InferenceSession, feeds_by_base: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Run with feeds keyed by unprefixed name; return outputs keyed by unprefixed name."""
    def base(n: str) -> str:
        return naming.rename_kv(n, None) if naming.parse_kv_name(n) else n

    feeds = {i.name: feeds_by_base[base(i.name)] for i in sess.get_inputs()}
    names = [o.name for o in sess.get_outputs()]
    return {base(n): v for n, v in zip(names, sess.run(names, feeds))}


def graph_fingerprint(path: Path) -> dict:
    """Everything a rewrite must leave alone: initializers, nodes, functions, metadata, opsets, IR version."""
    m = onnx.load(str(path), load_external_data=False)
    return {
        "ir_version": m.ir_version,
        "opsets": sorted((o.domain or "", o.version) for o in m.opset_import),
        "metadata": sorted((p.key, p.value) for p in m.metadata_props),
        "initializers": sorted((i.name, hashlib.sha256(i.SerializeToString(deterministic=True)).hexdigest())
                               for i in m.graph.initializer),
        "nodes": [(n.op_type, n.domain, n.name) for n in m.graph.node],
        "functions": [(f.domain, f.name, list(f.input), list(f.output), len(f.node)) for f in m.functions],
    }


def unprefixed_signature(path: Path):
    ins, outs = kvg.io_signature(path)
    strip = lambda n: naming.rename_kv(n, None) if naming.parse_kv_name(n) else n  # noqa: E731
    return [(strip(n), t, d) for n, t, d in ins], [(strip(n), t, d) for n, t, d in outs]


# ------------------------------------------------------------------------------------ our exports and peer graphs
PEER_COUNTERPARTS = [
    ("qeff_llama_vllm.onnx", "qeff_llama_default.onnx"),
    ("qeff_llama_cb_vllm.onnx", "qeff_llama_cb_default.onnx"),
]


@pytest.mark.parametrize("prefixed, default", PEER_COUNTERPARTS)
def test_strip_gives_default_io(graphs, tmp_path, prefixed, default):
    """Stripping the prefix of a VLLM export gives the I/O of the same exporter's unprefixed export."""
    out = tmp_path / "stripped.onnx"
    res = rewrite(graphs / prefixed, out, strip=True)
    assert res.old_prefixes == ["VLLM"] and res.prefix is None
    assert kvg.io_signature(out) == kvg.io_signature(graphs / default)
    assert graph_fingerprint(out) == graph_fingerprint(graphs / prefixed)


@pytest.mark.parametrize("prefixed, default", PEER_COUNTERPARTS)
def test_add_gives_prefixed_io(graphs, tmp_path, prefixed, default):
    out = tmp_path / "vllm.onnx"
    res = rewrite(graphs / default, out, prefix="VLLM")
    assert kvg.io_signature(out) == kvg.io_signature(graphs / prefixed)
    # Exactly the KV names were renamed: 2 layers x key/value x input/output.
    expected = []
    for layer in range(2):
        for stem in naming.EXPORT_STEMS:
            expected.append((naming.kv_input_name(stem, layer), naming.kv_input_name(stem, layer, "VLLM")))
    for layer in range(2):
        for stem in naming.EXPORT_STEMS:
            expected.append((naming.kv_retained_name(stem, layer), naming.kv_retained_name(stem, layer, "VLLM")))
    assert res.renamed == expected
    assert graph_fingerprint(out) == graph_fingerprint(graphs / default)


def test_round_trip_and_check(any_graph, tmp_path):
    """Every graph: rewrite away and back gives the same I/O; each step passes check; nothing else moves."""
    graph = any_graph
    original_digest = digest(graph)
    prefix = graph_prefix(graph)
    mid, back = tmp_path / "mid.onnx", tmp_path / "back.onnx"
    if prefix is None:
        rewrite(graph, mid, prefix="VLLM")
        rewrite(mid, back, strip=True)
        expect_mid = "VLLM"
    else:
        rewrite(graph, mid, strip=True)
        rewrite(mid, back, prefix=prefix)
        expect_mid = None
    assert qcheck.check(mid, expected_prefix=expect_mid).ok, qcheck.check(mid).format_text()
    assert qcheck.check(back, expected_prefix=prefix).ok
    assert kvg.io_signature(back) == kvg.io_signature(graph)
    assert unprefixed_signature(mid) == unprefixed_signature(graph)
    assert graph_fingerprint(back) == graph_fingerprint(graph) == graph_fingerprint(mid)
    assert digest(graph) == original_digest  # input never modified


@pytest.mark.parametrize("kind, name", ALL_GRAPHS, ids=[f"{k}-{n}" for k, n in ALL_GRAPHS])
def test_round_trip_same_outputs(request, kind, name, tmp_path):
    """Semantics untouched: the rewritten graph computes the same outputs (renamed) in onnxruntime."""
    graphs = request.getfixturevalue(f"{kind}_graphs")
    graph = graphs / name
    prefix = graph_prefix(graph)
    mid = tmp_path / "mid.onnx"
    if prefix is None:
        rewrite(graph, mid, prefix="Q7")
    else:
        rewrite(graph, mid, strip=True)
    back = tmp_path / "back.onnx"
    rewrite(mid, back, prefix=prefix) if prefix else rewrite(mid, back, strip=True)
    ref_sess = patched_session(graph)
    feeds = {(naming.rename_kv(k, None) if naming.parse_kv_name(k) else k): v
             for k, v in peer_feeds(ref_sess).items()}
    ref = run_renamed(ref_sess, feeds)
    # the first reference token of the tiny model
    assert int(ref["logits"].argmax()) == (graphs.qwen2_a if "qwen2" in name else graphs.llama_a)[0]
    for path in (mid, back):
        got = run_renamed(patched_session(path), feeds)
        assert got.keys() == ref.keys()
        for k in ref:
            np.testing.assert_array_equal(got[k], ref[k], err_msg=k)


def test_subfunction_graph_runs_out_of_the_box_after_strip(peer_dir, tmp_path):
    src = peer_dir / "qeff_llama_subfn_vllm.onnx"
    out = tmp_path / "subfn.onnx"
    rewrite(src, out, strip=True)
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    assert names[2:] == [naming.kv_input_name(s, layer) for layer in range(2) for s in naming.EXPORT_STEMS]
    logits = sess.run(["logits"], peer_feeds(sess))[0]
    assert int(logits.argmax()) == 124
    # The decoder-layer function is untouched: its body keeps its own parameter names.
    fn = onnx.load(str(out)).functions[0]
    assert fn.name == "QEffLlamaDecoderLayer" and "past_key.0_VLLM" in list(fn.input)


# ------------------------------------------------------------------------------------------------ small graphs
@pytest.fixture
def small(tmp_path) -> Path:
    return kvg.save(kvg.build(3), tmp_path / "in" / "model.onnx")


def test_add_change_strip_small(small, tmp_path):
    a, b, c = tmp_path / "a.onnx", tmp_path / "b.onnx", tmp_path / "c.onnx"
    rewrite(small, a, prefix="VLLM")
    rewrite(a, b, prefix="vllmKvCache")
    res = rewrite(b, c, strip=True)
    assert res.old_prefixes == ["vllmKvCache"]
    assert kvg.io_signature(c) == kvg.io_signature(small)
    ins = [n for n, _, _ in kvg.io_signature(b)[0]]
    assert ins == ["input_ids", "kv_update"] + [naming.kv_input_name(s, i, "vllmKvCache")
                                                for i in range(3) for s in naming.EXPORT_STEMS]
    assert graph_fingerprint(c) == graph_fingerprint(small)


def test_rewrite_keeps_semantics_small(small, tmp_path):
    out = tmp_path / "out.onnx"
    rewrite(small, out, prefix="P")
    rng = np.random.default_rng(0)
    feeds = {"input_ids": np.array([[1, 2]], np.int64), "kv_update": rng.random((1, 2, 5, 4), np.float32)}
    for i in range(3):
        for s in naming.EXPORT_STEMS:
            feeds[naming.kv_input_name(s, i)] = rng.random((1, 2, 5, 4), np.float32)
    ref = run_renamed(ort.InferenceSession(str(small)), feeds)
    got = run_renamed(ort.InferenceSession(str(out)), feeds)
    for k in ref:
        np.testing.assert_array_equal(ref[k], got[k])


def test_in_place(small):
    before = small.stat().st_ino
    res = rewrite(small, prefix="VLLM", in_place=True)
    assert res.output == small and res.written
    assert graph_prefix(small) == "VLLM"
    assert small.stat().st_ino != before  # replaced by rename, not truncated and rewritten
    assert [p.name for p in small.parent.iterdir()] == ["model.onnx"]  # no temp file left


def test_in_place_noop_leaves_file(small):
    rewrite(small, prefix="VLLM", in_place=True)
    stat = small.stat()
    res = rewrite(small, prefix="VLLM", in_place=True)
    assert not res.written and res.renamed == []
    assert small.stat().st_mtime_ns == stat.st_mtime_ns and small.stat().st_ino == stat.st_ino


def test_in_place_with_other_output_refused(small, tmp_path):
    with pytest.raises(RewriteError, match="in-place rewrite of .* cannot also write to another file"):
        rewrite(small, tmp_path / "x.onnx", prefix="A", in_place=True)


def test_mixed_prefixes_made_uniform_when_asked(tmp_path):
    src = kvg.save(kvg.build(3, ["A", None, "B"]), tmp_path / "mixed.onnx")
    with pytest.raises(ContractError, match=r"mixed prefixes: 'A', \(none\), 'B'; pass --allow-mixed-prefixes"):
        rewrite(src, tmp_path / "o.onnx", strip=True)
    assert not (tmp_path / "o.onnx").exists()
    rewrite(src, tmp_path / "o.onnx", strip=True, allow_mixed=True)
    assert kvg.io_signature(tmp_path / "o.onnx") == kvg.io_signature(kvg.build(3))
    rewrite(src, tmp_path / "q.onnx", prefix="C", allow_mixed=True)
    assert graph_prefix(tmp_path / "q.onnx") == "C"


def test_atomic_write_failure_leaves_nothing(small, tmp_path, monkeypatch):
    out = tmp_path / "out" / "model.onnx"

    def boom(path):
        raise OSError("disk full")

    monkeypatch.setattr(fsutil, "_fsync", boom)
    with pytest.raises(OSError, match="disk full"):
        rewrite(small, out, prefix="VLLM")
    assert not out.exists()
    assert list(out.parent.iterdir()) == []


# ------------------------------------------------------------------------------------------------ refusals
def _refused(src: Path, dst: Path, exc, match: str, **kw):
    before = digest(src) if src.exists() else None
    with pytest.raises(exc) as ei:
        rewrite(src, dst, **kw)
    msg = str(ei.value)
    assert "\n" not in msg
    import re as _re

    assert _re.search(match, msg), msg
    assert not dst.exists()
    if before is not None:
        assert digest(src) == before
    return msg


@pytest.mark.parametrize("prefix, fragment", [
    ("", "is empty"), ("a_b", "'_' (LOW LINE)"), ("a b", "whitespace"), ("é", "non-ASCII"),
    ("ＶＬＬＭ", "FULLWIDTH"), ("x" * 65, "65 characters"), (123, "must be a string, got int")])
def test_refuse_invalid_prefix(small, tmp_path, prefix, fragment):
    import re as _re

    _refused(small, tmp_path / "o.onnx", PrefixError, _re.escape(fragment), prefix=prefix)


def test_refuse_existing_name(tmp_path):
    src = kvg.save(kvg.build(2, intermediate=[naming.kv_input_name("past_key", 0, "VLLM")]), tmp_path / "m.onnx")
    _refused(src, tmp_path / "o.onnx", RewriteError,
             r"renaming would produce 'past_key\.0_VLLM', a name that already exists in the graph", prefix="VLLM")


def test_refuse_existing_name_between_buffers(tmp_path):
    # Layer 0 carries both forms: stripping VLLM (mixed allowed) would give two buffers the same name.
    src = kvg.save(kvg.build(layer_ids=[0, 0], prefix=["VLLM", None]), tmp_path / "m.onnx")
    _refused(src, tmp_path / "o.onnx", RewriteError,
             r"renaming would produce 'past_key\.0', a name that already exists in the graph",
             strip=True, allow_mixed=True)


@pytest.mark.parametrize("kw, where, name", [
    (dict(extra_inputs=["VLLM_mask"]), "input", "VLLM_mask"),
    (dict(extra_outputs=["logitsVLLM"]), "output", "logitsVLLM"),
    (dict(initializer_inputs=["scaleVLLM"]), "input", "scaleVLLM"),
])
def test_refuse_prefix_inside_non_kv_name(tmp_path, kw, where, name):
    src = kvg.save(kvg.build(2, **kw), tmp_path / "m.onnx")
    _refused(src, tmp_path / "o.onnx", RewriteError,
             rf"prefix 'VLLM' occurs in the non-KV {where} '{name}', so the serving regex '\.\*VLLM\.\*' "
             "would select it", prefix="VLLM")


@pytest.mark.parametrize("prefix", ["logits", "input", "update", "ids"])
def test_refuse_prefix_catching_standard_names(small, tmp_path, prefix):
    _refused(small, tmp_path / "o.onnx", RewriteError, f"prefix '{prefix}' occurs in the non-KV", prefix=prefix)


def test_refuse_no_kv(tmp_path):
    src = kvg.save(kvg.build(0), tmp_path / "m.onnx")
    _refused(src, tmp_path / "o.onnx", ContractError, r"graph has no KV buffers", prefix="VLLM")


def test_refuse_mixed(tmp_path):
    src = kvg.save(kvg.build(2, ["VLLM", "OTHER"]), tmp_path / "m.onnx")
    _refused(src, tmp_path / "o.onnx", ContractError, r"KV buffers carry mixed prefixes: 'VLLM', 'OTHER'",
             prefix="VLLM")


def test_refuse_unpaired_input(tmp_path):
    src = kvg.save(kvg.build(2, drop_outputs=[naming.kv_retained_name("past_value", 1)]), tmp_path / "m.onnx")
    _refused(src, tmp_path / "o.onnx", ContractError,
             r"KV input 'past_value\.1' has no output 'past_value\.1_RetainedState'", prefix="VLLM")


def test_refuse_unpaired_output(tmp_path):
    src = kvg.save(kvg.build(2, drop_inputs=[naming.kv_input_name("past_key", 0)]), tmp_path / "m.onnx")
    _refused(src, tmp_path / "o.onnx", ContractError,
             r"KV output 'past_key\.0_RetainedState' has no input 'past_key\.0'", strip=True)


def test_refuse_not_onnx(tmp_path):
    src = tmp_path / "m.onnx"
    src.write_bytes(b"this is not a protobuf \xff\xfe" * 10)
    _refused(src, tmp_path / "o.onnx", GraphReadError, r"not an ONNX model or truncated", prefix="VLLM")


def test_refuse_empty_file(tmp_path):
    src = tmp_path / "m.onnx"
    src.write_bytes(b"")
    _refused(src, tmp_path / "o.onnx", GraphReadError, r"not an ONNX model or truncated", prefix="VLLM")


def test_refuse_truncated(graphs, tmp_path):
    data = (graphs / "qeff_llama_default.onnx").read_bytes()
    src = tmp_path / "m.onnx"
    src.write_bytes(data[: len(data) // 2])
    _refused(src, tmp_path / "o.onnx", GraphReadError, r"not an ONNX model or truncated", prefix="VLLM")


def test_refuse_missing(tmp_path):
    _refused(tmp_path / "nope.onnx", tmp_path / "o.onnx", GraphReadError, r"nope\.onnx: no such file",
             prefix="VLLM")


def test_refuse_overwriting_input(small):
    before = digest(small)
    with pytest.raises(RewriteError, match=r"output .*model\.onnx is the input file; pass --in-place to rewrite it"):
        rewrite(small, small, prefix="VLLM")
    assert digest(small) == before
    assert [p.name for p in small.parent.iterdir()] == ["model.onnx"]


def test_refuse_overwriting_input_through_hard_link(small, tmp_path):
    link = tmp_path / "link.onnx"
    os.link(small, link)
    before = digest(small)
    with pytest.raises(RewriteError, match="is the input file"):
        rewrite(small, link, prefix="VLLM")
    assert digest(small) == before == digest(link)


@pytest.mark.parametrize("kw, match", [
    (dict(prefix="A", strip=True), "either a prefix or strip, not both"),
    (dict(), "nothing to do"),
])
def test_refuse_bad_arguments(small, tmp_path, kw, match):
    _refused(small, tmp_path / "o.onnx", RewriteError, match, **kw)


def test_refuse_missing_output(small):
    with pytest.raises(RewriteError, match="no output file given"):
        rewrite(small, None, prefix="A")


def test_refuse_output_is_folder(small, tmp_path):
    (tmp_path / "d").mkdir()
    with pytest.raises(RewriteError, match="is a folder"):
        rewrite(small, tmp_path / "d", prefix="A")


# ------------------------------------------------------------------------------------------------ external data
def _external_model(folder: Path, location: str = "model.data") -> Path:
    m = kvg.build(2, extra_inputs=[])
    w = np.arange(4096, dtype=np.float32)
    m.graph.initializer.append(numpy_helper.from_array(w, "big_weight"))
    m.graph.node.append(onnx.helper.make_node("ReduceSum", ["big_weight"], ["wsum"], keepdims=0))
    m.graph.output.append(onnx.helper.make_tensor_value_info("wsum", onnx.TensorProto.FLOAT, []))
    (folder / location).parent.mkdir(parents=True, exist_ok=True)
    path = folder / "model.onnx"
    onnx.save(m, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=location,
              size_threshold=1024)
    assert (folder / location).is_file()
    return path


def _run_wsum(path: Path) -> float:
    sess = ort.InferenceSession(str(path))
    feeds = {i.name: np.zeros([d if isinstance(d, int) else 1 for d in i.shape],
                              np.int64 if i.type == "tensor(int64)" else np.float32) for i in sess.get_inputs()}
    return float(sess.run(["wsum"], feeds)[0])


@pytest.mark.parametrize("location", ["model.data", "weights/model.data"])
def test_external_same_folder_references_data(tmp_path, location):
    src = _external_model(tmp_path / "m", location)
    data_digest = digest(tmp_path / "m" / location)
    out = tmp_path / "m" / "model_vllm.onnx"
    res = rewrite(src, out, prefix="VLLM")
    assert res.external_data == [location] and res.external_data_action == "referenced"
    files = sorted(str(p.relative_to(tmp_path / "m")) for p in (tmp_path / "m").rglob("*") if p.is_file())
    assert files == sorted(["model.onnx", "model_vllm.onnx", location])
    assert _run_wsum(out) == float(np.arange(4096, dtype=np.float32).sum())
    assert digest(tmp_path / "m" / location) == data_digest
    assert qcheck.check(out, expected_prefix="VLLM").ok


@pytest.mark.parametrize("location", ["model.data", "weights/model.data"])
def test_external_other_folder_copies_data(tmp_path, location):
    src = _external_model(tmp_path / "m", location)
    out = tmp_path / "elsewhere" / "deep" / "model_vllm.onnx"
    res = rewrite(src, out, prefix="VLLM")
    assert res.external_data_action == "copied"
    copied, original = out.parent / location, tmp_path / "m" / location
    assert copied.is_file() and digest(copied) == digest(original)
    # Never a hard link or symlink: onnx refuses external data files with several links (both files would break).
    assert not copied.is_symlink() and copied.stat().st_nlink == 1 and original.stat().st_nlink == 1
    for path in (src, out):
        onnx.load(str(path))  # loads external data: raises on a hard-linked or symlinked data file
        assert qcheck.check(path).ok
    assert _run_wsum(out) == float(np.arange(4096, dtype=np.float32).sum())
    # A second rewrite into the same folder finds the same data already there and reuses it.
    rewrite(src, out.parent / "again.onnx", prefix="Q")
    assert _run_wsum(out.parent / "again.onnx") == _run_wsum(out)


def test_external_copy_keeps_holes(tmp_path):
    """A sparse data file stays sparse in the copy (and the copy never goes through Python memory)."""
    src = _external_model(tmp_path / "m")
    data = tmp_path / "m" / "model.data"
    with open(data, "r+b") as f:
        f.truncate(64 << 20)  # 64 MiB, mostly a hole after the real tensor bytes
    out = tmp_path / "o" / "out.onnx"
    rewrite(src, out, prefix="VLLM")
    copied = out.parent / "model.data"
    assert copied.stat().st_size == 64 << 20
    assert copied.stat().st_blocks * 512 <= data.stat().st_blocks * 512 + (1 << 20)
    assert _run_wsum(out) == float(np.arange(4096, dtype=np.float32).sum())


def test_external_other_folder_refuses_foreign_data_file(tmp_path):
    src = _external_model(tmp_path / "m")
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "model.data").write_bytes(b"someone else's weights")
    with pytest.raises(ExternalDataError, match=r"model\.data already exists and is not the external data"):
        rewrite(src, tmp_path / "o" / "out.onnx", prefix="VLLM")
    assert not (tmp_path / "o" / "out.onnx").exists()
    assert (tmp_path / "o" / "model.data").read_bytes() == b"someone else's weights"


def test_external_refuses_output_over_data_file(tmp_path):
    src = _external_model(tmp_path / "m")
    data = tmp_path / "m" / "model.data"
    before = digest(data)
    with pytest.raises(RewriteError, match="is the external-data file 'model.data'"):
        rewrite(src, data, prefix="VLLM")
    assert digest(data) == before


def _set_location(path: Path, location: str) -> None:
    m = onnx.load(str(path), load_external_data=False)
    for init in m.graph.initializer:
        for e in init.external_data:
            if e.key == "location":
                e.value = location
    path.write_bytes(m.SerializeToString())


@pytest.mark.parametrize("location, match", [
    ("../model.data", r"external-data location '\.\./model\.data' that escapes the model's folder"),
    ("weights/../../model.data", r"escapes the model's folder"),
    ("/etc/passwd", r"absolute external-data location '/etc/passwd'"),
])
def test_external_refuses_escaping_locations(tmp_path, location, match):
    src = _external_model(tmp_path / "m" / "inner")
    # Put a real file where an escaping path would point so only the location rule can refuse it.
    (tmp_path / "m" / "model.data").write_bytes((tmp_path / "m" / "inner" / "model.data").read_bytes())
    _set_location(src, location)
    _refused(src, tmp_path / "o" / "out.onnx", ExternalDataError, match, prefix="VLLM")
    assert not (tmp_path / "o").exists() or list((tmp_path / "o").iterdir()) == []


def test_external_truncated_data_refused(tmp_path):
    src = _external_model(tmp_path / "m")
    data = tmp_path / "m" / "model.data"
    data.write_bytes(data.read_bytes()[:100])
    _refused(src, tmp_path / "out.onnx", GraphReadError, r"truncated external data", prefix="VLLM")


# ------------------------------------------------------------------------------------------------ CLI
def test_cli_rewrite(small, tmp_path):
    out = tmp_path / "o.onnx"
    r = CliRunner().invoke(main, ["rewrite", str(small), "-o", str(out), "--kv-cache-prefix", "VLLM"])
    assert r.exit_code == 0, r.output
    assert r.output.startswith("set the KV-cache prefix to 'VLLM' (was (none)): renamed 12 input/output names")
    r = CliRunner().invoke(main, ["rewrite", str(out), "-o", str(tmp_path / "s.onnx"), "--strip-prefix", "--json"])
    assert r.exit_code == 0
    import json

    j = json.loads(r.output)
    assert j["prefix"] is None and j["old_prefixes"] == ["VLLM"] and len(j["renamed"]) == 12
    assert j["renamed"][0] == {"from": naming.kv_input_name("past_key", 0, "VLLM"),
                               "to": naming.kv_input_name("past_key", 0)}


@pytest.mark.parametrize("args, message", [
    (["--kv-cache-prefix", "a_b"], "error: KV-cache prefix 'a_b' contains '_' (LOW LINE)"),
    (["--kv-cache-prefix", "input"], "error: prefix 'input' occurs in the non-KV input 'input_ids'"),
])
def test_cli_rewrite_refusal(small, tmp_path, args, message):
    out = tmp_path / "o.onnx"
    r = CliRunner().invoke(main, ["rewrite", str(small), "-o", str(out), *args])
    assert r.exit_code == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), r.stderr
    assert not out.exists()


@pytest.mark.parametrize("args, message", [
    (["--kv-cache-prefix", "A", "--strip-prefix", "-o", "x.onnx"], "either --kv-cache-prefix or --strip-prefix"),
    (["-o", "x.onnx"], "give --kv-cache-prefix P or --strip-prefix"),
    (["--kv-cache-prefix", "A"], "give -o OUTPUT, or --in-place"),
])
def test_cli_rewrite_usage(small, args, message):
    r = CliRunner().invoke(main, ["rewrite", str(small), *args])
    assert r.exit_code == 2 and message in r.stderr


def test_cli_rewrite_in_place_and_not_over_input(small):
    r = CliRunner().invoke(main, ["rewrite", str(small), "-o", str(small), "--kv-cache-prefix", "A"])
    assert r.exit_code == 2 and "is the input file; pass --in-place" in r.stderr
    assert graph_prefix(small) is None
    r = CliRunner().invoke(main, ["rewrite", str(small), "--in-place", "--kv-cache-prefix", "A"])
    assert r.exit_code == 0 and graph_prefix(small) == "A"


# ------------------------------------------------------------------------------------------------ properties
PREFIX = st.from_regex(r"[A-Za-z0-9]{1,12}", fullmatch=True).filter(lambda p: "RetainedState" not in p)


def _io_names(model: ir.Model) -> tuple[list[str], list[str]]:
    return [v.name for v in model.graph.inputs], [v.name for v in model.graph.outputs]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layers=st.integers(1, 4), group=st.sampled_from(naming.STEM_GROUPS), p0=st.one_of(st.none(), PREFIX),
       q=PREFIX)
def test_property_add_change_strip(layers, group, p0, q):
    proto = kvg.build(layers, p0, stems=group, extra_inputs=["attn_mask"])
    model = ir.serde.deserialize_model(proto)
    orig_in, orig_out = _io_names(model)
    non_kv = [n for n in orig_in + orig_out if naming.parse_kv_name(n) is None]   # the stem group's own inputs too
    if any(q in n for n in non_kv):
        with pytest.raises(RewriteError, match=f"prefix '{q}' occurs in the non-KV"):
            SetKVPrefixPass(q)(model)
        assert _io_names(model) == (orig_in, orig_out)  # refused before any rename
        return
    SetKVPrefixPass(q)(model)
    new_in, new_out = _io_names(model)
    for a, b in zip(orig_in + orig_out, new_in + new_out):
        pa = naming.parse_kv_name(a)
        if pa is None:
            assert a == b
        else:
            assert b == pa.with_prefix(q).name
    assert qcheck.check_model(model, expected_prefix=q).ok
    # strip, then back to p0: exactly the original signature
    SetKVPrefixPass(None)(model)
    assert kvg.io_signature(ir.serde.serialize_model(model)) == kvg.io_signature(kvg.build(layers, None, stems=group,
                                                                                              extra_inputs=["attn_mask"]))
    if p0 is not None and any(p0 in n for n in non_kv):
        # The generated graph already broke the substring rule; putting p0 back is refused, nothing renamed.
        before = kvg.io_signature(ir.serde.serialize_model(model))
        with pytest.raises(RewriteError, match=f"prefix '{p0}' occurs in the non-KV"):
            SetKVPrefixPass(p0)(model)
        assert kvg.io_signature(ir.serde.serialize_model(model)) == before
        return
    if p0 is not None:
        SetKVPrefixPass(p0)(model)
    assert kvg.io_signature(ir.serde.serialize_model(model)) == kvg.io_signature(proto)


# ------------------------------------------------------------------------------------------------ our exports
@pytest.fixture(scope="session")
def our_exports(tmp_path_factory):
    from suite import HAS_TORCH

    if not HAS_TORCH:
        pytest.skip("needs the [export] extra (torch, transformers) to export the bundled model")
    from qeff_kv.export.api import export_model

    base = tmp_path_factory.mktemp("exports")
    plain = export_model(None, base / "plain", ctx_len=CTX_LEN, prefill_seq_len=8).onnx_path
    vllm = export_model(None, base / "vllm", ctx_len=CTX_LEN, prefill_seq_len=8, kv_cache_prefix="VLLM").onnx_path
    return plain, vllm


@pytest.mark.export
def test_our_exports_rewrite_to_each_other(our_exports, tmp_path):
    plain, vllm = our_exports
    for path, prefix in ((plain, None), (vllm, "VLLM")):
        assert qcheck.check(path, expected_prefix=prefix).ok, qcheck.check(path).format_text()
    added, stripped = tmp_path / "added.onnx", tmp_path / "stripped.onnx"
    rewrite(plain, added, prefix="VLLM")
    rewrite(vllm, stripped, strip=True)
    assert kvg.io_signature(added) == kvg.io_signature(vllm)
    assert kvg.io_signature(stripped) == kvg.io_signature(plain)
    sess = ort.InferenceSession(str(plain))
    feeds = peer_feeds(sess)
    ref = run_renamed(sess, feeds)
    for path in (added, stripped):
        got = run_renamed(ort.InferenceSession(str(path)), feeds)
        for k in ref:
            np.testing.assert_array_equal(got[k], ref[k], err_msg=k)
