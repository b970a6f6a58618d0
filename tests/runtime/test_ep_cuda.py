"""The CUDA execution provider's proof (issue 40), GPU only: the conformance script (``tests/helpers/_ep_script.py``:
chunked prefill with a short last chunk, greedy decode, truncate and the tokens fed again, and with two or more
sequences copy, both decoding in one step, relocate) runs through ``Session(..., device="cuda")`` and through the
CPU on the same graph; the tokens must be equal and the logits close (CUDA's float arithmetic, TF32 included,
differs in the last digits: round 1 on an H100 measured at most 0.014 on the tiny graphs).

The graphs: every memory kind (full with lock-step rows, ring, recurrent, hybrid) of the portable and onnxruntime
targets, the latent cache and continuous batching (latent, recurrent, ring, CCL, three-slot full), and the fused
target (these need the exporter: torch and transformers); and, without the exporter, the graphs of
``benchmarks/gpu_check_prepare.py`` in the folder ``QEFF_KV_GPU_GRAPHS`` names (what a GPU machine is given). Each
proved row of ``runtime/execution/ep_proofs.py`` for CUDA names this file.

Where this onnxruntime has no CUDA EP, the whole file skips in one line.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

CUDA = "CUDAExecutionProvider"
if CUDA not in ort.get_available_providers():
    pytest.skip(f"{CUDA} is not in this onnxruntime ({', '.join(ort.get_available_providers())}): the CUDA proof "
                "runs on a GPU machine", allow_module_level=True)

from _ep_script import script  # noqa: E402
from suite import requires_torch  # noqa: E402
from qeff_kv.runtime import Session  # noqa: E402
from qeff_kv.runtime.execution.executor import RebindingExecutor  # noqa: E402
from test_ep_conformance import extra_exports  # noqa: E402,F401  (the fixture: the same graphs as the CPU's proof)

#: a logit may differ by ATOL + RTOL * max|logit| (the tokens must be equal)
ATOL, RTOL = 0.05, 0.01
GRAPHS = Path(os.environ["QEFF_KV_GPU_GRAPHS"]) if os.environ.get("QEFF_KV_GPU_GRAPHS") else None
#: the tiny graphs there (not a skeleton: random weights at fp16 leave margins arithmetic may flip)
CARRIED = sorted(p.name for p in GRAPHS.iterdir()
                 if (p / "manifest.json").is_file() and not (p / "skeleton.json").is_file()) if GRAPHS else []


def assert_cuda_gives_the_cpus_tokens(model, **kwargs) -> list[int]:
    cpu_toks, cpu_logits = script(Session(model, **kwargs))
    sess = Session(model, device="cuda", **kwargs)
    assert sess.binding.executor_session.get_providers()[0] == CUDA and type(sess.binding.io) is RebindingExecutor
    toks, logits = script(sess)
    assert toks == cpu_toks
    for got, want in zip(logits, cpu_logits):
        np.testing.assert_allclose(got, want, rtol=0, atol=ATOL + RTOL * float(np.max(np.abs(want))))
    return toks


@requires_torch
@pytest.mark.parametrize("target", ["portable", "onnxruntime"])
@pytest.mark.parametrize("family,rows", [("llama", 2), ("mistral_sw", 1), ("mamba2", 1), ("bamba", 1)])
def test_cuda_gives_the_cpus_tokens_on_every_memory_kind(family, rows, target, family_exports):
    assert_cuda_gives_the_cpus_tokens(family_exports(family, target).out_dir, max_sequences=rows)


@requires_torch
@pytest.mark.parametrize("name", ["latent-portable", "latent-cb", "recurrent-cb", "ring-cb", "ccl-cb"])
def test_cuda_gives_the_cpus_tokens_on_latent_and_batched_graphs(name, extra_exports):
    assert_cuda_gives_the_cpus_tokens(extra_exports(name))


@requires_torch
@pytest.mark.parametrize("graph", ["qeff_llama_cb_vllm.onnx", "own_llama_ort_cb_vllm.onnx",
                                   "own_llama_fused_vllm.onnx"])
def test_cuda_gives_the_cpus_tokens_with_continuous_batching_and_on_the_fused_target(graph, own_graphs):
    assert_cuda_gives_the_cpus_tokens(own_graphs.export(graph).out_dir)


@pytest.mark.skipif(GRAPHS is None, reason="QEFF_KV_GPU_GRAPHS names no folder of benchmarks/gpu_check_prepare.py")
@pytest.mark.parametrize("case", CARRIED or ["none"])
def test_cuda_gives_the_cpus_tokens_on_the_gpu_check_graphs(case):
    """Lock-step rows on the full-buffer graphs; one sequence on the ring and hybrid ones (lock step refuses
    them); the continuous-batching graphs at their slots."""
    rows = 2 if case.startswith("llama") and "-cb" not in case else None
    assert_cuda_gives_the_cpus_tokens(GRAPHS / case, max_sequences=rows)
