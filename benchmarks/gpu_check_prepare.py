"""Prepare the graphs of ``benchmarks/gpu_check.py`` on the CPU (issue 40's GPU half): tiny seeded random-weight
decoders (the family matrix's configs, ``tests/helpers/families.py``, at a larger vocabulary and context so that 24 greedy
steps after a 40-token prompt vary), each exported here, and the CPU reference: our runtime's greedy tokens and
logits on onnxruntime's CPU EP (``reference.json``), which the GPU machine (it has no exporter of its own) compares
with.

    PYTHONPATH=. python benchmarks/gpu_check_prepare.py .gpu/graphs

Writes ``OUT/<case>/`` (an export folder each) and ``OUT/reference.json`` (kept, with the cases given redone or
added: ``--cases A,B``); the whole folder is well under 5 MB,
so it travels with the GPU machine's last transfer (see docs/runtime.md, "Execution providers").
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_check  # noqa: E402  (the harness: its driver computes the reference)

#: case -> (family, export options, config overrides); ctx_len CTX and prefill chunk CHUNK unless given
CTX, CHUNK = 128, 16
_BIG = dict(vocab_size=256)
CASES = {
    "llama-portable": ("llama", dict(target="portable"), _BIG),
    "llama-onnxruntime": ("llama", dict(target="onnxruntime"), _BIG),
    "llama-fused": ("llama", dict(target="onnxruntime-fused"), _BIG),
    "llama-portable-fp16": ("llama", dict(target="portable", dtype="float16"), _BIG),
    "mistral_sw-portable": ("mistral_sw", dict(target="portable", prefill_seq_len=8),
                            dict(_BIG, sliding_window=12)),
    "bamba-portable": ("bamba", dict(target="portable"), _BIG),
    "llama-portable-cb": ("llama", dict(target="portable", continuous_batching=True, full_batch_size=2), _BIG),
    "llama-onnxruntime-cb": ("llama", dict(target="onnxruntime", continuous_batching=True, full_batch_size=2),
                             _BIG),
}

#: graphs whose weights are made on the GPU machine (too big to carry): the graph travels without them
#: (``skeleton.json``), ``gpu_check.py`` writes seeded random ones there (``fill_weights``) before it runs it
SKELETONS = {
    "llama-160m-fp16-skeleton": ("llama", dict(target="portable", dtype="float16", ctx_len=1024,
                                               prefill_seq_len=128),
                                 dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
                                      num_key_value_heads=8, head_dim=64, intermediate_size=2816, vocab_size=32000,
                                      max_position_embeddings=2048)),
}


def make_skeleton(case: str, out: Path, tmp: Path) -> None:
    """Export ``case`` of :data:`SKELETONS`, then move its weights (float initializers of two or more axes and 1 MiB
    or more: every other tensor, constants and indices, stays in the graph) into one external file and delete it:
    the folder keeps the graph, its manifest and ``skeleton.json`` (the file's name and size)."""
    import onnx
    from onnx.external_data_helper import set_external_data
    from qeff_kv.export import export_model

    family, opts, overrides = SKELETONS[case]
    shutil.rmtree(out, ignore_errors=True)
    export_model(make_model(family, overrides, tmp), out, verify=False, **opts)
    for junk in ("tokenizer.json", "tokenizer_config.json"):
        (out / junk).unlink(missing_ok=True)
    path = next(p for p in out.glob("*.onnx"))
    model = onnx.load(str(path))
    for f in out.iterdir():
        if f.is_file() and f.suffix not in (".json", ".yaml", ".onnx"):
            f.unlink()   # the exporter's own weights file, if it wrote one
    floats = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)
    offset = 0
    for t in model.graph.initializer:
        if t.data_type in floats and len(t.dims) >= 2 and len(t.raw_data) >= 1 << 20:
            n = len(t.raw_data)
            set_external_data(t, "weights.bin", offset, n)
            t.ClearField("raw_data")
            t.data_location = onnx.TensorProto.EXTERNAL
            offset += (n + 4095) // 4096 * 4096
    tmp_path = path.with_suffix(".tmp")
    onnx.save_model(model, str(tmp_path))
    tmp_path.replace(path)
    (out / "skeleton.json").write_text(json.dumps({"weights": "weights.bin", "bytes": offset, "seed": 0}))
    print(case, f"graph {path.stat().st_size / 1e6:.2f} MB, weights {offset / 1e6:.1f} MB (made on the GPU machine)")


def make_model(family: str, overrides: dict, root: Path) -> Path:
    """The tiny seeded model of ``family`` (seed 0, ``tests/helpers/families.py``'s config with ``overrides``)."""
    import torch
    import transformers
    from families import FAMILIES

    fam = FAMILIES[family]
    cfg = getattr(transformers, fam.config_class)(**{**fam.config_kwargs(), **overrides})
    cfg.architectures = [fam.model_class]
    torch.manual_seed(0)
    model = getattr(transformers, fam.model_class)(cfg).eval()
    out = root / f"tiny-{family}-{'-'.join(f'{k}{v}' for k, v in sorted(overrides.items()))}"
    if not out.exists():
        model.save_pretrained(out, safe_serialization=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--skeleton", default=None, help=f"instead: make this skeleton ({', '.join(SKELETONS)})")
    args = ap.parse_args()
    if args.skeleton:
        with tempfile.TemporaryDirectory() as tmp:
            make_skeleton(args.skeleton, args.out / args.skeleton, Path(tmp))
        return
    from qeff_kv.export import export_model

    args.out.mkdir(parents=True, exist_ok=True)
    ref = {"prompt": gpu_check.PROMPT, "steps": gpu_check.STEPS, "cases": {}}
    if (args.out / "reference.json").is_file():   # other cases prepared before stay (--cases adds or redoes some)
        ref["cases"] = json.loads((args.out / "reference.json").read_text())["cases"]
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.cases.split(","):
            family, opts, overrides = CASES[case]
            opts = {"ctx_len": CTX, "prefill_seq_len": CHUNK, **opts}
            dest = args.out / case
            shutil.rmtree(dest, ignore_errors=True)
            export_model(make_model(family, overrides, Path(tmp)), dest, verify=True, **opts)
            for junk in ("tokenizer.json", "tokenizer_config.json"):   # none for a tiny model; keep it small
                (dest / junk).unlink(missing_ok=True)
            run = gpu_check.drive_session(dest, [gpu_check.CPU])
            ref["cases"][case] = {"family": family, **{k: v for k, v in opts.items()},
                                  "tokens": run["tokens"], "logits": gpu_check.rounded(run["logits"]),
                                  "margins": run["margins"]}
            print(case, run["tokens"], flush=True)
    tmp_json = args.out / "reference.json.tmp"
    tmp_json.write_text(json.dumps(ref))
    tmp_json.replace(args.out / "reference.json")
    size = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
    print(f"{args.out}: {size / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
