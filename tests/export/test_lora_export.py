"""LoRA adapters mixed per row (docs/lora.md, issue 50): an export with ``--lora`` runs a batch whose rows each take
their own adapter (or none), every row's greedy tokens equal to transformers + PEFT on the same weights.

The adapters are made here with PEFT from seeded random weights (every ``lora_B`` non-zero: tests/helpers/
lora_adapters.py), four per base model, of ranks 2, 4, 8 and 12: ``r4`` with ``use_rslora``, ``r8`` with a
``rank_pattern`` and an ``alpha_pattern``. A batch of six rows, two of them base rows, three rows sharing one
prompt (base, ``r2`` and ``r8``: the adapters change the tokens), decodes in one step per token:

* dense MHA (Llama, 4 KV heads of 4), portable target, continuous batching;
* GQA (Qwen2, 2 KV heads of 4), onnxruntime target, continuous batching, ``--kv-cache-prefix VLLM``;
* MoE (Qwen2-MoE: the adapters on attention and on the shared expert's projections; routers and routed experts
  are never adapted), portable target, continuous batching;
* onnxruntime-fused (GQA), lock step (the fused target has no continuous batching);
* ``--weights int4`` and ``int8`` (onnxruntime, accuracy level 1): the base MatMuls become MatMulNBits, the
  adapter inputs stay float, and the rows equal PyTorch + PEFT on the quantized-then-dequantized base.

Each row equals transformers + PEFT with its adapter unmerged, and with it merged (``merge_and_unload``).
The exports and the PEFT references are made once per module.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from suite import requires_torch

pytestmark = [requires_torch]

CTX, CHUNK, NEW, ROWS = 64, 8, 6, 6
PROMPTS = [[5, 17, 42, 99, 13, 7, 101, 64, 3, 77, 21], [100, 3, 3, 60, 9], [31, 8, 90, 12, 44, 70, 120, 6, 55]]
#: (adapter, prompt) per row of the mixed batch: base rows first and last, rows 0, 1 and 3 on one prompt
BATCH = [(None, 0), ("r2", 0), ("r4", 1), ("r8", 0), ("r12", 2), (None, 1)]
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
#: the adapters made on every base (gate/up/down_proj are the shared expert's on Qwen2-MoE: its routed experts
#: are not Linear modules, PEFT names none of them)
ADAPTERS = {
    "r2": dict(r=2, alpha=4, targets=["q_proj", "v_proj"], seed=11),
    "r4": dict(r=4, alpha=8, targets=["q_proj", "k_proj", "o_proj", "down_proj"], rslora=True, seed=12),
    "r8": dict(r=8, alpha=16, targets=["q_proj", "v_proj", "gate_proj", "up_proj"], seed=13,
               rank_pattern={"v_proj": 2}, alpha_pattern={"up_proj": 4}),
    "r12": dict(r=12, alpha=6, targets=ALL, seed=14),
}
#: export key -> (base, export options, lock step): every one with ``--lora`` of the base's four adapters but
#: ``open`` (``--max-lora-rank`` alone, the adapters loaded at run time only); ``int4-whole`` is quantized by the
#: whole-graph quantizer after the float graph was proved (the model loaded whole: ``QEFF_KV_EXPORT_STREAM=0``),
#: ``int4``/``int8`` as the weights stream
EXPORTS = {
    "mha": ("mha", dict(target="portable", continuous_batching=True, full_batch_size=ROWS), False),
    "gqa": ("gqa", dict(target="onnxruntime", continuous_batching=True, full_batch_size=ROWS,
                        kv_cache_prefix="VLLM"), False),
    "moe": ("moe", dict(target="portable", continuous_batching=True, full_batch_size=ROWS), False),
    "fused": ("gqa", dict(target="onnxruntime-fused"), True),
    "int4": ("gqa", dict(target="onnxruntime", weights="int4", accuracy_level=1, continuous_batching=True,
                         full_batch_size=ROWS), False),
    "int4-whole": ("gqa", dict(target="onnxruntime", weights="int4", accuracy_level=1), True),
    "int8": ("gqa", dict(target="onnxruntime", weights="int8", accuracy_level=1), True),
    "open": ("gqa", dict(target="onnxruntime", max_lora_rank=12, continuous_batching=True, full_batch_size=ROWS),
             False),
}
BLOCK = 32   # the default --block-size


class Lab:
    """The module's base models, adapters, exports and PEFT references, each made on first use."""

    def __init__(self, root, family_models):
        self.root = root
        self.family_models = family_models
        self._bases: dict = {}
        self._adapters: dict = {}
        self._exports: dict = {}
        self._refs: dict = {}

    def base(self, key: str):
        if key not in self._bases:
            from hf_models import make_model_dir
            from lora_adapters import dequantized_model_dir

            if key == "mha":
                self._bases[key] = make_model_dir("llama", self.root / key, seed=1, num_key_value_heads=4)
            elif key == "gqa":
                self._bases[key] = make_model_dir("qwen2", self.root / key, seed=2)
            elif key == "moe":
                self._bases[key] = self.family_models("qwen2_moe")
            else:   # "int4@gqa": the base as its quantized graph reads it
                weights, base = key.split("@")
                self._bases[key] = dequantized_model_dir(self.base(base), self.root / key / "tiny-qwen2", weights,
                                                         BLOCK)
        return self._bases[key]

    def adapters(self, base: str) -> dict:
        if base not in self._adapters:
            from lora_adapters import make_adapter

            self._adapters[base] = {name: make_adapter(self.base(base), self.root / f"{base}-{name}", **spec)
                                    for name, spec in ADAPTERS.items()}
        return self._adapters[base]

    def export(self, key: str):
        if key not in self._exports:
            from qeff_kv.export import export_model

            base, options, _lock = EXPORTS[key]
            lora = None if key == "open" else [f"{n}={p}" for n, p in self.adapters(base).items()]
            with pytest.MonkeyPatch.context() as mp:
                if key.endswith("-whole"):
                    mp.setenv("QEFF_KV_EXPORT_STREAM", "0")
                self._exports[key] = export_model(self.base(base), self.root / "exports" / key, ctx_len=CTX,
                                                  prefill_seq_len=CHUNK, lora=lora, **options)
        return self._exports[key]

    def refs(self, base: str, adapter: str | None, merged: bool = False, on: str | None = None) -> list:
        """PEFT's greedy tokens of every prompt with ``adapter`` made on ``base`` (``on``: applied to that base
        instead, the dequantized one)."""
        key = (base, adapter, merged, on)
        if key not in self._refs:
            from lora_adapters import peft_greedy

            folder = None if adapter is None else self.adapters(base)[adapter]
            self._refs[key] = peft_greedy(self.base(on or base), folder, PROMPTS, NEW, merged=merged)
        return self._refs[key]

    def expected(self, base: str, merged: bool = False, on: str | None = None) -> list:
        return [self.refs(base, a, merged, on)[p] for a, p in BATCH]


@pytest.fixture(scope="module")
def lab(tmp_path_factory, family_models):
    return Lab(tmp_path_factory.mktemp("lora"), family_models)


def mixed_batch(export, adapters: dict, lock_step: bool) -> list[list[int]]:
    """The rows of :data:`BATCH` run together in a Session: each row's greedy tokens."""
    from qeff_kv.runtime.session import Session

    sess = Session(export.out_dir, max_sequences=ROWS) if lock_step else Session(export.out_dir)
    for name, folder in adapters.items():
        sess.lora.load(name, folder)
    seqs = [sess.add_sequence(adapter=name) for name, _ in BATCH]
    gens = sess.generate([(s, PROMPTS[p]) for s, (_, p) in zip(seqs, BATCH)], max_tokens=NEW, stop_tokens=[])
    return [list(g.tokens) for g in gens]


@pytest.mark.parametrize("key", ["mha", "gqa", "moe", "fused"])
def test_mixed_batch_equals_peft_unmerged_and_merged(lab, key):
    """dense MHA, GQA and MoE on the portable and onnxruntime targets (continuous batching) and onnxruntime-fused
    (lock step): every row of the mixed batch equals transformers + PEFT, unmerged and merged."""
    base, _options, lock = EXPORTS[key]
    got = mixed_batch(lab.export(key), lab.adapters(base), lock)
    unmerged, merged = lab.expected(base), lab.expected(base, merged=True)
    assert unmerged == merged   # the seeds were picked so that no near-tie flips between the two
    assert got == unmerged
    # the adapters change the tokens (non-zero B): rows 0, 1 and 3 share a prompt
    assert len({tuple(got[0]), tuple(got[1]), tuple(got[3])}) == 3, got
    assert got[0] == lab.refs(base, None)[0] and got[5] == lab.refs(base, None)[1]


@pytest.mark.parametrize("key", ["int4", "int4-whole", "int8"])
def test_quantized_base_keeps_the_adapters_float(lab, key):
    """``--weights int4|int8``: the base MatMuls are MatMulNBits, every adapter input is a float graph input read
    by a Gather feeding a float MatMul (never quantized); the mixed batch equals PyTorch + PEFT on the
    quantized-then-dequantized base, unmerged and merged. Each adapter was proved at export on the graph the
    base was proved on (``int4-whole``: the float graph, before it was quantized)."""
    import onnx

    base, options, lock = EXPORTS[key]
    r = lab.export(key)
    model = onnx.load(str(r.onnx_path), load_external_data=False)
    inputs = {i.name: i for i in model.graph.input}
    lora_inputs = [n for n in inputs if n.startswith(("lora_A.", "lora_B."))]
    assert lora_inputs and all(inputs[n].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
                               for n in lora_inputs)
    assert not {t.name for t in model.graph.initializer} & set(lora_inputs)
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("MatMulNBits") >= 7 * 2, ops.count("MatMulNBits")   # the projections of both layers
    gathered = {n.output[0] for n in model.graph.node if n.op_type == "Gather" and n.input[0] in lora_inputs}
    assert len(gathered) == len(lora_inputs)
    readers = [n for n in model.graph.node if set(n.input) & gathered]
    assert readers and {(n.domain, n.op_type) for n in readers} == {("", "MatMul")}
    scheme = key.split("-")[0]
    assert r.manifest["weights"]["scheme"] == scheme
    assert r.manifest["weights"]["check"]["against"].startswith("float graph" if "whole" in key else "the verif")
    assert r.manifest["lora_verification"]["status"] == "passed"
    on = f"{scheme}@{base}"
    got = mixed_batch(r, lab.adapters(base), lock)
    assert got == lab.expected(base, on=on) == lab.expected(base, merged=True, on=on)


def test_max_lora_rank_alone_takes_adapters_at_run_time(lab):
    """``--max-lora-rank 12`` alone: the graph adapts every default projection of every layer (no adapter to prove
    at export) and runs adapters loaded at run time only, the mixed batch equal to transformers + PEFT."""
    base, _options, lock = EXPORTS["open"]
    r = lab.export("open")
    assert r.manifest["lora"]["max_rank"] == 12 and r.manifest["lora"]["adapters"] == []
    assert r.manifest["lora"]["modules"] == sorted([f"self_attn.{m}" for m in ALL[:4]] +
                                                   [f"mlp.{m}" for m in ALL[4:]])
    assert "lora_verification" not in r.manifest
    assert mixed_batch(r, lab.adapters(base), lock) == lab.expected(base)


def test_vllm_prefix_names_the_kv_buffers_not_the_adapter_inputs(lab):
    """``--kv-cache-prefix VLLM`` with adapters: every KV input and retained output carries the prefix, no adapter
    input does (the rows are exact: test_mixed_batch_equals_peft_unmerged_and_merged[gqa])."""
    import onnx

    from qeff_kv.contract import naming

    model = onnx.load(str(lab.export("gqa").onnx_path), load_external_data=False)
    names = [i.name for i in model.graph.input]
    kv = [n for n in names if n.startswith(("past_key.", "past_value."))]
    assert kv and all(n.endswith("_VLLM") for n in kv)
    assert all(o.name.endswith("_VLLM_RetainedState") for o in model.graph.output if "past_" in o.name)
    lora = names[names.index(naming.LORA_IDS_INPUT):]
    assert lora[:2] == [naming.LORA_IDS_INPUT, naming.LORA_SCALES_INPUT]
    assert len(lora) > 2 and not any("VLLM" in n for n in lora)
    assert not any("lora" in o.name for o in model.graph.output)


def test_manifest_records_the_adapters_and_their_proof(lab):
    """The manifest and the graph's metadata record the adapted modules, the largest rank, the adapters and their
    folders; the proof passed with each adapter, within tolerance."""
    import onnx

    r = lab.export("moe")
    folders = lab.adapters("moe")
    lora = r.manifest["lora"]
    modules = sorted({f"self_attn.{m}" for m in ALL[:4]} | {f"mlp.shared_expert.{m}" for m in ALL[4:]})
    assert lora["max_rank"] == 12 and lora["modules"] == modules
    assert lora["adapters"] == list(ADAPTERS)
    assert lora["folders"] == {n: str(p.resolve()) for n, p in folders.items()}
    proof = r.manifest["lora_verification"]
    assert proof["status"] == "passed" and list(proof["adapters"]) == list(ADAPTERS)
    for record in proof["adapters"].values():
        assert record["steps"] >= 2 and record["max_abs_diff"] <= record["tolerance"]
    meta = {p.key: p.value for p in onnx.load(str(r.onnx_path), load_external_data=False).metadata_props}
    assert json.loads(meta["qeff_kv.lora"]) == {k: lora[k] for k in ("adapters", "max_rank", "modules")}


def test_a_graph_missing_one_delta_fails_the_proof(lab, tmp_path, monkeypatch):
    """The proof can fail: a trace that drops layer 0's q_proj delta (PyTorch's reference keeps it) is refused
    by verification with the adapter named, and nothing is written."""
    import contextlib

    import torch

    from qeff_kv.errors import VerificationError
    from qeff_kv.export import export_model
    from qeff_kv.export.modeling import lora as lora_mod

    real = lora_mod.Routing.active

    @contextlib.contextmanager
    def dropping(self, ids, scales, weights):
        weights = list(weights)
        if torch.onnx.is_in_onnx_export():
            k = next(i for i, a in enumerate(self.adapted) if (a.layer, a.module) == (0, "self_attn.q_proj"))
            weights[2 * k + 1] = torch.zeros_like(weights[2 * k + 1])
        with real(self, ids, scales, weights):
            yield

    monkeypatch.setattr(lora_mod.Routing, "active", dropping)
    folder = lab.adapters("gqa")["r2"]
    with pytest.raises(VerificationError, match=r"^with adapter 'r2': verification failed") as exc:
        export_model(lab.base("gqa"), tmp_path / "out", ctx_len=CTX, prefill_seq_len=CHUNK, lora=[f"r2={folder}"])
    assert "\n" not in str(exc.value)
    assert not (tmp_path / "out").exists()
