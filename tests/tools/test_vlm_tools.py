"""Graph tools on vision-language graphs (issue 10, items 3 and 5; contract section 6): ``check``, ``rewrite``,
``buffers`` and ``compile-config`` on our Llava/Gemma3 exports (dual and single layout) and on hand-made peer-style
graphs (tests/helpers/_kv_graphs.py ``build_vlm``, ``build_vision_encoder``).

The prefix is on the language KV only; ``vision_embeds``, ``pixel_values`` and ``image_idx``/``image_idx_output``
are never renamed, and ``.*VLLM.*`` selects exactly the KV.
"""

from __future__ import annotations

import json

import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto

import _kv_graphs as kvg
from suite import requires_torch
from qeff_kv.tools import check as qcheck
from qeff_kv.contract import naming
from qeff_kv.tools.buffers import buffers_report
from qeff_kv.tools.compile_from_graph import write_compile_config_for_graph
from qeff_kv.tools.compile_config import specializations, vision_specializations, vision_symbols
from qeff_kv.errors import ContractError, RewriteError, RuntimeInputError
from qeff_kv.tools.rewrite import rewrite
from qeff_kv_cli.main import main

RULE_IDS = ["kv-present", "pairing", "pair-match", "layers", "prefix", "regex-exact", "regex-substring",
            "non-kv-unprefixed", "inplace", "sidecar", "lora", "onnx-checker"]
CTX, CHUNK = 48, 4


def _kv(prefix, layers=2):
    ins = [naming.kv_input_name(s, i, prefix) for i in range(layers) for s in ("past_key", "past_value")]
    return ins, [naming.retained_name(n) for n in ins]


def _io(path):
    m = onnx.load(str(path), load_external_data=False)
    inits = {i.name for i in m.graph.initializer}
    return [i.name for i in m.graph.input if i.name not in inits], [o.name for o in m.graph.output]


def _pairs(text: str) -> tuple[list, list]:
    """``(inputs, outputs)`` of a ``custom_io.yaml``: ``(IOName, Precision)`` pairs under each heading, in order
    (every other line blank)."""
    lists: dict[str, list] = {"# Model Inputs": [], "# Model Outputs": []}
    current = None
    lines = text.split("\n")
    for i, line in enumerate(lines):
        if line in lists:
            current = lists[line]
        elif line.startswith(" - IOName: "):
            prec = lines[i + 1]
            assert prec.startswith("   Precision: ") and lines[i + 2] == "", text
            current.append((line[len(" - IOName: "):], prec[len("   Precision: "):]))
        else:
            assert line == "" or line.startswith("   Precision: "), line
    return lists["# Model Inputs"], lists["# Model Outputs"]


def _violations(report):
    return [(v.rule, v.buffer, v.message) for v in report.violations]


def _one_line_error(res, message: str):
    assert res.exit_code == 2, res.output
    assert res.stderr == f"error: {message}\n"


# ------------------------------------------------------------------------------------------------ our exports
@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    pytest.importorskip("torch")
    from hf_models import make_gemma3_vlm_dir, make_llava_dir

    from qeff_kv.export import export_model

    root = tmp_path_factory.mktemp("vlm_tools")
    llava = make_llava_dir(root / "llava")
    gemma3 = make_gemma3_vlm_dir(root / "gemma3")
    cache: dict = {}

    def get(model: str, single: bool):
        if (model, single) not in cache:
            src, chunk = (llava, CHUNK) if model == "llava" else (gemma3, 16)
            cache[(model, single)] = export_model(src, root / f"{model}-{'single' if single else 'dual'}",
                                                  ctx_len=CTX, prefill_seq_len=chunk, single_graph=single,
                                                  kv_cache_prefix="VLLM", verify=False)
        return cache[(model, single)]

    return get


LLAVA_LANG_SPEC = {"batch_size": "1", "seq_len": "4", "ctx_len": "48", "img_size": "32", "vision_size": "16",
                   "vision_batch_size": "1"}


@requires_torch
def test_export_writes_the_dual_layout_compile_files(exports):
    res = exports("llava", False)
    d = res.out_dir
    kv_in, kv_out = _kv("VLLM")
    assert _pairs((d / "custom_io.yaml").read_text()) == (
        [("vision_embeds", "float32")] + [(n, "float16") for n in kv_in],
        [("vision_embeds_RetainedState", "float32")] + [(n, "float16") for n in kv_out])
    assert json.loads((d / "specializations.json").read_text()) == {"specializations": [
        LLAVA_LANG_SPEC, {**LLAVA_LANG_SPEC, "seq_len": "1"}]}
    assert _pairs((d / "custom_io_vision.yaml").read_text()) == ([("pixel_values", "float32")],
                                                              [("vision_embeds", "float32")])
    assert json.loads((d / "specializations_vision.json").read_text()) == {
        "specializations": [{"batch_size": "1", "img_size": "32"}]}


@requires_torch
def test_export_writes_the_single_layout_compile_files(exports):
    res = exports("llava", True)
    d = res.out_dir
    kv_in, kv_out = _kv("VLLM")
    assert _pairs((d / "custom_io.yaml").read_text()) == (
        [("pixel_values", "float32")] + [(n, "float16") for n in kv_in],
        [("pixel_values_RetainedState", "float32")] + [(n, "float16") for n in kv_out])
    entry = {"batch_size": "1", "seq_len": "4", "ctx_len": "48", "img_size": "32", "vision_batch_size": "1"}
    assert json.loads((d / "specializations.json").read_text()) == {"specializations": [
        entry, {**entry, "seq_len": "1"}]}
    assert not (d / "custom_io_vision.yaml").exists() and not (d / "specializations_vision.json").exists()


@requires_torch
def test_cli_compile_config_gemma3_named_with_a_vision_entry(exports, tmp_path):
    res = exports("gemma3", False)
    out = tmp_path / "build"
    r = CliRunner().invoke(main, ["compile-config", str(res.onnx_path), "-o", str(out), "--prefill-seq-len", "16",
                                  "--ctx-len", "48", "--specializations-format", "named", "--vision-precision",
                                  "float16", "--vision-batch-size", "2", "--max-num-images", "2"])
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines() == [f"wrote {out / n}" for n in ("custom_io.yaml", "specializations.json",
                                                                  "custom_io_vision.yaml",
                                                                  "specializations_vision.json")]
    sym = {"batch_size": "1", "seq_len": "16", "ctx_len": "48", "sliding_window": "24", "max_num_images": "2",
           "img_size": "32", "vision_size": "16", "vision_batch_size": "2"}
    assert json.loads((out / "specializations.json").read_text()) == {"specializations": [
        {"name": "Prefill", "symbols": sym}, {"name": "Decode", "symbols": {**sym, "seq_len": "1"}}]}
    assert json.loads((out / "specializations_vision.json").read_text()) == {"specializations": [
        {"name": "Vision", "symbols": {"batch_size": "2", "max_num_images": "2", "img_size": "32"}}]}
    kv_in, kv_out = _kv("VLLM")
    assert _pairs((out / "custom_io.yaml").read_text()) == (
        [("vision_embeds", "float16")] + [(n, "float16") for n in kv_in],
        [("vision_embeds_RetainedState", "float16")] + [(n, "float16") for n in kv_out])
    assert _pairs((out / "custom_io_vision.yaml").read_text()) == ([("pixel_values", "float16")],
                                                                [("vision_embeds", "float16")])


@requires_torch
def test_compile_config_refusals_on_our_exports(exports, tmp_path):
    dual, single = exports("llava", False), exports("llava", True)
    kw = dict(prefill_seq_len=4, ctx_len=48)
    with pytest.raises(RuntimeInputError, match=r"^img_size 64 differs from the export's manifest.json "
                                                r"vision.image_size = 32 \(the graph was traced for it\)$"):
        write_compile_config_for_graph(dual.onnx_path, tmp_path / "a", img_size=64, **kw)
    vision = dual.out_dir / dual.manifest["vision_onnx"]
    with pytest.raises(ContractError, match=r"^.*tiny-llava_vision.onnx is a vision encoder graph \(pixel_values -> "
                                            r"vision_embeds; no KV buffers, nothing retained\); give the language "
                                            r"graph as MODEL and this one as --vision-model$"):
        write_compile_config_for_graph(vision, tmp_path / "b", **kw)
    with pytest.raises(RuntimeInputError, match=r"^the single layout has no vision graph"):
        write_compile_config_for_graph(single.onnx_path, tmp_path / "c", vision_model=vision, **kw)
    with pytest.raises(ContractError, match=r"^vision graph is not a vision encoder graph"):
        write_compile_config_for_graph(dual.onnx_path, tmp_path / "d", vision_model=single.onnx_path, **kw)
    r = CliRunner().invoke(main, ["compile-config", str(dual.onnx_path), "-o", str(tmp_path / "e"),
                                  "--prefill-seq-len", "4", "--ctx-len", "48", "--vision-precision", "mxint8"])
    assert r.exit_code == 2 and "--vision-precision" in r.stderr
    assert not any((tmp_path / x).exists() for x in "abcde")


@requires_torch
@pytest.mark.parametrize("single", [False, True], ids=["dual", "single"])
def test_check_our_exports(exports, single):
    res = exports("llava", single)
    report = qcheck.check(res.onnx_path, expected_prefix="VLLM")
    assert report.ok, report.format_text()
    j = report.to_json()
    assert j["vision_language"] == ("single" if single else "dual")
    assert j["summary"] == {"pass": 10, "fail": 0, "skip": 2}   # sidecar: none beside; lora: no adapters
    assert [r["id"] for r in j["rules"]] == RULE_IDS
    if not single:
        v = qcheck.check(res.out_dir / res.manifest["vision_onnx"], expected_prefix="VLLM")
        assert v.ok and v.to_json()["vision_language"] == "vision-encoder"
        assert [(r.id, r.status) for r in v.rules] == [
            ("kv-present", "skip"), ("pairing", "pass"), ("pair-match", "pass"), ("layers", "skip"),
            ("prefix", "skip"), ("regex-exact", "skip"), ("regex-substring", "skip"), ("non-kv-unprefixed", "pass"),
            ("inplace", "skip"), ("sidecar", "skip"), ("lora", "skip"), ("onnx-checker", "pass")]
        # the command line: both graphs of the folder, with the prefix
        r = CliRunner().invoke(main, ["check", str(res.onnx_path), str(res.out_dir / res.manifest["vision_onnx"]),
                                      "--kv-cache-prefix", "VLLM"])
        assert r.exit_code == 0, r.output


@requires_torch
@pytest.mark.parametrize("single", [False, True], ids=["dual", "single"])
@pytest.mark.parametrize("model", ["llava", "gemma3"])
def test_rewrite_our_exports_renames_only_the_language_kv(exports, model, single, tmp_path):
    res = exports(model, single)
    ins0, outs0 = _io(res.onnx_path)
    vis = "pixel_values" if single else "vision_embeds"
    assert ins0[:4] == (["input_ids", "position_ids", vis, "image_idx"] if single
                        else ["input_ids", vis, "position_ids", "image_idx"])
    assert outs0[:3] == ["logits", naming.retained_name(vis), "image_idx_output"]
    src = res.onnx_path
    for step, (prefix, strip) in enumerate([("vllmKvCache", False), (None, True), ("P2", False)]):
        dst = tmp_path / f"r{step}" / src.name
        result = rewrite(src, dst, prefix=prefix, strip=strip)
        ins, outs = _io(dst)
        kv_in, kv_out = _kv(prefix)
        assert ins == ins0[:4] + kv_in and outs == outs0[:3] + kv_out
        assert sorted(b for _, b in result.renamed) == sorted(kv_in + kv_out)
        report = qcheck.check(dst, expected_prefix=prefix)
        assert report.ok, report.format_text()
        if prefix is not None:
            assert naming.select(f".*{prefix}.*", ins + outs) == kv_in + kv_out
        src = dst


@requires_torch
def test_buffers_on_an_export_folder(exports):
    res = exports("llava", False)
    report = buffers_report(res.out_dir, regex=".*VLLM.*", ctx_len=48)
    j = report.to_json()
    kv_in, kv_out = _kv("VLLM")
    assert j["model"] == str(res.onnx_path) and j["vision_language"] == "dual"
    assert j["non_kv_retained"] == [{"input": "vision_embeds", "retained": "vision_embeds_RetainedState"},
                                    {"input": "image_idx", "retained": "image_idx_output"}]
    assert j["selection"] == {"regex": ".*VLLM.*", "selected": kv_in + kv_out, "equals_kv_set": True,
                              "selects_non_kv": [], "misses_kv": []}
    text = report.format_text()
    assert ("non-KV retained buffers: vision_embeds -> vision_embeds_RetainedState, image_idx -> image_idx_output"
            "\nvision-language graph, dual layout (vision_embeds retained, image_idx chained)\n") in text
    assert "= exactly the 8 KV buffers" in text
    r = CliRunner().invoke(main, ["buffers", str(res.out_dir), "--regex", ".*VLLM.*", "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["selection"]["equals_kv_set"] is True
    v = buffers_report(res.out_dir / res.manifest["vision_onnx"]).to_json()
    assert v["vision_language"] == "vision-encoder" and v["non_kv_retained"] == [] and v["pairs"] == []


# ------------------------------------------------------------------------------------------------ peer-style graphs
@pytest.mark.parametrize("layout", ["dual", "single"])
def test_peer_style_vlm_graphs_pass_check(layout, tmp_path):
    path = kvg.save(kvg.build_vlm(2, "vllmKvCache", layout=layout), tmp_path / "m.onnx")
    report = qcheck.check(path, expected_prefix="vllmKvCache")
    assert report.ok, report.format_text()
    assert report.to_json()["vision_language"] == layout
    text = report.format_text()
    assert text.splitlines()[0] == (
        f"{path}: prefix 'vllmKvCache', 2 layers, vision-language graph, {layout} layout "
        f"({'vision_embeds' if layout == 'dual' else 'pixel_values'} retained, image_idx chained)")
    enc = kvg.save(kvg.build_vision_encoder(), tmp_path / "v.onnx")
    assert qcheck.check(enc).ok


def test_text_graph_json_has_no_vision_key(tmp_path):
    path = kvg.save(kvg.build(2, "VLLM"), tmp_path / "m.onnx")
    assert "vision_language" not in qcheck.check(path).to_json()
    assert "vision_language" not in buffers_report(path).to_json()


@pytest.mark.parametrize("kw, failed, expected", [
    (dict(drop=["vision_embeds_RetainedState"]), ["pairing"],
     [("pairing", "vision_embeds", "non-KV retained input vision_embeds has no output vision_embeds_RetainedState")]),
    (dict(drop=["vision_embeds"]), ["pairing"],
     [("pairing", "vision_embeds_RetainedState",
       "retained output vision_embeds_RetainedState has no input vision_embeds")]),
    (dict(drop=["image_idx_output"]), ["pairing"],
     [("pairing", "image_idx", "non-KV retained input image_idx has no output image_idx_output")]),
    (dict(drop=["image_idx"]), ["pairing"],
     [("pairing", "image_idx_output", "retained output image_idx_output has no input image_idx")]),
    (dict(drop=["image_idx", "image_idx_output"]), ["pairing"],
     [("pairing", None, "vision-language graph (input vision_embeds) has no image_idx input and no "
                        "image_idx_output output: the image index is not chained across prefill chunks")]),
    (dict(retained_dims={"vision_embeds_RetainedState": ["vision_batch_size", 16, 8]}), ["pair-match"],
     [("pair-match", "vision_embeds",
       "vision_embeds dim 1 is 'vision_size' but vision_embeds_RetainedState dim 1 is 16")]),
    (dict(image_idx_dtype=TensorProto.INT32), ["pair-match"],
     [("pair-match", "image_idx", "image_idx is int32 [1, 1]; image_idx and image_idx_output are int64 [1, 1]"),
      ("pair-match", "image_idx_output",
       "image_idx_output is int32 [1, 1]; image_idx and image_idx_output are int64 [1, 1]")]),
    (dict(image_idx_dims=["batch_size", 1]), ["pair-match"],
     [("pair-match", "image_idx",
       "image_idx is int64 ['batch_size', 1]; image_idx and image_idx_output are int64 [1, 1]"),
      ("pair-match", "image_idx_output",
       "image_idx_output is int64 ['batch_size', 1]; image_idx and image_idx_output are int64 [1, 1]")]),
])
def test_check_broken_vlm_graphs(kw, failed, expected, tmp_path):
    report = qcheck.check(kvg.save(kvg.build_vlm(2, "VLLM", **kw), tmp_path / "m.onnx"), expected_prefix="VLLM")
    assert report.failed == failed
    assert _violations(report) == expected
    assert [r.id for r in report.rules] == RULE_IDS


def test_check_prefixed_vision_buffer(tmp_path):
    report = qcheck.check(kvg.save(kvg.build_vlm(1, "VLLM", name_prefix="VLLM"), tmp_path / "m.onnx"))
    assert report.failed == ["regex-substring", "non-kv-unprefixed"]
    assert [v for v in _violations(report) if v[0] == "non-kv-unprefixed"] == [
        ("non-kv-unprefixed", "vision_embeds_VLLM", "non-KV retained buffer vision_embeds_VLLM carries prefix "
                                                    "'VLLM'; vision_embeds buffers are never prefixed"),
        ("non-kv-unprefixed", "vision_embeds_VLLM_RetainedState", "non-KV retained buffer "
         "vision_embeds_VLLM_RetainedState carries prefix 'VLLM'; vision_embeds buffers are never prefixed")]
    # the serving regex catches the prefixed vision buffer too
    assert ("regex-substring", "vision_embeds_VLLM",
            "substring regex .*VLLM.* selects the non-KV buffer vision_embeds_VLLM") in _violations(report)


@pytest.mark.parametrize("layout", ["dual", "single"])
def test_rewrite_peer_style_graphs(layout, tmp_path):
    src = kvg.save(kvg.build_vlm(2, None, layout=layout), tmp_path / "m.onnx")
    ins0, outs0 = _io(src)
    dst = tmp_path / "o" / "m.onnx"
    res = rewrite(src, dst, prefix="vllmKvCache")
    ins, outs = _io(dst)
    kv_in, kv_out = _kv("vllmKvCache")
    non_kv_in = [n for n in ins0 if naming.parse_kv_name(n) is None]
    non_kv_out = [n for n in outs0 if naming.parse_kv_name(n) is None]
    assert [n for n in ins if naming.parse_kv_name(n) is None] == non_kv_in
    assert [n for n in outs if naming.parse_kv_name(n) is None] == non_kv_out
    assert [n for n in ins if naming.parse_kv_name(n)] == kv_in
    assert [n for n in outs if naming.parse_kv_name(n)] == kv_out
    assert len(res.renamed) == 8
    assert naming.select(".*vllmKvCache.*", ins + outs) == kv_in + kv_out
    assert qcheck.check(dst, expected_prefix="vllmKvCache").ok
    back = tmp_path / "b" / "m.onnx"
    rewrite(dst, back, strip=True)
    assert _io(back) == (ins0, outs0)


@pytest.mark.parametrize("build, kw, error, message", [
    (kvg.build_vlm, dict(drop=["vision_embeds_RetainedState"]), ContractError,
     "non-KV retained input vision_embeds has no output vision_embeds_RetainedState"),
    (kvg.build_vlm, dict(drop=["vision_embeds"]), ContractError,
     "retained output vision_embeds_RetainedState has no input vision_embeds"),
    (kvg.build_vlm, dict(drop=["image_idx_output"]), ContractError,
     "non-KV retained input image_idx has no output image_idx_output"),
    (kvg.build_vlm, dict(name_prefix="OLD"), ContractError,
     "non-KV retained buffer vision_embeds_OLD carries prefix 'OLD'; vision_embeds buffers are never prefixed"),
    (kvg.build_vlm, dict(layout="single", drop=["pixel_values_RetainedState"]), ContractError,
     "non-KV retained input pixel_values has no output pixel_values_RetainedState"),
])
def test_rewrite_refuses_broken_vlm_graphs(build, kw, error, message, tmp_path):
    src = kvg.save(build(2, None, **kw), tmp_path / "m.onnx")
    before = src.read_bytes()
    with pytest.raises(error, match=f"^{message.replace('(', r'[(]').replace(')', r'[)]')}$"):
        rewrite(src, tmp_path / "o.onnx", prefix="VLLM")
    assert not (tmp_path / "o.onnx").exists() and src.read_bytes() == before
    r = CliRunner().invoke(main, ["rewrite", str(src), "-o", str(tmp_path / "o.onnx"), "--kv-cache-prefix", "VLLM"])
    _one_line_error(r, message)


@pytest.mark.parametrize("prefix, where", [("embeds", "input 'vision_embeds'"), ("idx", "input 'image_idx'"),
                                           ("pixel", "input 'pixel_values'")])
def test_rewrite_refuses_a_prefix_that_catches_vision_buffers(prefix, where, tmp_path):
    layout = "single" if prefix == "pixel" else "dual"
    src = kvg.save(kvg.build_vlm(2, None, layout=layout), tmp_path / "m.onnx")
    with pytest.raises(RewriteError, match=f"^prefix '{prefix}' occurs in the non-KV {where}, so the serving regex"):
        rewrite(src, tmp_path / "o.onnx", prefix=prefix)


def test_rewrite_refuses_the_vision_encoder(tmp_path):
    src = kvg.save(kvg.build_vision_encoder(), tmp_path / "v.onnx")
    msg = ("graph is a vision encoder graph (pixel_values -> vision_embeds; no KV buffers, nothing retained); the "
           "KV-cache prefix belongs to the language graph beside it")
    with pytest.raises(ContractError) as exc:
        rewrite(src, tmp_path / "o.onnx", prefix="VLLM")
    assert str(exc.value) == msg
    _one_line_error(CliRunner().invoke(main, ["rewrite", str(src), "-o", str(tmp_path / "o.onnx"),
                                              "--kv-cache-prefix", "VLLM"]), msg)


@pytest.mark.parametrize("layout", ["dual", "single"])
def test_buffers_regex_selects_exactly_the_language_kv(layout, tmp_path):
    path = kvg.save(kvg.build_vlm(2, "VLLM", layout=layout), tmp_path / "m.onnx")
    j = buffers_report(path, regex=".*VLLM.*").to_json()
    kv_in, kv_out = _kv("VLLM")
    vis = "vision_embeds" if layout == "dual" else "pixel_values"
    assert j["non_kv_retained"] == [{"input": vis, "retained": naming.retained_name(vis)},
                                    {"input": "image_idx", "retained": "image_idx_output"}]
    assert j["selection"]["selected"] == kv_in + kv_out and j["selection"]["equals_kv_set"] is True
    # a broader regex catches the vision buffers: reported, not hidden
    sel = buffers_report(path, regex=".*_RetainedState|image_idx.*").to_json()["selection"]
    assert sel["equals_kv_set"] is False
    assert sel["selects_non_kv"] == ["image_idx", naming.retained_name(vis), "image_idx_output"]


# ------------------------------------------------------------------------------------------------ compile-config
def test_compile_config_peer_dual_graph(tmp_path):
    lang = kvg.save(kvg.build_vlm(2, "vllmKvCache"), tmp_path / "lang.onnx")
    vis = kvg.save(kvg.build_vision_encoder(), tmp_path / "vision.onnx")
    kw = dict(prefill_seq_len=8, ctx_len=64)
    with pytest.raises(RuntimeInputError, match=r"^the vision-language graph's img_size is unknown \(axis "
                                                r"pixel_values dim 2 is symbolic\); give --img-size N$"):
        write_compile_config_for_graph(lang, tmp_path / "a", vision_model=vis, **kw)
    with pytest.raises(RuntimeInputError, match=r"^the vision-language graph's vision_size is unknown \(axis "
                                                r"vision_embeds dim 1 is symbolic\); give --vision-size N$"):
        write_compile_config_for_graph(lang, tmp_path / "b", img_size=336, **kw)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    out = tmp_path / "c"
    paths = write_compile_config_for_graph(lang, out, img_size=336, vision_size=576, vision_model=vis, **kw)
    assert [p.name for p in paths] == ["custom_io.yaml", "specializations.json", "custom_io_vision.yaml",
                                       "specializations_vision.json"]
    entry = {"batch_size": "1", "seq_len": "8", "ctx_len": "64", "img_size": "336", "vision_size": "576",
             "vision_batch_size": "1"}
    assert json.loads((out / "specializations.json").read_text()) == {"specializations": [
        entry, {**entry, "seq_len": "1"}]}
    kv_in, kv_out = _kv("vllmKvCache")
    assert _pairs((out / "custom_io.yaml").read_text()) == (
        [("vision_embeds", "float32")] + [(n, "float16") for n in kv_in],
        [("vision_embeds_RetainedState", "float32")] + [(n, "float16") for n in kv_out])
    # without a vision graph: the language files only
    assert [p.name for p in write_compile_config_for_graph(lang, tmp_path / "d", img_size=336, vision_size=576,
                                                           **kw)] == ["custom_io.yaml", "specializations.json"]


def test_compile_config_text_graph_refuses_vision_settings(tmp_path):
    path = kvg.save(kvg.build(2, "VLLM"), tmp_path / "m.onnx")
    r = CliRunner().invoke(main, ["compile-config", str(path), "-o", str(tmp_path / "o"), "--prefill-seq-len", "8",
                                  "--ctx-len", "64", "--img-size", "336"])
    _one_line_error(r, f"{path} has no vision_embeds or pixel_values input: it is not a vision-language graph, so "
                       "--img-size/--vision-size/--vision-model/--max-num-images do not apply")
    assert not (tmp_path / "o").exists()
    # and nothing changes for a text graph without them
    write_compile_config_for_graph(path, tmp_path / "t", prefill_seq_len=8, ctx_len=64)
    assert json.loads((tmp_path / "t" / "specializations.json").read_text())["specializations"][0] == {
        "batch_size": "1", "seq_len": "8", "ctx_len": "64"}


def test_specialization_builders():
    syms = vision_symbols("dual", img_size=336, vision_size=576, vision_batch_size=1, max_num_images=1)
    assert list(syms) == ["max_num_images", "img_size", "vision_size", "vision_batch_size"]
    assert vision_symbols("single", img_size=336) == {"img_size": 336, "vision_batch_size": 1}
    spec = specializations(8, 64, full_batch_size=4, vision_symbols=vision_symbols("single", img_size=336),
                           ccl=[32, 64], fmt="named")
    assert spec["specializations"][0] == {"name": "Prefill_ccl32", "symbols": {
        "batch_size": "1", "seq_len": "8", "ctx_len": "64", "img_size": "336", "vision_batch_size": "1",
        "full_batch_size": "4", "comp_ctx_lengths": "32"}}
    assert vision_specializations(img_size=336, fmt="named") == {
        "specializations": [{"name": "Vision", "symbols": {"batch_size": "1", "img_size": "336"}}]}
    with pytest.raises(RuntimeInputError, match="give --vision-size N"):
        vision_symbols("dual", img_size=336)
