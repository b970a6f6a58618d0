"""The graph tools on LoRA adapter inputs (docs/lora.md, issue 50): `check`'s rule `lora`, `rewrite` (prefixes and
dialects) keeping the adapter inputs exactly, `buffers` reporting them apart from the KV, `compile-config` giving
`lora_slots`/`lora_rank` values and never listing them in custom_io.yaml. One tiny export with adapters per module;
malformed adapter sets are small graphs built with onnx.helper."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper

import _kv_graphs as kvg
from suite import requires_torch
from qeff_kv.contract import naming
from qeff_kv.errors import DialectError, RewriteError, RuntimeInputError
from qeff_kv.tools import check as qcheck
from qeff_kv.tools.buffers import buffers_report
from qeff_kv.tools.compile_from_graph import write_compile_config_for_graph
from qeff_kv.tools.rewrite import rewrite
from qeff_kv_cli.main import main

#: the tiny llama of tests/helpers/hf_models.py: hidden 64, 2 KV heads of 16, MLP 128, 2 layers
FEATURES = {"self_attn.q_proj": (64, 64), "self_attn.k_proj": (64, 32), "self_attn.v_proj": (64, 32),
            "self_attn.o_proj": (64, 64), "mlp.gate_proj": (64, 128), "mlp.up_proj": (64, 128),
            "mlp.down_proj": (128, 64)}
PROVED = ("mlp.down_proj", "mlp.up_proj", "self_attn.k_proj", "self_attn.o_proj", "self_attn.q_proj",
          "self_attn.v_proj")   # the union of a1's and a2's targets


# ------------------------------------------------------------------------------------------------ exports
@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, Path]:
    """``proved``: adapters a1 (r 4) and a2 (r 8), continuous batching (4 rows); ``open``: ``--max-lora-rank 8`` on
    every default target, no continuous batching; ``base``: the same model without adapters. ctx_len 64."""
    pytest.importorskip("peft")
    from hf_models import make_model_dir
    from lora_adapters import make_adapter
    from qeff_kv.export.api import export_model

    root = tmp_path_factory.mktemp("lora-tools")
    base = make_model_dir("llama", root)
    a1 = make_adapter(base, root / "a1", r=4, alpha=8, targets=["q_proj", "v_proj", "down_proj"], seed=1)
    a2 = make_adapter(base, root / "a2", r=8, alpha=16, targets=["q_proj", "k_proj", "o_proj", "up_proj"], seed=2)
    out = {"a1": a1, "a2": a2}
    for name, kw in (("proved", dict(lora=[f"a1={a1}", f"a2={a2}"], continuous_batching=True, full_batch_size=4)),
                     ("open", dict(max_lora_rank=8)), ("base", {})):
        res = export_model(base, root / name, ctx_len=64, prefill_seq_len=8, verify=False, force=True, **kw)
        out[name] = res.out_dir / res.manifest["onnx"]
    return out


def _io(path: Path) -> tuple[list, list]:
    return kvg.io_signature(path)


def _lora_io(path: Path) -> list:
    """The adapter inputs of a graph, in graph order: (name, elem type, dims)."""
    return [t for t in _io(path)[0] if naming.is_lora_input(t[0])]


def _statuses(report) -> dict[str, str]:
    return {r.id: r.status for r in report.rules}


def _passes_but_sidecar(report) -> bool:
    return all(s == ("skip" if rid == "sidecar" else "pass") for rid, s in _statuses(report).items())


# ------------------------------------------------------------------------------------------------ check
@requires_torch
def test_check_passes_on_exports_with_adapters(exports):
    report = qcheck.check(exports["proved"])
    assert report.ok and _passes_but_sidecar(report), report.format_text()
    assert report.rule("lora").note == (
        "12 adapted modules over 2 layers (" + ", ".join(PROVED) + "); slots axis 'lora_slots', rank axis "
        "'lora_rank', max rank 8, float32; proved with a1, a2")
    j = report.to_json()
    assert list(j)[-1] == "lora" and j["lora"] == {"max_rank": 8, "dtype": "float32", "modules": list(PROVED),
                                                   "adapted": 12, "proved_with": ["a1", "a2"]}
    assert report.format_text().splitlines()[0].endswith("2 layers, LoRA adapter inputs (12 modules, max rank 8)")
    report = qcheck.check(exports["open"])
    assert report.ok and report.rule("lora").note.startswith("14 adapted modules over 2 layers (mlp.down_proj, "
                                                             "mlp.gate_proj,")
    base = qcheck.check(exports["base"])
    assert base.rule("lora").status == "skip" and base.rule("lora").note == "no LoRA adapter inputs"
    assert "lora" not in base.to_json()


MODULES = {"self_attn.q_proj": (16, 16), "mlp.down_proj": (32, 16)}


def lora_graph(tmp_path: Path, prefix: str | None = None, *, skip=(), rename=None, dims=None, elem=None,
               meta: object = "default", retained=()) -> Path:
    """A two-layer KV graph (:func:`_kv_graphs.build`) with the adapter inputs of :data:`MODULES` (graph metadata
    ``qeff_kv.lora``: max rank 8, proved with ``a``), changed as asked."""
    proto = kvg.build(2, prefix)
    ins = [(naming.LORA_IDS_INPUT, TensorProto.INT64, ["batch_size"]),
           (naming.LORA_SCALES_INPUT, TensorProto.FLOAT, ["batch_size"])]
    for layer in range(2):
        for m, (fan_in, fan_out) in MODULES.items():
            ins += [(naming.lora_input_name("A", layer, m), TensorProto.FLOAT, ["lora_slots", fan_in, "lora_rank"]),
                    (naming.lora_input_name("B", layer, m), TensorProto.FLOAT, ["lora_slots", "lora_rank", fan_out])]
    for name, e, shape in ins:
        if name not in skip:
            proto.graph.input.append(helper.make_tensor_value_info((rename or {}).get(name, name),
                                                                   (elem or {}).get(name, e),
                                                                   (dims or {}).get(name, shape)))
    for out in retained:
        src = naming.retained_source(out)
        proto.graph.output.append(helper.make_tensor_value_info(out, TensorProto.FLOAT,
                                                                ["lora_slots", 16, "lora_rank"]))
        proto.graph.node.append(helper.make_node("Identity", [src], [out], name=f"keep_{out}"))
    if meta == "default":
        meta = json.dumps({"max_rank": 8, "modules": sorted(MODULES), "adapters": ["a"]})
    if meta is not None:
        helper.set_model_props(proto, {"origin": "tests", naming.LORA_META: meta})
    return kvg.save(proto, tmp_path / "m.onnx")


QA, QB = "lora_A.0.self_attn.q_proj", "lora_B.0.self_attn.q_proj"
DA1, DB1 = "lora_A.1.mlp.down_proj", "lora_B.1.mlp.down_proj"
PREFIXED = "adapter input {0}_VLLM carries the KV prefix 'VLLM'; adapter inputs are never prefixed (the contract's " \
           "name is {0})"
SELECTS = "the substring KV regex .*{p}.* selects adapter input {n}; adapter inputs are never selected as KV " \
          "(choose a prefix no adapter name contains)"


def _weights(slots: object, rank: object) -> dict[str, list]:
    """Every weight's dims with the given slots and rank axes."""
    out = {}
    for layer in range(2):
        for m, (fan_in, fan_out) in MODULES.items():
            out[naming.lora_input_name("A", layer, m)] = [slots, fan_in, rank]
            out[naming.lora_input_name("B", layer, m)] = [slots, rank, fan_out]
    return out


FIXED = _weights(3, 8)
NAMED_SLOTS = _weights("adapters", "lora_rank")

@pytest.mark.parametrize("kw, failed, violations", [
    (dict(skip=[DB1]), ["lora"], [(None, f"{DA1} has no {DB1} input")]),
    (dict(skip=[DA1]), ["lora"], [(None, f"{DB1} has no {DA1} input")]),
    (dict(skip=["lora_ids"]), ["lora"], [(None, "the graph has LoRA inputs but no lora_ids input")]),
    (dict(prefix="VLLM", rename={QA: QA + "_VLLM", QB: QB + "_VLLM"}), ["regex-substring", "lora"],
     [(QA + "_VLLM", PREFIXED.format(QA)), (QB + "_VLLM", PREFIXED.format(QB)),
      (QA + "_VLLM", SELECTS.format(p="VLLM", n=QA + "_VLLM"))]),
    (dict(prefix="VLLM", rename={QA: QA + "_VLLM"}), ["regex-substring", "lora"],
     [(QA + "_VLLM", PREFIXED.format(QA)), (None, f"{QA}_VLLM has no {QB}_VLLM input"),
      (QA + "_VLLM", SELECTS.format(p="VLLM", n=QA + "_VLLM"))]),
    (dict(prefix="VLLM", rename={"lora_ids": "lora_ids_VLLM"}), ["regex-substring", "lora"],
     [("lora_ids_VLLM", PREFIXED.format("lora_ids")), (None, "the graph has LoRA inputs but no lora_ids input"),
      ("lora_ids_VLLM", SELECTS.format(p="VLLM", n="lora_ids_VLLM"))]),
    (dict(prefix="proj"), ["regex-substring", "lora"], [(QA, SELECTS.format(p="proj", n=QA))]),
    (dict(rename={DA1: "lora_A.01.mlp.down_proj"}), ["lora"],
     [("lora_A.01.mlp.down_proj", "lora_A.01.mlp.down_proj starts like an adapter input but is not one of the "
                                  "contract's names (lora_ids, lora_scales, lora_A|lora_B.<layer>.<module>)"),
      (None, f"{DB1} has no {DA1} input")]),
    (dict(dims={DA1: ["lora_slots", 32, 4], DB1: ["lora_slots", 4, 16]}), ["lora"],
     [(DA1, f"lora_A.0.mlp.down_proj has rank axis 'lora_rank' but {DA1} has 4; every adapter weight shares one")]),
    (dict(dims={DB1: ["lora_slots", "r2", 16]}), ["lora"],
     [(None, f"{DA1} has rank axis 'lora_rank' but {DB1} has 'r2'")]),
    (dict(dims=NAMED_SLOTS), ["lora"],
     [("lora_A.0.mlp.down_proj", "lora_A.0.mlp.down_proj has slots axis (axis 0) 'adapters'; it is 'lora_slots' "
                                 "(dynamic) or a fixed size, so a compiler can give it a value")]),
    (dict(dims=FIXED, meta=json.dumps({"max_rank": 16, "modules": sorted(MODULES)})), ["lora"],
     [("lora_A.0.mlp.down_proj", "the rank axis is fixed at 8 but graph metadata qeff_kv.lora records max_rank 16")]),
    (dict(meta=json.dumps({"max_rank": 8, "modules": ["self_attn.q_proj"]})), ["lora"],
     [("lora_A.0.mlp.down_proj", "lora_A.0.mlp.down_proj adapts module 'mlp.down_proj', which graph metadata "
                                 "qeff_kv.lora does not name (modules: self_attn.q_proj)")]),
    (dict(meta="{"), ["lora"], [(None, "graph metadata qeff_kv.lora is not JSON")]),
    (dict(meta="[8]"), ["lora"], [(None, "graph metadata qeff_kv.lora is not a JSON object")]),
    (dict(elem={QA: TensorProto.FLOAT16}), ["lora"],
     [(None, "the LoRA weights and lora_scales must share one float type, not ['float16', 'float32']")]),
    (dict(elem={"lora_ids": TensorProto.FLOAT}), ["lora"],
     [("lora_ids", "lora_ids is float32; the adapter slot of each row is int64")]),
    (dict(elem={n: TensorProto.INT32 for n in ["lora_scales", *FIXED]}), ["lora"],
     [("lora_scales", "lora_scales is int32; adapter scales and weights are a float type (float32, float16, "
                      "bfloat16)")]),
    (dict(dims={"lora_scales": ["batch_size", 1]}), ["lora"],
     [("lora_scales", "lora_scales has shape ['batch_size', 1]; it is rank 1 ([batch_size]: one per row)")]),
    (dict(dims={"lora_scales": ["rows"]}), ["lora"],
     [("lora_scales", "lora_ids is ['batch_size'] but lora_scales is ['rows']; both have one value per row")]),
    (dict(retained=[QA + "_RetainedState"]), ["lora"],
     [(QA + "_RetainedState", f"output {QA}_RetainedState retains an adapter input; adapter inputs are never "
                              "retained (not KV buffers)")]),
])
def test_check_malformed_adapter_sets(tmp_path, kw, failed, violations):
    report = qcheck.check(lora_graph(tmp_path, **kw))
    assert report.failed == failed, report.format_text()
    assert [(v.buffer, v.message) for v in report.rule("lora").violations] == violations
    assert report.rule("lora").note is None


@pytest.mark.parametrize("kw, note", [
    ({}, "slots axis 'lora_slots', rank axis 'lora_rank', max rank 8, float32; proved with a"),
    (dict(prefix="VLLM"), "slots axis 'lora_slots', rank axis 'lora_rank', max rank 8, float32; proved with a"),
    (dict(dims=FIXED), "slots axis 3, rank axis 8, max rank 8, float32; proved with a"),
    (dict(meta=None), "slots axis 'lora_slots', rank axis 'lora_rank', float32"),
    (dict(elem={n: TensorProto.FLOAT16 for n in ["lora_scales", *FIXED]}),
     "slots axis 'lora_slots', rank axis 'lora_rank', max rank 8, float16; proved with a"),
])
def test_check_well_formed_adapter_sets(tmp_path, kw, note):
    """Every rule passes (adapter inputs are not KV: no rule lists them as unknown or selects them)."""
    report = qcheck.check(lora_graph(tmp_path, **kw))
    assert report.ok and _passes_but_sidecar(report), report.format_text()
    assert report.rule("lora").note == "4 adapted modules over 2 layers (mlp.down_proj, self_attn.q_proj); " + note


def test_check_cli_exit_codes(tmp_path):
    good = lora_graph(tmp_path / "good")
    bad = lora_graph(tmp_path / "bad", skip=["lora_scales"])
    r = CliRunner().invoke(main, ["check", str(good)])
    assert r.exit_code == 0 and r.output.splitlines()[-1] == "OK: 11 passed, 0 failed, 1 skipped", r.output
    r = CliRunner().invoke(main, ["check", str(bad)])
    assert r.exit_code == 1 and r.output.splitlines()[-1] == "FAILED (lora): 10 passed, 1 failed, 1 skipped"
    assert "- [lora] the graph has LoRA inputs but no lora_scales input" in [x.strip() for x in r.output.splitlines()]
    r = CliRunner().invoke(main, ["check", "--json", str(bad)])
    assert r.exit_code == 1 and json.loads(r.output)["failed"] == ["lora"]


# ------------------------------------------------------------------------------------------------ rewrite
@requires_torch
@pytest.mark.parametrize("graph", ["proved", "open"])
def test_rewrite_prefix_keeps_adapter_inputs(exports, tmp_path, graph):
    """add, change, strip: the adapter inputs keep their names, types, shapes and order; check passes after."""
    src = exports[graph]
    lora = _lora_io(src)
    assert len(lora) == 2 + 2 * 2 * (6 if graph == "proved" else 7)
    steps = [("VLLM", dict(prefix="VLLM")), ("kv7", dict(prefix="kv7")), (None, dict(strip=True))]
    cur = src
    for i, (prefix, kw) in enumerate(steps):
        out = tmp_path / f"step{i}.onnx"
        res = rewrite(cur, out, **kw)
        assert res.renamed and not any(naming.is_lora_input(a) or naming.is_lora_input(b) for a, b in res.renamed)
        assert _lora_io(out) == lora
        report = qcheck.check(out, expected_prefix=prefix)
        assert report.ok and _passes_but_sidecar(report), report.format_text()
        cur = out
    assert _io(cur) == _io(src)


@requires_torch
def test_prefixed_adapter_graph_runs_the_same_tokens(exports, tmp_path):
    """The rewritten graph still mixes adapters per row: the same tokens as the graph it came from."""
    from qeff_kv.runtime.session import Session

    prefixed = rewrite(exports["proved"], tmp_path / "vllm.onnx", prefix="VLLM").output

    def run(path: Path) -> list[list[int]]:
        s = Session(path, ctx_len=64, max_sequences=3)
        s.lora.load("a1", exports["a1"])
        s.lora.load("a2", exports["a2"])
        seqs = [s.add_sequence(), s.add_sequence(adapter="a1"), s.add_sequence(adapter="a2")]
        return [list(o.tokens) for o in s.generate([(q, [5, 17, 33, 9]) for q in seqs], max_tokens=5)]

    before = run(exports["proved"])
    assert run(prefixed) == before and len({tuple(t) for t in before}) == 3   # three rows, three adapters


@requires_torch
def test_rewrite_refuses_a_prefix_inside_adapter_names(exports, tmp_path):
    for prefix, name in (("proj", "lora_A.0.self_attn.q_proj"), ("lora", "lora_ids")):
        with pytest.raises(RewriteError, match=f"^prefix '{prefix}' occurs in the non-KV input '{name}', so the "
                                               "serving regex"):
            rewrite(exports["proved"], tmp_path / "x.onnx", prefix=prefix)
    assert not (tmp_path / "x.onnx").exists()


@requires_torch
def test_rewrite_dialects_carry_or_refuse_adapter_inputs(exports, tmp_path):
    """shared-past-present and back keep them exactly; static-cache cannot carry them: refused in one line."""
    src = exports["open"]
    pp = tmp_path / "pp.onnx"
    res = rewrite(src, pp, to="shared-past-present", prefix="VLLM")
    assert res.dialect == naming.PAST_PRESENT and _lora_io(pp) == _lora_io(src)
    report = qcheck.check(pp, expected_prefix="VLLM")
    assert report.ok and report.rule("lora").status == "pass", report.format_text()
    back = tmp_path / "back.onnx"
    rewrite(pp, back, to="retained-state", strip=True)
    assert _io(back) == _io(src)
    with pytest.raises(DialectError) as err:
        rewrite(src, tmp_path / "s.onnx", to="static-cache", capacity=64)
    assert str(err.value) == (
        "cannot convert to static-cache: the LoRA adapter inputs (lora_ids, lora_scales, lora_A.0.self_attn.q_proj, "
        "...: 30) have no static-cache form and would be dropped; retained-state and shared-past-present keep them")
    assert not (tmp_path / "s.onnx").exists()
    r = CliRunner().invoke(main, ["rewrite", str(src), "-o", str(tmp_path / "s.onnx"), "--to", "static-cache"])
    assert r.exit_code == 2 and len(r.stderr.splitlines()) == 1 and "LoRA adapter inputs" in r.stderr


# ------------------------------------------------------------------------------------------------ buffers
@requires_torch
def test_buffers_reports_adapter_inputs_apart_from_kv(exports):
    report = buffers_report(exports["proved"].parent, ctx_len=64)
    per_layer = sum(sum(FEATURES[m]) for m in PROVED)
    slot = per_layer * 2 * 8 * 4   # two layers, rank 8, float32
    j = report.to_json()
    assert [p["input"] for p in j["pairs"]] == ["past_key.0", "past_value.0", "past_key.1", "past_value.1"]
    assert j["bytes_per_sequence"] == 4 * 2 * 64 * 16 * 4
    lora = j["lora"]
    assert lora["inputs"][:4] == ["lora_ids", "lora_scales", "lora_A.0.mlp.down_proj", "lora_B.0.mlp.down_proj"]
    assert len(lora["inputs"]) == 26 and not set(lora["inputs"]) & {p["input"] for p in j["pairs"]}
    assert {k: v for k, v in lora.items() if k != "inputs"} == {
        "modules": list(PROVED), "adapted": 12, "layers": 2, "slots_axis": "lora_slots", "rank_axis": "lora_rank",
        "max_rank": 8, "dtype": "float32", "bytes_per_slot": slot, "proved_with": ["a1", "a2"]}
    text = report.format_text().splitlines()
    i = text.index("non-KV retained buffers: none")
    assert text[i + 1:i + 5] == [
        "LoRA adapter inputs (not KV: never prefixed, never retained): lora_ids, lora_scales and 24 lora_A/lora_B "
        "weights [lora_slots, in, lora_rank] / [lora_slots, lora_rank, out]",
        "  adapted modules (12 over 2 layers): " + ", ".join(PROVED) + "; float32",
        f"  max rank 8; bytes per adapter slot at rank 8: 52 KiB ({slot} bytes)",
        "  export proved with: a1, a2"]
    assert slot == 53248
    r = CliRunner().invoke(main, ["buffers", str(exports["proved"].parent), "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["lora"] == lora
    assert "lora" not in buffers_report(exports["base"]).to_json()
    assert "LoRA" not in buffers_report(exports["base"]).format_text()


def test_buffers_malformed_and_fixed_sets(tmp_path):
    j = buffers_report(lora_graph(tmp_path / "a", skip=["lora_ids"])).to_json()
    assert j["lora"] == {"error": "the graph has LoRA inputs but no lora_ids input"}
    j = buffers_report(lora_graph(tmp_path / "b", dims=FIXED, meta=None)).to_json()
    assert j["lora"]["max_rank"] == 8 and j["lora"]["slots_axis"] == 3
    assert j["lora"]["bytes_per_slot"] == 2 * (32 + 48) * 8 * 4
    text = buffers_report(lora_graph(tmp_path / "c", meta=None)).format_text()
    assert "  max rank unknown (no qeff_kv.lora metadata, rank axis symbolic)\n" in text


# ------------------------------------------------------------------------------------------------ compile-config
def _spec(folder: Path) -> list[dict]:
    return json.loads((folder / "specializations.json").read_text())["specializations"]


@requires_torch
def test_export_writes_adapter_symbols(exports):
    """The export's own compile files: 1 + 2 proved adapters slots at rank 8; the base export's are unchanged."""
    proved, base = exports["proved"].parent, exports["base"].parent
    assert _spec(proved) == [
        {"batch_size": "1", "seq_len": "8", "ctx_len": "64", "full_batch_size": "4", "lora_slots": "3",
         "lora_rank": "8"},
        {"batch_size": "4", "seq_len": "1", "ctx_len": "64", "full_batch_size": "4", "lora_slots": "3",
         "lora_rank": "8"}]
    assert _spec(exports["open"].parent) == [
        {"batch_size": "1", "seq_len": "8", "ctx_len": "64", "lora_slots": "2", "lora_rank": "8"},
        {"batch_size": "1", "seq_len": "1", "ctx_len": "64", "lora_slots": "2", "lora_rank": "8"}]
    assert _spec(base) == [{"batch_size": "1", "seq_len": "8", "ctx_len": "64"},
                           {"batch_size": "1", "seq_len": "1", "ctx_len": "64"}]
    # custom_io lists the KV alone: the same file as the export without adapters
    assert (exports["open"].parent / "custom_io.yaml").read_text() == (base / "custom_io.yaml").read_text()
    assert "lora" not in (proved / "custom_io.yaml").read_text()


@requires_torch
def test_compile_config_adapter_settings(exports, tmp_path):
    src = exports["proved"]
    r = CliRunner().invoke(main, ["compile-config", str(src), "-o", str(tmp_path / "a"), "--prefill-seq-len", "8",
                                  "--ctx-len", "64", "--full-batch-size", "4", "--specializations-format", "named"])
    assert r.exit_code == 0, r.stderr
    assert _spec(tmp_path / "a") == [{"name": name, "symbols": sym} for name, sym in
                                     zip(("Prefill", "Decode"), _spec(src.parent))]   # as the export wrote them
    r = CliRunner().invoke(main, ["compile-config", str(src), "-o", str(tmp_path / "b"), "--prefill-seq-len", "8",
                                  "--ctx-len", "64", "--full-batch-size", "4", "--lora-slots", "5", "--lora-rank", "4"])
    assert r.exit_code == 0, r.stderr
    assert [(e["lora_slots"], e["lora_rank"]) for e in _spec(tmp_path / "b")] == [("5", "4"), ("5", "4")]
    assert (tmp_path / "b" / "custom_io.yaml").read_text() == (src.parent / "custom_io.yaml").read_text()
    for args, message in (
            (["--lora-rank", "9"], "error: lora_rank 9 is above the graph's max_rank 8 (qeff_kv.lora): its adapters "
                                   "were fitted at most that rank"),
            (["--lora-slots", "0"], None)):
        r = CliRunner().invoke(main, ["compile-config", str(src), "-o", str(tmp_path / "c"), "--prefill-seq-len", "8",
                                      "--ctx-len", "64", "--full-batch-size", "4", *args])
        assert r.exit_code == 2 and (message is None or r.stderr.strip() == message), r.stderr
    assert not (tmp_path / "c").exists()


def test_compile_config_refusals_and_fixed_axes(tmp_path):
    plain = kvg.save(kvg.build(2), tmp_path / "plain.onnx")
    with pytest.raises(RuntimeInputError, match="^the graph has no LoRA adapter inputs; --lora-slots/--lora-rank do "
                                                "not apply$"):
        write_compile_config_for_graph(plain, tmp_path / "a", prefill_seq_len=8, ctx_len=16, lora_slots=3)
    write_compile_config_for_graph(plain, tmp_path / "p", prefill_seq_len=8, ctx_len=16)
    assert _spec(tmp_path / "p") == [{"batch_size": "1", "seq_len": "8", "ctx_len": "16"},
                                     {"batch_size": "1", "seq_len": "1", "ctx_len": "16"}]
    fixed = lora_graph(tmp_path / "f", dims=FIXED)
    write_compile_config_for_graph(fixed, tmp_path / "b", prefill_seq_len=8, ctx_len=16)
    assert _spec(tmp_path / "b") == _spec(tmp_path / "p")   # fixed axes need no symbol
    with pytest.raises(RuntimeInputError, match="^lora_slots 4 differs from the graph's fixed lora_slots axis 3$"):
        write_compile_config_for_graph(fixed, tmp_path / "c", prefill_seq_len=8, ctx_len=16, lora_slots=4)
    no_meta = lora_graph(tmp_path / "n", meta=None)
    with pytest.raises(RuntimeInputError, match="^the graph's lora_rank axis is dynamic and no qeff_kv.lora metadata "
                                                "records max_rank; give --lora-rank R$"):
        write_compile_config_for_graph(no_meta, tmp_path / "d", prefill_seq_len=8, ctx_len=16)
    write_compile_config_for_graph(no_meta, tmp_path / "e", prefill_seq_len=8, ctx_len=16, lora_rank=16)
    assert [(e["lora_slots"], e["lora_rank"]) for e in _spec(tmp_path / "e")] == [("2", "16"), ("2", "16")]
    bad = lora_graph(tmp_path / "g", skip=["lora_B.0.mlp.down_proj"])
    with pytest.raises(Exception, match="fails check rule 'lora' \\(lora_A.0.mlp.down_proj has no "
                                        "lora_B.0.mlp.down_proj input\\)"):
        write_compile_config_for_graph(bad, tmp_path / "h", prefill_seq_len=8, ctx_len=16)
    for d in "acdh":
        assert not (tmp_path / d).exists()
