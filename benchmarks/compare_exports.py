"""Prove a refactor of the exporter leaves every exported graph unchanged.

``export --out DIR``: export a matrix of tiny seeded models (every family of ``tests/helpers/families.py`` on the three
targets, plus continuous batching, a prefix, CCL, ring/full sliding caches, int4/int8 weights, float16, and the
VLMs of ``tests/helpers/hf_models.py`` in both layouts) with whatever ``qeff_kv`` is on the path, ``verify=False``.
Each export goes to ``DIR/<case>/``; a refusal is recorded as ``DIR/<case>/REFUSED`` holding its message.

``compare BEFORE AFTER``: every ``.onnx`` file of each case compared exactly: nodes (op, domain, inputs,
outputs, attributes), initializers (name, dtype, dims, bytes), inputs/outputs (name, type, shape), local
functions, opset imports. Metadata (``metadata_props``, producer, doc strings) is ignored. Refusals must match, and
the manifests too (but for ``source``, a temporary folder, and the new ``state_spec``).
Exit code 1 on any difference.

Exports run with ``PYTHONHASHSEED=0`` (set by the script): transformers iterates over a set of layer types
(Gemma3), so the order of some traced nodes follows string hashing.

Run the baseline from a pristine copy of the code::

    cp -r qeff_kv /tmp/qeff_baseline/ && PYTHONPATH=/tmp/qeff_baseline nice -n 10 \\
        .venv/bin/python benchmarks/compare_exports.py export --out /tmp/exports_before
    nice -n 10 .venv/bin/python benchmarks/compare_exports.py export --out /tmp/exports_after
    .venv/bin/python benchmarks/compare_exports.py compare /tmp/exports_before /tmp/exports_after

``--only A,B`` restricts either command to the cases whose name contains A or B.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "helpers"))

TARGETS = ("portable", "onnxruntime", "onnxruntime-fused")
VLMS = ("make_llava_dir", "make_gemma3_vlm_dir", "make_qwen25vl_dir", "make_internvl_dir", "make_mistral3_dir")


def cases() -> list[tuple[str, str, str, dict]]:
    """(case name, model kind, model name, export kwargs)."""
    from families import CHUNK, CTX, FAMILIES

    out = []
    for fam in FAMILIES:
        for t in TARGETS:
            out.append((f"{fam}-{t}", "family", fam, dict(ctx_len=CTX, prefill_seq_len=CHUNK, target=t)))
    # options on a representative subset
    for fam in ("llama", "gemma2_sw", "gpt_oss_sw", "deepseek_v3"):
        for t in ("portable", "onnxruntime"):
            out.append((f"{fam}-{t}-cb", "family", fam,
                        dict(ctx_len=CTX, prefill_seq_len=CHUNK, target=t, continuous_batching=True,
                             full_batch_size=2)))
            out.append((f"{fam}-{t}-ccl", "family", fam,
                        dict(ctx_len=CTX, prefill_seq_len=CHUNK, target=t, ccl=[16, CTX])))
            out.append((f"{fam}-{t}-cb-ccl-prefix", "family", fam,
                        dict(ctx_len=CTX, prefill_seq_len=CHUNK, target=t, continuous_batching=True,
                             full_batch_size=2, ccl=[16, CTX], kv_cache_prefix="VLLM")))
        for t in TARGETS:
            out.append((f"{fam}-{t}-prefix", "family", fam,
                        dict(ctx_len=CTX, prefill_seq_len=CHUNK, target=t, kv_cache_prefix="VLLM")))
    for fam in ("gemma2_sw", "gemma3_sw", "mistral_sw", "qwen2_sw"):
        for t in ("portable", "onnxruntime"):
            out.append((f"{fam}-{t}-fullcache", "family", fam,
                        dict(ctx_len=CTX, prefill_seq_len=CHUNK, target=t, sliding_cache="full")))
    for fam in ("llama", "mixtral", "gemma2_sw"):
        for t in ("onnxruntime", "onnxruntime-fused"):
            out.append((f"{fam}-{t}-int4", "family", fam,
                        dict(ctx_len=CTX, prefill_seq_len=CHUNK, target=t, weights="int4", block_size=32)))
        out.append((f"{fam}-onnxruntime-int8", "family", fam,
                    dict(ctx_len=CTX, prefill_seq_len=CHUNK, target="onnxruntime", weights="int8")))
    for fam in ("llama", "gemma2_sw"):
        for t in TARGETS:
            out.append((f"{fam}-{t}-fp16", "family", fam,
                        dict(ctx_len=CTX, prefill_seq_len=CHUNK, target=t, dtype="float16")))
    out.append(("llama-portable-prefill1", "family", "llama", dict(ctx_len=CTX, prefill_seq_len=1)))
    for maker in VLMS:
        ctx, chunk = (48, 16) if maker == "make_gemma3_vlm_dir" else (48, 4)
        extra = dict(image_size=16) if maker == "make_qwen25vl_dir" else {}
        for t in TARGETS:
            for single in (False, True):
                out.append((f"{maker[5:-4]}-{t}-{'single' if single else 'dual'}", "vlm", maker,
                            dict(ctx_len=ctx, prefill_seq_len=chunk, target=t, single_graph=single,
                                 kv_cache_prefix="VLLM", **extra)))
    return out


def _selected(name: str, only: str | None) -> bool:
    return not only or any(part in name for part in only.split(","))


def export(out: Path, only: str | None) -> int:
    import qeff_kv
    from families import make_family_dir
    import hf_models
    from qeff_kv.export import export_model

    print(f"qeff_kv from {qeff_kv.__file__}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    models: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for name, kind, model, kw in cases():
            if not _selected(name, only):
                continue
            dest = out / name
            if dest.exists():
                continue
            if model not in models:
                models[model] = (make_family_dir(model, tmp) if kind == "family"
                                 else getattr(hf_models, model)(tmp / model))
            work = out / f".{name}.partial"
            try:
                export_model(models[model], work, verify=False, **kw)
            except Exception as exc:  # noqa: BLE001  a refusal is a result to compare
                work.mkdir(parents=True, exist_ok=True)
                msg = f"{type(exc).__name__}: {exc}"
                if not type(exc).__name__.endswith("Error") or type(exc).__module__ != "qeff_kv.errors":
                    msg += "\n" + traceback.format_exc()
                (work / "REFUSED").write_text(msg)
            work.rename(dest)
            print(name, "refused" if (dest / "REFUSED").exists() else "ok", flush=True)
    return 0


def _digest(model) -> dict:
    """Everything of an ONNX model but its metadata, as comparable values."""
    import onnx
    from onnx import numpy_helper

    def vi(v):
        return (v.name, onnx.helper.printable_type(v.type))

    def node(n):
        return (n.op_type, n.domain, n.name, tuple(n.input), tuple(n.output),
                tuple((a.name, onnx.helper.printable_attribute(a)) for a in n.attribute))

    def graph(g):
        inits = {}
        for t in g.initializer:
            arr = numpy_helper.to_array(t)
            inits[t.name] = (t.data_type, tuple(t.dims), hashlib.sha256(arr.tobytes()).hexdigest())
        for n in g.node:
            for a in n.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    inits.update({f"{n.name}/{a.name}/{k}": v for k, v in graph(a.g)["initializers"].items()})
        return dict(nodes=[node(n) for n in g.node], initializers=inits, inputs=[vi(v) for v in g.input],
                    outputs=[vi(v) for v in g.output])

    return dict(graph=graph(model.graph),
                functions=[(f.domain, f.name, [node(n) for n in f.node], list(f.input), list(f.output))
                           for f in model.functions],
                opsets=sorted((o.domain, o.version) for o in model.opset_import),
                ir_version=model.ir_version)


#: manifest entries that may differ between two exports of the same graphs: where the model was read from (a
#: temporary folder) and the state spec (new); durations (``seconds``) and file sizes (``graph_bytes``: they count
#: the metadata) are dropped everywhere
MANIFEST_IGNORED = ("source", "state_spec")


def _manifest(folder: Path) -> dict:
    import json

    def timeless(v):   # durations differ run to run; file sizes include the graph's metadata
        if isinstance(v, dict):
            return {k: timeless(x) for k, x in v.items() if k not in ("seconds", "graph_bytes", "float_graph_bytes")}
        return [timeless(x) for x in v] if isinstance(v, list) else v

    m = json.loads((folder / "manifest.json").read_text())
    return timeless({k: v for k, v in m.items() if k not in MANIFEST_IGNORED})


def compare(before: Path, after: Path, only: str | None) -> int:
    import onnx

    names = sorted(p.name for p in before.iterdir() if p.is_dir() and not p.name.startswith("."))
    names = [n for n in names if _selected(n, only)]
    bad = compared = 0
    for name in names:
        a, b = before / name, after / name
        if not b.is_dir():
            print(f"MISSING {name}")
            bad += 1
            continue
        ra, rb = (a / "REFUSED"), (b / "REFUSED")
        if ra.exists() or rb.exists():
            same = ra.exists() and rb.exists() and ra.read_text() == rb.read_text()
            print(f"{'same refusal' if same else 'DIFFERENT REFUSAL'} {name}")
            bad += not same
            continue
        fa = sorted(p.name for p in a.glob("*.onnx"))
        fb = sorted(p.name for p in b.glob("*.onnx"))
        if fa != fb:
            print(f"DIFFERENT FILES {name}: {fa} vs {fb}")
            bad += 1
            continue
        ma, mb = _manifest(a), _manifest(b)
        if ma != mb:
            bad += 1
            keys = sorted(k for k in set(ma) | set(mb) if ma.get(k) != mb.get(k))
            print(f"DIFFERENT MANIFEST {name}: {', '.join(keys)}")
        for f in fa:
            da, db = _digest(onnx.load(a / f)), _digest(onnx.load(b / f))
            compared += 1
            if da != db:
                bad += 1
                for key in ("graph", "functions", "opsets", "ir_version"):
                    if da[key] != db[key]:
                        detail = key
                        if key == "graph":
                            detail = ", ".join(k for k in da[key] if da[key][k] != db[key][k])
                        print(f"DIFFERENT {name}/{f}: {detail}")
            else:
                print(f"identical {name}/{f}")
    print(f"{compared} graphs compared over {len(names)} cases, {bad} differences")
    return 1 if bad else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export")
    e.add_argument("--out", type=Path, required=True)
    e.add_argument("--only")
    c = sub.add_parser("compare")
    c.add_argument("before", type=Path)
    c.add_argument("after", type=Path)
    c.add_argument("--only")
    sub.add_parser("list")
    a = p.parse_args(argv)
    if a.cmd == "export" and os.environ.get("PYTHONHASHSEED") != "0":
        # transformers iterates over sets of layer types (Gemma3's rotary modules): string hashing decides the
        # order of traced nodes, so both sides export with the same hash seed
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "PYTHONHASHSEED": "0"})
    if a.cmd == "export":
        return export(a.out, a.only)
    if a.cmd == "list":
        for name, *_ in cases():
            print(name)
        return 0
    return compare(a.before, a.after, a.only)


if __name__ == "__main__":
    sys.exit(main())
