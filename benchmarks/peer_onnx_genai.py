"""onnx-genai on qeff-kv's exports AS WRITTEN (the sidecars the exporter writes, nothing hand-written).

For each target (and the fused target with ``--kv-cache-prefix VLLM``, and a rewrite of it), export a checkpoint
with qeff-kv, run onnx-genai (``Engine.from_dir``) on the folder with only ``inference_metadata.yaml``, then with
only ``genai_config.json``, and compare its greedy tokens with ``qeff-kv generate``'s for a few prompts; the same for
the fused export converted to shared-buffer past/present and the portable one converted to a static cache.

Run it with the python that has onnx-genai (0.1.0.dev6); qeff-kv runs in a subprocess with ``--qeff-python``
(default: this python) and ``PYTHONPATH`` set to this checkout::

    /tmp/peers/venv/bin/python benchmarks/peer_onnx_genai.py /tmp/peers/tiny --qeff-python /work/main/.venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["Hello world, this is", "The quick brown fox", "abc"]
TARGETS = [("portable", []), ("onnxruntime", []), ("onnxruntime-fused", []),
           ("onnxruntime-fused", ["--kv-cache-prefix", "VLLM"])]
SIDECARS = ("inference_metadata.yaml", "genai_config.json")


def qeff(python: str, *args: str) -> str:
    env = dict(os.environ)
    code = "import sys; sys.argv[0] = 'qeff-kv'; from qeff_kv_cli.main import main; sys.exit(main())"
    shim = Path(tempfile.gettempdir()) / "qeff_kv_cli_shim"
    link = shim / "qeff_kv_cli"
    if not link.exists() or link.resolve() != (ROOT / "cli").resolve():   # another checkout's shim
        shim.mkdir(exist_ok=True)
        link.unlink(missing_ok=True)
        link.symlink_to(ROOT / "cli")
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{shim}"  # cli/ imports as qeff_kv_cli
    out = subprocess.run([python, "-c", code, *args], env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"qeff-kv {' '.join(args[:2])}: {out.stderr.strip().splitlines()[-1:]}")
    return out.stdout


def reference(python: str, folder: Path, prompt: str, n: int) -> list[int]:
    out = qeff(python, "generate", str(folder), "--prompt", prompt, "--max-tokens", str(n), "--json")
    return json.loads(out)["sequences"][0]["tokens"]


def peer(folder: Path, keep: str, prompts: list[str], n: int) -> list[list[int]] | str:
    import onnx_genai

    view = folder.parent / f"{folder.name}-{keep.split('.')[0]}"
    shutil.rmtree(view, ignore_errors=True)
    shutil.copytree(folder, view)
    for name in SIDECARS:
        if name != keep:
            (view / name).unlink(missing_ok=True)
    if not (view / keep).exists():
        return f"{keep} not written"
    try:
        engine = onnx_genai.Engine.from_dir(str(view))
        return [list(engine.generate(p, max_tokens=n).token_ids) for p in prompts]
    except Exception as exc:  # onnx-genai's own refusal, reported in the table
        return " ".join(str(exc).split())[:300]


def verdict(got, ref: list, n: int) -> str:
    """A row's cell: tokens equal, the sidecar not written (and why: the manifest says), onnx-genai's own refusal of
    the folder, or DIFFERENT tokens (the only wrong answer)."""
    if got == ref:
        return f"equal ({len(PROMPTS)} prompts x {n} tokens)"
    if isinstance(got, str):
        return got if got.endswith("not written") else f"onnx-genai refused: {got}"
    return f"DIFFERENT: {got} vs {ref}"


def converted(python: str, folder: Path, ref: list, n: int, dialect: str, label: str) -> list[tuple[str, str, str]]:
    """The export converted in place (``rewrite --to DIALECT``), its sidecars as the rewrite leaves them:
    shared-past-present keeps both (new names); static-cache keeps inference_metadata.yaml (an indexed_scatter
    group) and drops genai_config.json (no TensorScatter form)."""
    conv = folder.parent / f"{folder.name}-{dialect}"
    shutil.rmtree(conv, ignore_errors=True)
    shutil.copytree(folder, conv)
    onnx_name = json.loads((conv / "manifest.json").read_text())["onnx"]
    qeff(python, "rewrite", str(conv / onnx_name), "--in-place", "--to", dialect)
    rows = []
    for keep in SIDECARS:
        got = peer(conv, keep, PROMPTS, n)
        rows.append((f"{label}, rewrite --to {dialect}", keep, verdict(got, ref, n)))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--qeff-python", default=sys.executable)
    ap.add_argument("--work", default=None, help="folder for the exports (default: a temporary one)")
    ap.add_argument("--max-tokens", type=int, default=24)
    args = ap.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="peer-onnx-genai-"))
    rows = []
    for target, extra in TARGETS:
        label = target + (" " + " ".join(extra) if extra else "")
        folder = work / label.replace(" ", "_").replace("--", "")
        qeff(args.qeff_python, "export", args.checkpoint, "-o", str(folder), "--target", target, "-q", *extra)
        ref = [reference(args.qeff_python, folder, p, args.max_tokens) for p in PROMPTS]
        for keep in SIDECARS:
            got = peer(folder, keep, PROMPTS, args.max_tokens)
            rows.append((label, keep, verdict(got, ref, args.max_tokens)))
        if target == "onnxruntime-fused" and not extra:
            rows += converted(args.qeff_python, folder, ref, args.max_tokens, "shared-past-present", label)
        if target == "portable":   # retained_to_static refuses the fused target (GroupQueryAttention)
            rows += converted(args.qeff_python, folder, ref, args.max_tokens, "static-cache", label)
    print(f"| export | sidecar onnx-genai read | greedy tokens vs qeff-kv generate |")
    print("|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 1 if any(r[2].startswith("DIFFERENT") for r in rows) else 0   # a refusal is reported, not wrong


if __name__ == "__main__":
    sys.exit(main())
