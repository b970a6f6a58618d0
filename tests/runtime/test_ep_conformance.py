"""The runtime's feeds inside the ONNX spec, proved without a GPU (issue 40): the same script of prefill, decode,
continuous batching (or lock-step rows) and the cache verbs (truncate, copy, relocate) runs once on onnxruntime's
CPU EP and once on onnx's reference evaluator (``Session(..., executor="reference")``: the spec's own semantics,
with strict index checks: every Gather/GatherND/GatherElements/ScatterND/ScatterElements index in range, no
scatter writing an index twice, every ``position_ids``/``batch_index`` feed in range), on tiny graphs of every
memory kind (full, ring, latent, recurrent, hybrid) and the portable and onnxruntime targets; the tokens must be
equal and the logits close. The fused target uses onnxruntime contrib ops the reference evaluator cannot run:
refused here; its proof off the CPU is CUDA's token comparison only (``tests/runtime/test_ep_cuda.py``, GPU only).

Also here: the refusals of unproved execution providers (``ProviderError``, before anything is loaded), the
CPU-only invalid-index patch, that the strict evaluator does catch out-of-spec graphs (the peer's), and the binding
path of an EP that copies a host input when it is bound (CUDA's): emulated on the CPU, a session bound once gets
wrong tokens and a session on such a device (every input bound again before each run) the CPU's.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from _ep_script import PROMPT, STEPS, script
from suite import HAS_PEER, PEER_MISSING, PEER_DIR
from families import CHUNK, CTX
from qeff_kv.errors import ContractError, ProviderError
from qeff_kv.runtime import Session
from qeff_kv.runtime.execution import ep_proofs
from qeff_kv.runtime.execution.executor import ReferenceExecutor


def assert_conforms(model, **kwargs) -> list[int]:
    """The script on onnxruntime's CPU EP and on the strict reference evaluator: equal tokens, close logits."""
    ort_toks, ort_logits = script(Session(model, **kwargs))
    ref = Session(model, executor="reference", **kwargs)
    ref_toks, ref_logits = script(ref)
    assert ref.binding.io.runs > 0 and ref.invalid_index_patch == {"gather": 0, "scatter": 0}
    assert ref_toks == ort_toks
    for x, y in zip(ref_logits, ort_logits):
        np.testing.assert_allclose(x, y, rtol=1e-3, atol=1e-4)
    return ort_toks


# ------------------------------------------------------------------------------------------------ every kind
@pytest.mark.parametrize("target", ["portable", "onnxruntime"])
@pytest.mark.parametrize("family,kind", [("llama", "full"), ("mistral_sw", "ring"), ("mamba2", "recurrent"),
                                         ("bamba", "hybrid")])
def test_feeds_conform_on_every_memory_kind(family, kind, target, family_exports):
    """One sequence (lock step with two rows where the graph allows: full buffers) on the family matrix's
    exports: prefill in chunks, decode, truncate, and with two rows copy and relocate."""
    export = family_exports(family, target)
    sess = Session(export.out_dir)
    expected = {"full": (False, False), "ring": (True, False), "recurrent": (False, True), "hybrid": (False, True)}
    assert (bool(sess.rings.capacities), bool(sess.recurrent)) == expected[kind]
    assert bool(sess.cache.positional.names) == (kind != "recurrent")   # hybrid: attention KV and recurrent state
    rows = 2 if kind == "full" else 1   # lock step refuses rings and recurrent state
    assert_conforms(export.out_dir, max_sequences=rows)


@pytest.fixture(scope="module")
def extra_exports(family_models, tmp_path_factory):
    """The latent cache (MLA) on both targets, continuous batching of the latent, recurrent and ring kinds, and of
    a CCL graph (comp_ctx_lengths stepping 8 -> 16 -> 32 as the sequences grow)."""
    from qeff_kv.export import export_model

    root = tmp_path_factory.mktemp("conformance")
    cache: dict = {}

    def get(name: str):
        if name not in cache:
            family, opts = {
                "latent-portable": ("deepseek_v3", dict(target="portable", mla_cache="latent")),
                "latent-cb": ("deepseek_v3", dict(target="onnxruntime", mla_cache="latent",
                                                  continuous_batching=True, full_batch_size=2)),
                "recurrent-cb": ("mamba2", dict(target="portable", continuous_batching=True, full_batch_size=2)),
                "ring-cb": ("mistral_sw", dict(target="onnxruntime", continuous_batching=True, full_batch_size=2)),
                "ccl-cb": ("llama", dict(target="portable", ccl="8,16", continuous_batching=True, full_batch_size=2)),
            }[name]
            cache[name] = export_model(family_models(family), root / name, ctx_len=CTX, prefill_seq_len=CHUNK,
                                       verify=False, **opts).out_dir
        return cache[name]

    return get


@pytest.mark.parametrize("name", ["latent-portable", "latent-cb", "recurrent-cb", "ring-cb", "ccl-cb"])
def test_feeds_conform_on_latent_and_batched_graphs(name, extra_exports):
    assert_conforms(extra_exports(name))
    if name == "ccl-cb":
        assert Session(extra_exports(name)).ccl.lengths == [8, 16, CTX]


@pytest.mark.parametrize("graph", ["qeff_llama_cb_vllm.onnx", "own_llama_ort_cb_vllm.onnx"])
def test_continuous_batching_feeds_conform(graph, own_graphs):
    """Continuous batching (three slots, batch_index rows) on the portable and onnxruntime targets."""
    toks = assert_conforms(own_graphs.export(graph).out_dir)
    assert len(toks) == 1 + STEPS + 1 + 1 + 4 + 2


def test_the_fused_target_is_refused_by_the_reference_evaluator(own_fused_graph):
    """Its contrib ops are outside the ONNX spec's operator sets: no conformance proof, so no EP but the CPU's."""
    with pytest.raises(ContractError, match=r"onnx's reference evaluator cannot run it \(custom ops: "
                                            r"com\.microsoft\.GroupQueryAttention"):
        Session(own_fused_graph, executor="reference")
    assert ep_proofs.PROVED[(ep_proofs.CUDA, "onnxruntime-fused")].startswith("tests/runtime/test_ep_cuda.py (GPU only")
    assert not ep_proofs.proved("TensorrtExecutionProvider", "onnxruntime-fused")


# ------------------------------------------------------------------------------------------------ the strict checks
def _scatter_graph(path, indices: list[list[int]]) -> None:
    """``y = ScatterND(x [4], indices, updates)`` with constant indices."""
    idx = helper.make_tensor("idx", TensorProto.INT64, [len(indices), 1], [i[0] for i in indices])
    upd = helper.make_tensor("upd", TensorProto.FLOAT, [len(indices)], [1.0] * len(indices))
    node = helper.make_node("ScatterND", ["x", "idx", "upd"], ["y"])
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])], [idx, upd])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]), str(path))


@pytest.mark.parametrize("indices,message", [
    ([[1], [1]], "ScatterND: an index is written twice in one scatter (its order is undefined by the ONNX spec)"),
    ([[4]], r"ScatterND: index 4 is outside [-4, 3] (undefined by the ONNX spec)"),
])
def test_the_reference_executor_refuses_what_the_spec_leaves_undefined(tmp_path, indices, message):
    import onnxruntime as ort

    _scatter_graph(tmp_path / "s.onnx", indices)
    ex = ReferenceExecutor(tmp_path / "s.onnx", {})
    x, y = np.zeros(4, np.float32), np.zeros(4, np.float32)
    ex.bind_ortvalue_input("x", ort.OrtValue.ortvalue_from_numpy(x))
    ex.bind_ortvalue_output("y", ort.OrtValue.ortvalue_from_numpy(y))
    with pytest.raises(ContractError) as exc:
        ex.run()
    assert str(exc.value) == message


def test_the_reference_executor_writes_into_the_bound_buffers(tmp_path):
    import onnxruntime as ort

    _scatter_graph(tmp_path / "s.onnx", [[2], [-1]])
    ex = ReferenceExecutor(tmp_path / "s.onnx", {})
    x, y = np.zeros(4, np.float32), np.full(4, 9, np.float32)
    ex.bind_ortvalue_input("x", ort.OrtValue.ortvalue_from_numpy(x))
    ex.bind_ortvalue_output("y", ort.OrtValue.ortvalue_from_numpy(y))
    ex.run()
    assert y.tolist() == [0.0, 0.0, 1.0, 1.0]


@pytest.mark.skipif(not HAS_PEER, reason=PEER_MISSING)
@pytest.mark.parametrize("graph,message", [
    ("qeff_llama_cb_default.onnx", "ScatterND: index 2147483647 is outside [-32, 31] (undefined by the ONNX spec)"),
    ("qeff_llama_default.onnx", "ScatterND: an index is written twice in one scatter (its order is undefined by "
                                "the ONNX spec)"),
])
def test_the_peers_graphs_are_out_of_spec_so_cpu_only(graph, message):
    """The peer's INT32_MAX "invalid index" and its padded rows all writing slot ctx_len - 1: undefined by the spec
    (onnxruntime's CPU kernels need the in-memory patch, applied for them only), so the peer's kind stays CPU-only."""
    cpu = Session(PEER_DIR / graph, ctx_len=32)
    assert cpu.invalid_index_patch["gather"] + cpu.invalid_index_patch["scatter"] > 0 or "cb" not in graph
    ref = Session(PEER_DIR / graph, ctx_len=32, executor="reference")
    assert ref.invalid_index_patch == {"gather": 0, "scatter": 0}
    with pytest.raises(ContractError) as exc:
        ref.prefill(ref.add_sequence(), PROMPT)
    assert str(exc.value) == message
    assert ep_proofs.refusal(ep_proofs.CUDA, "peer").startswith("CUDAExecutionProvider is not proved exact for peer")


# ------------------------------------------------------------------------------------------------ the refusals
@pytest.fixture(scope="module")
def peer_kind_graph(own_graph, tmp_path_factory):
    """Our portable graph with its target removed from the metadata: another exporter's kind (``peer``)."""
    from qeff_kv.contract import naming

    model = onnx.load(str(next(own_graph.glob("*.onnx"))))
    keep = [p for p in model.metadata_props if p.key != naming.TARGET_META]
    del model.metadata_props[:]
    model.metadata_props.extend(keep)
    path = tmp_path_factory.mktemp("peer_kind") / "model.onnx"
    onnx.save(model, str(path))
    return path


@pytest.mark.parametrize("kwargs,kind", [(dict(device="cuda"), "peer"),
                                         (dict(providers=["CUDAExecutionProvider", "CPUExecutionProvider"]), "peer"),
                                         (dict(providers=["TensorrtExecutionProvider"]), "portable")])
def test_an_unproved_provider_is_refused_naming_it_and_why(kwargs, kind, own_graph, peer_kind_graph, monkeypatch):
    """Refused in one line before onnxruntime sees the graph (no InferenceSession is made), whatever this machine's
    onnxruntime has: CUDA for another exporter's graph, any EP but the CPU's and CUDA's for every kind."""
    import onnxruntime as ort

    made = []
    monkeypatch.setattr(ort, "InferenceSession", lambda *a, **k: made.append(a))
    ep = (kwargs.get("providers") or ["CUDAExecutionProvider"])[0]
    with pytest.raises(ProviderError) as exc:
        Session(peer_kind_graph if kind == "peer" else own_graph, ctx_len=64, **kwargs)
    assert str(exc.value) == (f"{ep} is not proved exact for {kind} graphs: {ep_proofs.OFF_CPU[kind]}; "
                              "run on the CPU (device 'cpu')")
    assert made == []


def test_the_vision_stage_refuses_an_unproved_device_before_reading(tmp_path):
    from qeff_kv.runtime.multimodal.vision import VisionStage

    with pytest.raises(ProviderError) as exc:
        VisionStage(tmp_path / "absent.onnx", device="cuda")
    assert str(exc.value) == (f"CUDAExecutionProvider is not proved exact for vision graphs: "
                              f"{ep_proofs.OFF_CPU['vision']}; run on the CPU (device 'cpu')")


def test_the_proof_table():
    """Every kind is proved on the CPU; CUDA for our own three targets, each by the GPU-only test; nothing else.
    Before a graph is read, an EP proved for no kind is refused; CUDA waits for the graph's kind."""
    assert all(ep_proofs.proved(ep_proofs.CPU, k) for k in ep_proofs.KINDS)
    cuda = {k for (p, k) in ep_proofs.PROVED if p == ep_proofs.CUDA}
    assert cuda == {"portable", "onnxruntime", "onnxruntime-fused"}
    assert {p for (p, _) in ep_proofs.PROVED} == {ep_proofs.CPU, ep_proofs.CUDA}
    assert all(ep_proofs.PROVED[(ep_proofs.CUDA, k)].startswith("tests/runtime/test_ep_cuda.py") for k in cuda)
    assert set(ep_proofs.OFF_CPU) == set(ep_proofs.KINDS)
    assert ep_proofs.refusal(ep_proofs.CPU) is None and ep_proofs.refusal(ep_proofs.CPU, "peer") is None
    assert ep_proofs.refusal(ep_proofs.CUDA) is None and ep_proofs.refusal(ep_proofs.CUDA, "portable") is None
    assert ep_proofs.refusal("TensorrtExecutionProvider") == (
        "TensorrtExecutionProvider is not proved exact for any graph kind: no run on it has compared tokens with "
        "the reference; run on the CPU (device 'cpu')")
    assert ep_proofs.kind_of("onnxruntime-fused") == "onnxruntime-fused" and ep_proofs.kind_of(None) == "peer"
    with pytest.raises(ProviderError, match="device must be one of cpu, cuda, got 'tpu'"):
        ep_proofs.resolve("tpu", None)
    with pytest.raises(ProviderError, match="device 'cpu' runs on CPUExecutionProvider, but providers start with"):
        ep_proofs.resolve("cpu", ["CUDAExecutionProvider"])
    assert ep_proofs.resolve(None, None) == ep_proofs.resolve("cpu", None) == [ep_proofs.CPU]


def test_generate_and_serve_refuse_device_cuda_for_an_unproved_kind_and_ask_onnxruntime_for_a_proved_one(
        own_graph, peer_kind_graph, monkeypatch):
    """``--device cuda``: another exporter's graph is refused by the proofs; ours passes them and reaches
    onnxruntime's list of EPs (here without CUDA: its one line), in ``generate`` and in ``serve``."""
    import onnxruntime as ort
    from click.testing import CliRunner
    from qeff_kv_cli.main import main as cli

    monkeypatch.setattr(ort, "get_available_providers", lambda: [ep_proofs.CPU])
    r = CliRunner().invoke(cli, ["generate", str(peer_kind_graph), "--ctx-len", "64", "--prompt-ids", "5 17 42",
                                 "--device", "cuda"])
    assert r.exit_code == 2 and r.output.strip().splitlines()[-1] == (
        f"error: CUDAExecutionProvider is not proved exact for peer graphs: {ep_proofs.OFF_CPU['peer']}; "
        "run on the CPU (device 'cpu')")
    absent = ("error: onnxruntime provider 'CUDAExecutionProvider' is not available here (available: "
              "CPUExecutionProvider)")
    r = CliRunner().invoke(cli, ["generate", str(own_graph), "--prompt-ids", "5 17 42", "--device", "cuda"])
    assert r.exit_code == 2 and r.output.strip().splitlines()[-1] == absent
    r = CliRunner().invoke(cli, ["serve", str(own_graph), "--device", "cuda", "--port", "0"])
    assert r.exit_code == 2 and r.output.strip().splitlines()[-1] == absent


# ------------------------------------------------------------------------------------------------ the binding path
@pytest.mark.parametrize("graph,rows", [("qeff_llama_default.onnx", 2), ("qeff_llama_cb_vllm.onnx", None)])
def test_the_cpu_device_binds_the_state_once_as_input_and_retained_output(graph, rows, own_graphs):
    """``device="cpu"``: every KV buffer is allocated once on the device and the same OrtValue is bound as the input
    and its retained output (lock-step rows: views of it); the logits come back through their own bound buffer; a
    decode loop moves no buffer."""
    sess = Session(own_graphs.export(graph).out_dir, device="cpu", max_sequences=rows)
    assert sess.device.name == "cpu" and sess.providers == [ep_proofs.CPU]
    assert all(v.device_name() == "cpu" for _, v, _ in sess.cache.bindings())
    before = sess.kv_data_pointers()
    gens = sess.generate([PROMPT, PROMPT[:5]], max_new_tokens=4)
    assert [len(g.tokens) for g in gens] == [4, 4]
    assert sess.kv_data_pointers() == before
    retained = sess.bound_output_pointers()
    if sess.continuous_batching:   # the whole buffers, in place
        assert {n: retained[f"{n}_RetainedState"] for n in before} == before
    else:                          # lock step: the last step bound a view of the first rows, at the buffers' start
        assert set(retained.values()) <= set(before.values())
    logits_value = sess.binding.io.get_outputs()[sess.binding.out_order.index("logits")]
    assert logits_value.data_ptr() in {v.data_ptr() for _, v in sess.binding.logits.values()}


def copy_inputs_at_bind(monkeypatch) -> None:
    """onnxruntime's ``IOBinding`` made to bind a host input as it does for CUDA: a copy taken when the input is
    bound (``BindInput`` copies across devices then), so bytes written into the host buffer later never reach a
    run."""
    import onnxruntime as ort
    from onnxruntime.capi.onnxruntime_inference_collection import IOBinding

    real, kept = IOBinding.bind_ortvalue_input, []

    def bind_a_copy(self, name, value):
        kept.append(ort.OrtValue.ortvalue_from_numpy(value.numpy().copy()))   # alive while onnxruntime holds it
        real(self, name, kept[-1])

    monkeypatch.setattr(IOBinding, "bind_ortvalue_input", bind_a_copy)


@pytest.mark.parametrize("graph,rows", [("qeff_llama_default.onnx", 2), ("qeff_llama_cb_vllm.onnx", None)])
def test_an_ep_copying_inputs_at_bind_time_gets_every_input_rebound_before_each_run(graph, rows, own_graphs,
                                                                                   monkeypatch):
    """What a CUDA session does, on the CPU: with inputs copied at bind time, the CPU's path (each input bound
    once) answers wrong tokens (as on an H100 in round 1); a session on a device with ``rebind_each_run`` (every EP
    but the CPU's: ``device.staged``) binds every input again before each run and gives exactly the tokens and
    logits of the CPU path without copies, with lock-step rows and continuous batching, through truncate, copy and
    relocate."""
    from qeff_kv.runtime.execution import device
    from qeff_kv.runtime.execution.executor import OrtExecutor, RebindingExecutor

    model = own_graphs.export(graph).out_dir
    want_toks, want_logits = script(Session(model, max_sequences=rows))
    copy_inputs_at_bind(monkeypatch)
    bound_once = Session(model, max_sequences=rows)
    assert type(bound_once.binding.io) is OrtExecutor and not bound_once.device.rebind_each_run
    assert script(bound_once)[0] != want_toks
    monkeypatch.setattr(device, "for_providers", lambda providers: device.staged(providers[0]))
    staged = Session(model, max_sequences=rows)
    assert type(staged.binding.io) is RebindingExecutor and staged.device == device.Device("cpu", ep_proofs.CPU, True)
    toks, logits = script(staged)
    assert toks == want_toks
    for x, y in zip(logits, want_logits):
        np.testing.assert_array_equal(x, y)
    assert set(staged.binding.io.inputs) == {i.name for i in staged.binding.executor_session.get_inputs()}


def test_every_ep_but_the_cpus_gets_host_buffers_rebound_before_each_run():
    from qeff_kv.runtime.execution import device

    assert device.for_providers([ep_proofs.CPU]) is device.CPU and not device.CPU.rebind_each_run
    for ep in (ep_proofs.CUDA, "TensorrtExecutionProvider"):
        got = device.for_providers([ep, ep_proofs.CPU])
        assert got == device.staged(ep) and got.rebind_each_run and got.name == "cpu" and got.provider == ep


def test_the_measurement_hook_passes_an_unproved_ep_with_a_warning(peer_kind_graph, monkeypatch):
    """``QEFF_KV_MEASURE_UNPROVED_EP=1`` (benchmarks/gpu_check.py): the refusal (here CUDA for another exporter's
    graph) becomes a RuntimeWarning naming the EP and why, and the session goes on as on a proved EP; the next
    check still runs (here the EP is absent from this onnxruntime). Any other value keeps the refusal."""
    import onnxruntime as ort
    from qeff_kv.errors import RuntimeInputError

    monkeypatch.setattr(ort, "get_available_providers", lambda: [ep_proofs.CPU])
    providers = [ep_proofs.CUDA, ep_proofs.CPU]
    monkeypatch.setenv(ep_proofs.MEASURE_ENV, "1")
    with pytest.warns(RuntimeWarning) as warned, pytest.raises(RuntimeInputError) as exc:
        Session(peer_kind_graph, ctx_len=64, providers=providers)
    assert type(exc.value) is RuntimeInputError and str(exc.value) == (
        "onnxruntime provider 'CUDAExecutionProvider' is not available here (available: CPUExecutionProvider)")
    why = ep_proofs.refusal(ep_proofs.CUDA, "peer")
    assert [str(w.message) for w in warned if w.category is RuntimeWarning] == [
        f"QEFF_KV_MEASURE_UNPROVED_EP=1: running an unproved EP for a measurement: {why}"]
    monkeypatch.setenv(ep_proofs.MEASURE_ENV, "yes")
    with pytest.raises(ProviderError, match="^CUDAExecutionProvider is not proved exact for peer graphs"):
        Session(peer_kind_graph, ctx_len=64, providers=providers)


def test_a_proved_ep_onnxruntime_does_not_start_is_refused_not_run_on_the_cpu(own_graph, monkeypatch):
    """onnxruntime falls back to the CPU without a word when CUDA's libraries do not load: ``device="cuda"`` on
    our graph (proved) then stops in one line naming the EP instead of running somewhere else; the CUDA/cuDNN
    libraries were asked for first (``preload_dlls``, where onnxruntime has it)."""
    import onnxruntime as ort
    from qeff_kv.errors import RuntimeInputError
    from qeff_kv.runtime.execution import executor

    real, asked, preloaded = ort.InferenceSession, [], []
    monkeypatch.setattr(ort, "get_available_providers", lambda: [ep_proofs.CUDA, ep_proofs.CPU])
    monkeypatch.setattr(ort, "preload_dlls", lambda *a, **k: preloaded.append(1), raising=False)
    monkeypatch.setattr(executor, "_PRELOADED", False)

    def falls_back(source, so, providers):
        asked.append(providers)
        return real(source, so, providers=[ep_proofs.CPU])

    monkeypatch.setattr(ort, "InferenceSession", falls_back)
    with pytest.raises(RuntimeInputError) as exc:
        Session(own_graph, device="cuda")
    assert str(exc.value).endswith(": onnxruntime could not start CUDAExecutionProvider (it would run on "
                                   "CPUExecutionProvider); its libraries (CUDA, cuDNN) may be missing")
    assert asked == [[ep_proofs.CUDA]] and preloaded == [1]
