"""The quality check of an int4/int8 export on natural text: a fixed English paragraph (:data:`NATURAL_TEXT`) read
teacher-forced by the quantized graph and by a float reference (the float graph, or the float PyTorch model with
its weights streamed where no float graph exists); the top-1 agreement and the perplexity ratio, refused loudly in
the manifest (``"failed"``) past :data:`MAX_PERPLEXITY_RATIO` (the export is kept: the user chooses)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from qeff_kv.errors import VerificationError
from qeff_kv.export.probe_runner import ProbeRunner, first_line
from qeff_kv.export.schemes import WeightScheme

#: the paragraph both graphs read (teacher-forced) when the export has a tokenizer
NATURAL_TEXT = ("The old lighthouse stood at the edge of the harbour, and every evening the keeper climbed its "
                "narrow stairs to light the lamp. Ships coming home after long weeks at sea looked for its beam "
                "before anything else, because it meant that the rocks were behind them and the town was near.")
#: at most this many of its tokens are read
NATURAL_TOKENS = 48
#: the quantized graph's perplexity on the paragraph may be at most this many times the float graph's
MAX_PERPLEXITY_RATIO = 2.0


def natural_reference(model, tokenizer, ctx_len: int, say) -> dict:
    """The float model's logits at each position of :data:`NATURAL_TEXT` (one forward pass; the streaming
    exporter runs it with the checkpoint's weights streamed module by module): the float side of the quantized
    graph's natural-text check, where there is no float graph."""
    import torch

    ids = list(tokenizer.encode(NATURAL_TEXT).ids)[:min(NATURAL_TOKENS, ctx_len)]
    say(f"reading a natural paragraph ({len(ids)} tokens) with the float weights (the int4/int8 quality check)")
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids], dtype=torch.int64), use_cache=False)
    return {"ids": ids, "rows": out.logits[0, :-1].double().numpy().copy()}


def natural_text_check(float_path: Path, quant_path: Path, ids: list[int], *, ctx_len: int, kv_batch: int = 1,
                       ccl=None, slot: int = 0) -> dict:
    """Both graphs read ``ids`` one token at a time; per position, does the quantized graph's top-1 token equal the
    float graph's, and how likely does each find the text's next token (perplexity)."""
    if len(ids) < 2:
        return natural_verdict(None, None, ids)
    rows = {label: natural_rows(path, ids, ctx_len=ctx_len, kv_batch=kv_batch, ccl=ccl, slot=slot, label=label)
            for label, path in (("float", float_path), ("quantized", quant_path))}
    return natural_verdict(rows["float"], rows["quantized"], ids)


def natural_rows(path: Path, ids: list[int], *, ctx_len: int, kv_batch: int = 1, ccl=None, slot: int = 0,
                 label: str = "quantized") -> np.ndarray:
    """The graph's logits after each of ``ids[:-1]``, read one token at a time (a prefill step returns its last
    row only). A quantized graph's block-quantized MatMuls run prepacked on onnxruntime's float32 kernels
    (:func:`~qeff_kv.export.probe_runner.float32_kernels_copy`): the weights' quality, as the unpacked path
    measured it, and fast (Llama-3.1-8B shape, int4: 0.4 s a decode step against ~55 s unpacked; 4.6 GB resident
    against 6.5 GB at the int8-activation level 4 the graph ships, docs/benchmarks.md); a float graph keeps its
    weights in the memory-mapped file."""
    if len(ids) < 2:
        return np.zeros((0, 0))
    try:
        runner = ProbeRunner(path, ctx_len, kv_batch, ccl, float32_kernels=True)
        rows = np.stack([runner.step([t], [i], slot) for i, t in enumerate(ids[:-1])])
        del runner
    except Exception as exc:
        raise VerificationError(f"the {label} graph could not read the natural-text check "
                                f"({first_line(exc)})") from None
    return rows


def natural_verdict(float_rows, quant_rows, ids: list[int]) -> dict:
    """Top-1 agreement and the perplexity ratio of the quantized rows against the float rows on ``ids``."""
    if len(ids) < 2:
        return {"status": "passed", "tokens": len(ids), "top1_agreement": 1.0, "perplexity_float": 1.0,
                "perplexity_quantized": 1.0, "perplexity_ratio": 1.0, "threshold": MAX_PERPLEXITY_RATIO}
    rows = {"float": np.asarray(float_rows, dtype=np.float64), "quantized": np.asarray(quant_rows, np.float64)}
    nll = {}
    for label, x in rows.items():
        if not np.all(np.isfinite(x)):
            raise VerificationError(f"the {label} graph's logits on natural text are not finite")
        m = x.max(axis=1, keepdims=True)
        lse = (m + np.log(np.exp(x - m).sum(axis=1, keepdims=True)))[:, 0]
        nll[label] = float(np.mean(lse - x[np.arange(len(ids) - 1), ids[1:]]))
    ratio = float(np.exp(nll["quantized"] - nll["float"]))
    agree = float(np.mean(rows["float"].argmax(axis=1) == rows["quantized"].argmax(axis=1)))
    return {"status": "passed" if ratio <= MAX_PERPLEXITY_RATIO else "failed", "tokens": len(ids),
            "top1_agreement": round(agree, 4), "perplexity_float": float(f"{np.exp(nll['float']):.5g}"),
            "perplexity_quantized": float(f"{np.exp(nll['quantized']):.5g}"),
            "perplexity_ratio": float(f"{ratio:.4g}"), "threshold": MAX_PERPLEXITY_RATIO}


def say_natural(scheme: WeightScheme, natural: dict, say, against: str = "graph") -> None:
    say(f"{scheme.scheme}: on a natural paragraph ({natural['tokens']} tokens) top-1 agreement with the float "
        f"{against} {natural['top1_agreement']:.0%}, perplexity {natural['perplexity_quantized']:.4g} vs "
        f"{natural['perplexity_float']:.4g} ({natural['perplexity_ratio']:.3g}x)")
    if natural["status"] != "passed":
        say(f"WARNING: the {scheme.scheme} graph's perplexity on natural text is {natural['perplexity_ratio']:.3g}"
            f" times the float {against}'s (threshold {MAX_PERPLEXITY_RATIO:g}x): its answers will be degraded; the "
            "export is kept, its manifest records the failed check (try --weights int8 or a smaller --block-size)")
