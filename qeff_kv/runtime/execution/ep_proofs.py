"""Which onnxruntime execution provider (EP) is proved exact for which graph kind: the one table the runtime asks
before it loads a graph, and the one-line refusals it gives (:class:`~qeff_kv.errors.ProviderError`).

A graph *kind* is the target that wrote it (``portable``, ``onnxruntime``, ``onnxruntime-fused``: graph metadata
``qeff_kv.target``), ``peer`` (another exporter's graph: no target recorded) or ``vision`` (a dual layout's vision
encoder). *Proved* means: the runtime's own feeds, on that EP, give the reference tokens (greedy; transformers on
the same weights, or the CPU EP's, itself proved), by a test in the suite. An EP that is not proved for a kind is
refused before anything is loaded: a wrong answer that passes is the worst outcome, and onnxruntime accepts any EP
it has without a word (measured on an H100: a session binding its host buffers once got wrong tokens from the
CUDA EP on every graph, because onnxruntime copies a bound host input at bind time: :mod:`.device`).

What is proved today (each row has its test, named in :data:`PROVED`):

* the CPU EP, every kind: the family matrix and the runtime's parity tests compare tokens with transformers;
* the CUDA EP, the portable, onnxruntime and onnxruntime-fused targets: ``tests/runtime/test_ep_cuda.py`` (a GPU-only test:
  it skips in one line where onnxruntime has no CUDA EP) runs the conformance script (chunked prefill, decode,
  truncate, copy, relocate; lock-step rows and continuous batching) through ``Session(device="cuda")`` and
  through the CPU, on the full, ring, latent, recurrent, hybrid and CCL graphs of both targets and a fused graph:
  the tokens must be equal. Measured first on an H100 (``benchmarks/gpu_check.py``, ``docs/runtime.md``): with
  every input bound again before each run (which is what a session on CUDA does, :mod:`.device`) the CPU's tokens
  on all six graphs (portable fp32/fp16, ring, hybrid, onnxruntime, fused).
* no other EP. What is known about each kind off the CPU is :data:`OFF_CPU` (said in the refusal): the peer's graphs
  need the CPU-only patch of their invalid gather/scatter indices (:mod:`qeff_kv.graph.passes.ort_invalid_index`);
  the vision encoder's embeddings were never compared off the CPU.

A new proof is one entry in :data:`PROVED` (with the test that proves it) and nothing else.

The one way past a refusal is a measurement hook, for gathering the proof itself (``benchmarks/gpu_check.py``):
the environment variable :data:`MEASURE_ENV` set to ``1`` lets :func:`require` pass an unproved EP, with a
``RuntimeWarning`` naming it; the session runs as on a proved EP (host buffers, rebound before each run:
:mod:`.device`). Never for serving.
"""

from __future__ import annotations

import os
import warnings
from typing import Sequence as Seq

from qeff_kv.errors import ProviderError

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"
#: ``device=`` (``--device``) -> the EP it runs on
DEVICES = {"cpu": CPU, "cuda": CUDA}
KINDS = ("portable", "onnxruntime", "onnxruntime-fused", "peer", "vision")

#: (EP, graph kind) -> the test that proves it exact
PROVED: dict[tuple[str, str], str] = {
    (CPU, "portable"): "tests/export/test_families.py (tokens equal to transformers)",
    (CPU, "onnxruntime"): "tests/export/test_families.py (tokens equal to transformers)",
    (CPU, "onnxruntime-fused"): "tests/export/test_fused_families.py (tokens equal to transformers)",
    (CPU, "peer"): "tests/runtime/test_runtime_parity.py (the peer's reference tokens)",
    (CPU, "vision"): "tests/runtime/test_vlm_runtime.py (tokens equal to transformers)",
    (CUDA, "portable"): "tests/runtime/test_ep_cuda.py (GPU only: tokens equal to the CPU's)",
    (CUDA, "onnxruntime"): "tests/runtime/test_ep_cuda.py (GPU only: tokens equal to the CPU's)",
    (CUDA, "onnxruntime-fused"): "tests/runtime/test_ep_cuda.py (GPU only: tokens equal to the CPU's)",
}

#: graph kind -> what is known of it on an EP other than the CPU's (why it is not proved there)
OFF_CPU: dict[str, str] = {
    "portable": ("its feeds conform to the ONNX spec (onnx's reference evaluator gives the CPU's tokens) and it is "
                 "proved on CUDA, but no run on this EP has compared its tokens"),
    "onnxruntime": ("its feeds conform to the ONNX spec (onnx's reference evaluator gives the CPU's tokens) and it "
                    "is proved on CUDA, but no run on this EP has compared its tokens"),
    "onnxruntime-fused": ("its onnxruntime contrib ops (GroupQueryAttention, SkipSimplifiedLayerNormalization) "
                          "are outside the ONNX spec and each EP's kernels differ; proved on CUDA only"),
    "peer": ("another exporter's graph relies on a CPU-only patch of its out-of-range gather/scatter indices "
             "(INT32_MAX)"),
    "vision": "no run on this EP has compared the image embeddings",
}


#: the measurement hook (module docstring): ``QEFF_KV_MEASURE_UNPROVED_EP=1`` runs an unproved EP, with a warning
MEASURE_ENV = "QEFF_KV_MEASURE_UNPROVED_EP"


def measuring() -> bool:
    """Whether the measurement hook is on (:data:`MEASURE_ENV` is ``"1"``)."""
    return os.environ.get(MEASURE_ENV) == "1"


def proved(provider: str, kind: str) -> bool:
    """Whether ``provider`` is proved exact for graphs of ``kind``."""
    return (provider, kind) in PROVED


def refusal(provider: str, kind: str | None = None) -> str | None:
    """Why ``provider`` is refused for ``kind`` (``None``: for every kind it may meet before the graph is read), or
    ``None`` when it is proved."""
    kinds = KINDS if kind is None else (kind,)
    missing = [k for k in kinds if not proved(provider, k)]
    if not missing:
        return None
    if kind is None and len(missing) < len(KINDS):
        return None   # proved for some kind: the graph decides (require(..., kind) once it is read)
    if kind is None:
        return (f"{provider} is not proved exact for any graph kind: no run on it has compared tokens with the "
                "reference; run on the CPU (device 'cpu')")
    return f"{provider} is not proved exact for {kind} graphs: {OFF_CPU[kind]}; run on the CPU (device 'cpu')"


def resolve(device: str | None, providers: Seq[str] | None) -> list[str]:
    """The EPs a session runs on, from ``device`` (``"cpu"`` when neither is given) or ``providers``; one line when
    they disagree or name an unknown device. Proofs are checked by :func:`require`."""
    if device is not None and device not in DEVICES:
        raise ProviderError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    if providers is None:
        return [DEVICES[device or "cpu"]]
    if device is not None and DEVICES[device] != providers[0]:
        raise ProviderError(f"device {device!r} runs on {DEVICES[device]}, but providers start with "
                            f"{providers[0]}; give one of them")
    return list(providers)


def require(providers: Seq[str], kind: str | None = None) -> None:
    """Refuse, in one line naming the EP and why, any of ``providers`` not proved for ``kind`` (``None``: before the
    graph is read, an EP proved for no kind at all); with the measurement hook on, warn instead."""
    for p in providers:
        why = refusal(p, kind)
        if why is not None and measuring():
            warnings.warn(f"{MEASURE_ENV}=1: running an unproved EP for a measurement: {why}", RuntimeWarning,
                          stacklevel=3)
        elif why is not None:
            raise ProviderError(why)


def kind_of(target: str | None, *, vision: bool = False) -> str:
    """The graph kind of a graph whose metadata records ``target`` (``None``: another exporter's)."""
    if vision:
        return "vision"
    if target is None:
        return "peer"
    return target if target in KINDS else "peer"
