"""Shared test fixtures.

Two sets of retained-state graphs:

* **own graphs**, made by the tests themselves (exported once per session, lazily, from the bundled default
  model and a tiny seeded Qwen2): every test of qeff-kv's own behaviour runs on them, so a fresh clone tests
  its runtime without anything else;
* **peer graphs**, read from ../shared/fixtures/qeff-peer (or ``QEFF_KV_PEER_FIXTURES``): the tests that are
  about interoperating with the peer's exporter (QEfficient); they skip with a reason where that folder is
  absent. Its vision-language and CCL graphs, with their tiny models, are in ../shared/fixtures/qeff-peer-vlm (or
  ``QEFF_KV_PEER_VLM_FIXTURES``; fixture ``peer_vlm_dir``, tests/test_peer_vlm.py); its MLA latent, speculative-target,
  hybrid recurrent and sliding-window graphs in ../shared/fixtures/qeff-peer-2 (or ``QEFF_KV_PEER2_FIXTURES``;
  fixture ``peer2_dir``, tests/test_peer_round2.py).

``graphs`` is parametrized over both (``own``, ``peer``): a test of our own behaviour written against it runs
on our exports and on the peer's files of the same names, and compares with each set's own reference tokens.
Without the peer folder its ``peer`` variants are not collected (the header of the run says so): they repeat
tests that already ran on our graphs, and would only swell the skip count. Tests about the peer's graphs
themselves (``peer_dir``, ``peer_graph``, and the ``peer-*`` cases of ``any_graph``/``ALL_GRAPHS``) are always
collected and skip with the reason.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from functools import cached_property
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PEER_DIR = Path(os.environ.get("QEFF_KV_PEER_FIXTURES", REPO.parent / "shared" / "fixtures" / "qeff-peer"))
HAS_PEER = (PEER_DIR / "README.md").is_file()
PEER_MISSING = f"peer fixtures not found at {PEER_DIR} (set QEFF_KV_PEER_FIXTURES to their folder)"
#: The peer's vision-language and CCL graphs, with the tiny models they were made from (tests/test_peer_vlm.py).
PEER_VLM_DIR = Path(os.environ.get("QEFF_KV_PEER_VLM_FIXTURES", REPO.parent / "shared" / "fixtures" / "qeff-peer-vlm"))
HAS_PEER_VLM = (PEER_VLM_DIR / "README.md").is_file()
PEER_VLM_MISSING = (f"peer vision-language fixtures not found at {PEER_VLM_DIR} (set QEFF_KV_PEER_VLM_FIXTURES to "
                    "their folder)")
#: The peer's round-two graphs (MLA latent, speculative target, hybrid recurrent, sliding window) with their tiny
#: models (tests/test_peer_round2.py).
PEER2_DIR = Path(os.environ.get("QEFF_KV_PEER2_FIXTURES", REPO.parent / "shared" / "fixtures" / "qeff-peer-2"))
HAS_PEER2 = (PEER2_DIR / "README.md").is_file()
PEER2_MISSING = f"peer round-two fixtures not found at {PEER2_DIR} (set QEFF_KV_PEER2_FIXTURES to their folder)"
PEER_GRAPHS = [
    "qeff_llama_default.onnx",
    "qeff_llama_vllm.onnx",
    "qeff_llama_cb_default.onnx",
    "qeff_llama_cb_vllm.onnx",
    "qeff_llama_subfn_vllm.onnx",
    "qeff_qwen2_vllm.onnx",
]
HAS_TORCH = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("transformers") is not None

requires_torch = pytest.mark.skipif(not HAS_TORCH, reason="needs the [export] extra (torch, transformers)")

#: Prompts of the peer's README (token ids below 256, the vocabulary of both tiny models).
PROMPT_A = [5, 17, 42, 99, 130, 7, 201, 64]
PROMPT_B = [250, 3, 88, 19, 160, 45, 12, 222]
#: The peer's README reference tokens (greedy, 8 new tokens, from transformers on the peer's tiny models).
PEER_LLAMA_A = [124, 176, 188, 78, 77, 163, 243, 166]
PEER_LLAMA_B = [53, 42, 18, 53, 42, 18, 53, 42]
PEER_QWEN2_A = [108, 48, 11, 28, 105, 147, 141, 48]

#: Our own graphs: file name (the peer's name where the peer has such a graph) -> (model, export options).
#: "bundled" is the bundled default (a tiny Llama, vocab 256); "qwen2" a tiny seeded Qwen2 of the same sizes.
#: Every one is portable unless its options say otherwise, ctx_len 64, prefill 8.
OWN_CTX_LEN, OWN_PREFILL = 64, 8
OWN_GRAPHS: dict[str, tuple[str, dict]] = {
    "qeff_llama_default.onnx": ("bundled", {}),
    "qeff_llama_vllm.onnx": ("bundled", dict(kv_cache_prefix="VLLM")),
    "qeff_llama_cb_default.onnx": ("bundled", dict(continuous_batching=True, full_batch_size=3)),
    "qeff_llama_cb_vllm.onnx": ("bundled", dict(kv_cache_prefix="VLLM", continuous_batching=True,
                                                 full_batch_size=3)),
    "qeff_qwen2_vllm.onnx": ("qwen2", dict(kv_cache_prefix="VLLM")),
    "own_llama_fused_vllm.onnx": ("bundled", dict(kv_cache_prefix="VLLM", target="onnxruntime-fused")),
    "own_llama_ort_cb_vllm.onnx": ("bundled", dict(kv_cache_prefix="VLLM", target="onnxruntime",
                                                   continuous_batching=True, full_batch_size=3)),
}
#: The own graphs that mirror a peer graph (same file name, same model sizes and KV contract).
OWN_AS_PEER = [n for n in PEER_GRAPHS if n in OWN_GRAPHS]
#: (set, file name) of every graph of the peer's kinds: ours first, then the peer's (skipped without them).
ALL_GRAPHS = [("own", n) for n in OWN_AS_PEER] + [("peer", n) for n in PEER_GRAPHS]


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
def peer_vlm_dir() -> Path:
    if not HAS_PEER_VLM:
        pytest.skip(PEER_VLM_MISSING)
    return PEER_VLM_DIR


@pytest.fixture(params=PEER_GRAPHS)
def peer_graph(request, peer_dir) -> Path:
    return peer_dir / request.param


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


@pytest.fixture(params=ALL_GRAPHS, ids=[f"{k}-{n}" for k, n in ALL_GRAPHS])
def any_graph(request) -> Path:
    """Each of our graphs that mirrors a peer graph (a bare .onnx of the same name), then each peer graph."""
    kind, name = request.param
    return request.getfixturevalue(f"{kind}_graphs") / name


# Export folders (with manifest.json and tokenizer) as `qeff-kv export` writes them; ctx_len 64, prefill 8.
@pytest.fixture(scope="session")
def own_graph(own_graphs) -> Path:
    """Portable, no prefix."""
    return own_graphs.export("qeff_llama_default.onnx").out_dir


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


# ------------------------------------------------------------------ the family matrix (tests/families.py)
# Each tiny family model is built once per session and each (family, target) exported once, whichever test
# file asks first: tests/test_families.py (the matrix) and the targeted family tests share them.
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
def family_refs(family_models):
    """transformers' greedy tokens for the matrix prompts."""
    from families import FAMILIES, NEW, PROMPTS
    from hf_models import hf_greedy, hf_greedy_whole

    cache: dict = {}

    def get(name: str) -> list[list[int]]:
        if name not in cache:
            greedy = hf_greedy_whole if FAMILIES[name].recurrent else hf_greedy
            cache[name] = [greedy(family_models(name), p, NEW) for p in PROMPTS]
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

    def get(name: str, target: str):
        key = (name, target)
        if key not in cache:
            try:
                cache[key] = export_model(family_models(name), root / f"{name}-{target}", ctx_len=CTX,
                                          prefill_seq_len=CHUNK, target=target)
            except Exception as exc:  # noqa: BLE001
                cache[key] = exc
        return cache[key]

    get.root = root
    return get


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path_factory, monkeypatch):
    """Keep the export cache of every test away from the user's ~/.cache."""
    monkeypatch.setenv("QEFF_KV_HOME", str(tmp_path_factory.getbasetemp() / "qeff_kv_home"))


@pytest.fixture(scope="session")
def llava_cb_export(tmp_path_factory) -> Path:
    """The tiny seeded Llava of tests/hf_models.py with its working processor (one 32x32 image: 16 ``<image>``
    tokens), exported once per session for continuous batching (2 slots; ctx_len 64, prefill 8): what a server
    runs images on (tests/test_serve_images.py)."""
    if not HAS_TORCH:
        pytest.skip("making the tiny Llava needs the [export] extra (torch, transformers)")
    from hf_models import add_llava_processor, make_llava_dir

    from qeff_kv.export import export_model

    model_dir = make_llava_dir(tmp_path_factory.mktemp("llava-cb-model"))
    add_llava_processor(model_dir)
    return export_model(model_dir, tmp_path_factory.mktemp("llava-cb") / "llava", ctx_len=64, prefill_seq_len=8,
                        continuous_batching=True, full_batch_size=2).out_dir
