"""Prepare the graphs of ``benchmarks/gpu_check.py`` on the CPU (issue 40's GPU half): tiny seeded random-weight
decoders (the family matrix's configs, ``tests/families.py``, at a larger vocabulary and context so that 24 greedy
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
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


def make_model(family: str, overrides: dict, root: Path) -> Path:
    """The tiny seeded model of ``family`` (seed 0, ``tests/families.py``'s config with ``overrides``)."""
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
    args = ap.parse_args()
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
