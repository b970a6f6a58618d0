"""Shared test fixtures.

Two sets of retained-state graphs:

* **own graphs**, made by the tests themselves (exported once per session, lazily, from the bundled default
  model and a tiny seeded Qwen2): every test of qeff-kv's own behaviour runs on them, so a fresh clone tests
  its runtime without anything else;
* **peer graphs**, read from ../shared/fixtures/qeff-peer (or ``QEFF_KV_PEER_FIXTURES``): the tests that are
  about interoperating with the peer's exporter (QEfficient); they skip with a reason where that folder is
  absent. Its vision-language and CCL graphs, with their tiny models, are in ../shared/fixtures/qeff-peer-vlm (or
  ``QEFF_KV_PEER_VLM_FIXTURES``; fixture ``peer_vlm_dir`` in tests/runtime/conftest.py,
  tests/runtime/test_peer_vlm.py); its MLA latent, speculative-target, hybrid recurrent and sliding-window graphs
  in ../shared/fixtures/qeff-peer-2 (or ``QEFF_KV_PEER2_FIXTURES``; fixture ``peer2_dir``,
  tests/tools/test_peer_round2.py).

``graphs`` is parametrized over both (``own``, ``peer``): a test of our own behaviour written against it runs
on our exports and on the peer's files of the same names, and compares with each set's own reference tokens.
Without the peer folder its ``peer`` variants are not collected (the header of the run says so): they repeat
tests that already ran on our graphs, and would only swell the skip count. Tests about the peer's graphs
themselves (``peer_dir``, ``peer_graph``, and the ``peer-*`` cases of ``any_graph``/``ALL_GRAPHS``) are always
collected and skip with the reason.

This file holds the fixtures that tests of several folders use (each session-scoped one made once per session);
a fixture one folder uses alone is in that folder's conftest.py. Constants and markers (``requires_torch``,
``PROMPT_A``, ``OWN_GRAPHS``...) are in tests/helpers/suite.py (``from suite import ...``).
"""

from __future__ import annotations

import shutil
from functools import cached_property
from pathlib import Path

import pytest

from suite import (HAS_PEER, HAS_PEER2, HAS_TORCH, OWN_CTX_LEN, OWN_GRAPHS, OWN_PREFILL, PEER2_DIR, PEER2_MISSING,
                   PEER_DIR, PEER_LLAMA_A, PEER_LLAMA_B, PEER_MISSING, PEER_QWEN2_A, PROMPT_A, PROMPT_B)


class OwnGraphs:
    """Our exports, made on first use and kept for the session.

    ``export(name)`` is the export folder (manifest, tokenizer, specializations) as a user gets it;
    ``self / name`` is that graph's ``.onnx`` alone in a flat folder, named like the peer's file, with no
    manifest beside it: a graph as another tool hands it over (ctx_len and the prefill length symbolic).
    """

    kind = "own"

    def __init__(self, root: Path):
        self.root = root
        self.dir = root / "flat"
        self.dir.mkdir(parents=True, exist_ok=True)
        self._exports: dict = {}

    def __repr__(self) -> str:
        return "own"

    # ---- models
    @cached_property
    def llama_hf(self) -> Path:
        """The bundled default model as a Hugging Face folder (built exactly as the exporter builds it)."""
        import torch
        import transformers

        from qeff_kv.export.sources import BUNDLED_SEED, bundled_model_dir

        cfg = transformers.AutoConfig.from_pretrained(bundled_model_dir())
        torch.manual_seed(BUNDLED_SEED)
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
        out = self.root / "hf" / "bundled-llama"
        model.save_pretrained(out, safe_serialization=True)
        return out

    @cached_property
    def qwen2_hf(self) -> Path:
        from hf_models import make_model_dir

        return make_model_dir("qwen2", self.root / "hf", seed=0, vocab_size=256, initializer_range=0.02)

    # ---- graphs
    def export(self, name: str):
        """Export ``name`` (once; ``verify=False``: the tests compare tokens with transformers themselves)."""
        if name not in self._exports:
            from qeff_kv.export import export_model

            model, opts = OWN_GRAPHS[name]
            src = None if model == "bundled" else self.qwen2_hf
            self._exports[name] = export_model(src, self.root / "exports" / Path(name).stem,
                                               ctx_len=OWN_CTX_LEN, prefill_seq_len=OWN_PREFILL,
                                               verify=False, **opts)
        return self._exports[name]

    def __truediv__(self, name: str) -> Path:
        if name not in OWN_GRAPHS:
            pytest.skip(f"{name}: a peer graph without an own counterpart")
        flat = self.dir / name
        if not flat.is_file():
            shutil.copyfile(self.export(name).onnx_path, flat)
        return flat

    # ---- reference tokens: transformers greedy on the same weights
    @cached_property
    def llama_a(self) -> list[int]:
        from hf_models import hf_greedy

        return hf_greedy(self.llama_hf, PROMPT_A, 8)

    @cached_property
    def llama_b(self) -> list[int]:
        from hf_models import hf_greedy

        return hf_greedy(self.llama_hf, PROMPT_B, 8)

    @cached_property
    def qwen2_a(self) -> list[int]:
        from hf_models import hf_greedy

        return hf_greedy(self.qwen2_hf, PROMPT_A, 8)


class PeerGraphs:
    """The peer's graphs, with the reference tokens of its README."""

    kind = "peer"
    llama_a, llama_b, qwen2_a = PEER_LLAMA_A, PEER_LLAMA_B, PEER_QWEN2_A

    def __init__(self, folder: Path):
        self.dir = folder

    def __repr__(self) -> str:
        return "peer"

    def __truediv__(self, name: str) -> Path:
        return self.dir / name


def pytest_report_header(config):
    if HAS_PEER:
        return f"peer graphs: {PEER_DIR}"
    return (f"peer graphs: {PEER_MISSING}; interop tests skip, the peer variants of own-behaviour tests "
            "(fixture `graphs`) are not collected")


@pytest.fixture(scope="session")
def peer_dir() -> Path:
    if not HAS_PEER:
        pytest.skip(PEER_MISSING)
    return PEER_DIR


@pytest.fixture(scope="session")
def peer2_dir() -> Path:
    if not HAS_PEER2:
        pytest.skip(PEER2_MISSING)
    return PEER2_DIR


@pytest.fixture(scope="session")
def own_graphs(tmp_path_factory) -> OwnGraphs:
    if not HAS_TORCH:
        pytest.skip("making the test graphs needs the [export] extra (torch, transformers)")
    return OwnGraphs(tmp_path_factory.mktemp("own-graphs"))


@pytest.fixture(scope="session")
def peer_graphs(peer_dir) -> PeerGraphs:
    return PeerGraphs(peer_dir)


@pytest.fixture(scope="session", params=["own", "peer"] if HAS_PEER else ["own"])
def graphs(request):
    """Our graphs, then the peer's (where present): same file names, each with its reference tokens."""
    return request.getfixturevalue(f"{request.param}_graphs")


# Export folders (with manifest.json and tokenizer) as `qeff-kv export` writes them; ctx_len 64, prefill 8
# (``own_graph``, portable without a prefix, is used by the runtime tests alone: tests/runtime/conftest.py).
@pytest.fixture(scope="session")
def own_vllm_graph(own_graphs) -> Path:
    """Portable, prefix VLLM."""
    return own_graphs.export("qeff_llama_vllm.onnx").out_dir


@pytest.fixture(scope="session")
def own_cb_graph(own_graphs) -> Path:
    """Portable, continuous batching (full_batch_size 3), prefix VLLM."""
    return own_graphs.export("qeff_llama_cb_vllm.onnx").out_dir


@pytest.fixture(scope="session")
def own_fused_graph(own_graphs) -> Path:
    """onnxruntime-fused, prefix VLLM."""
    return own_graphs.export("own_llama_fused_vllm.onnx").out_dir


# ------------------------------------------------------------------ the family matrix (tests/helpers/families.py)
# Each tiny family model is built once per session and each (family, target) exported once, whichever test
# file asks first: tests/export/test_families.py (the matrix) and the targeted family tests share them
# (``family_refs``, transformers' tokens for the matrix, is in tests/export/conftest.py).
@pytest.fixture(scope="session")
def family_models(tmp_path_factory):
    from families import make_family_dir

    root = tmp_path_factory.mktemp("families")
    cache: dict = {}

    def get(name: str) -> Path:
        if name not in cache:
            cache[name] = make_family_dir(name, root)
        return cache[name]

    return get


@pytest.fixture(scope="session")
def family_exports(family_models, tmp_path_factory):
    """``get(name, target)``: the export (verified at export) at the matrix's ctx_len and chunk, or the
    exception export raised (a refusal is a result under test)."""
    from families import CHUNK, CTX
    from qeff_kv.export import export_model

    root = tmp_path_factory.mktemp("family_exports")
    cache: dict = {}
    notes: dict = {}   # (name, target) -> the export's progress lines

    def get(name: str, target: str):
        key = (name, target)
        if key not in cache:
            notes[key] = []
            try:
                cache[key] = export_model(family_models(name), root / f"{name}-{target}", ctx_len=CTX,
                                          prefill_seq_len=CHUNK, target=target, progress=notes[key].append)
            except Exception as exc:  # noqa: BLE001
                cache[key] = exc
        return cache[key]

    get.root = root
    get.notes = notes
    return get


@pytest.fixture(scope="session")
def int8_kv_export(family_models, tmp_path_factory):
    """The tiny llama exported ``--target onnxruntime-fused --kv-cache-dtype int8`` at the matrix's ctx_len and
    chunk (verified at export against the reference with the int8 cache emulated): export and runtime tests."""
    from families import CHUNK, CTX
    from qeff_kv.export import export_model

    return export_model(family_models("llama"), tmp_path_factory.mktemp("int8_kv") / "llama", ctx_len=CTX,
                        prefill_seq_len=CHUNK, target="onnxruntime-fused", kv_cache_dtype="int8")


@pytest.fixture(scope="session")
def int4_kv_export(family_models, tmp_path_factory):
    """The tiny llama exported ``--target onnxruntime-fused --kv-cache-dtype int4`` (GroupQueryAttention's packed
    4-bit cache), verified at export against the reference with the int4 cache emulated."""
    from families import CHUNK, CTX
    from qeff_kv.export import export_model

    return export_model(family_models("llama"), tmp_path_factory.mktemp("int4_kv") / "llama", ctx_len=CTX,
                        prefill_seq_len=CHUNK, target="onnxruntime-fused", kv_cache_dtype="int4")


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path_factory, monkeypatch):
    """Keep the export cache of every test away from the user's ~/.cache."""
    monkeypatch.setenv("QEFF_KV_HOME", str(tmp_path_factory.getbasetemp() / "qeff_kv_home"))


