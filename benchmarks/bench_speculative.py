"""Speculative decoding by prompt lookup against plain decoding, on a quoting workload and on free text.

    python benchmarks/bench_speculative.py --plain PLAIN_DIR --spec SPEC_DIR [--k 4 8] [--rounds 3]

``PLAIN_DIR``: an ordinary export; ``SPEC_DIR``: the same model exported with ``--speculative-tokens K`` (K at
least the largest ``--k``). For SmolLM2-135M from the GGUF (README "A real checkpoint"):

    qeff-kv export "$GGUF" -o plain --target onnxruntime-fused --ctx-len 1024
    qeff-kv export "$GGUF" -o spec8 --target onnxruntime-fused --ctx-len 1024 --speculative-tokens 8

Workloads (chat template of the export folder, up to ``--new-tokens`` tokens, the model's own eos stops both):
``quote`` asks the chat model to repeat the public-domain passage of ``fixtures/text/gettysburg.txt``; ``edit``
asks it to repeat it with one word changed; ``free`` asks for a story (nothing to look up). Plain decoding runs
on the ordinary export, speculative decoding on the speculative one, interleaved round by round, same threads;
decode tokens/s is tokens after the first over the decode wall time (drafting included); medians over rounds.
The tokens of both must be identical (reported). Writes ``benchmarks/results/speculative.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

from qeff_kv.runtime import Session  # noqa: E402
from qeff_kv.runtime.text.chat import chat_prompt_ids, load_chat_template  # noqa: E402
from qeff_kv.runtime.text.tokenizer import load_tokenizer  # noqa: E402
from qeff_kv.runtime.decoding.speculative import PromptLookup, SpeculativeDecoder  # noqa: E402


def workloads() -> dict[str, str]:
    text = (REPO / "fixtures" / "text" / "gettysburg.txt").read_text().strip()
    return {
        "quote": f"Repeat the following passage exactly, word for word:\n\n{text}",
        "edit": f"Repeat the following passage word for word, but write 'country' instead of 'nation':\n\n{text}",
        "free": "Write a long story about a lighthouse keeper who finds a message in a bottle.",
    }


def plain_run(session: Session, prompt: list[int], new: int) -> tuple[list[int], float]:
    before = session.timings.decode_s, session.timings.decode_tokens
    gen = session.generate([prompt], max_tokens=new)[0]
    session.remove_sequence(gen.sequence)
    secs = session.timings.decode_s - before[0]
    return gen.tokens, (session.timings.decode_tokens - before[1]) / secs


def spec_run(session: Session, prompt: list[int], new: int, k: int) -> tuple[list[int], float, dict]:
    dec = SpeculativeDecoder(session, PromptLookup(), k=k)
    gen = dec.generate(prompt, max_tokens=new)
    session.remove_sequence(gen.sequence)
    stats = dec.stats.to_json()
    return gen.tokens, stats["decode_tokens_per_s"], stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plain", required=True, type=Path)
    ap.add_argument("--spec", required=True, type=Path)
    ap.add_argument("--k", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", nargs="*", default=None, help="workloads to run (default: all)")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "speculative.json")
    args = ap.parse_args()

    tok = load_tokenizer(args.plain, required=True)
    template = load_chat_template(args.plain)
    plain = Session(args.plain, threads=args.threads)
    spec = Session(args.spec, threads=args.threads)
    results = {"new_tokens": args.new_tokens, "rounds": args.rounds, "threads": args.threads,
               "plain": str(args.plain), "spec": str(args.spec), "workloads": {}}
    for name, text in workloads().items():
        if args.only and name not in args.only:
            continue
        prompt = chat_prompt_ids(tok, template, text, None)
        rates = {"plain": []} | {f"k{k}": [] for k in args.k}
        stats, identical, ref = {}, True, None
        for _ in range(args.rounds):
            toks, rate = plain_run(plain, prompt, args.new_tokens)
            ref = toks if ref is None else ref
            identical &= toks == ref
            rates["plain"].append(rate)
            for k in args.k:
                toks, rate, st = spec_run(spec, prompt, args.new_tokens, k)
                identical &= toks == ref
                rates[f"k{k}"].append(rate)
                stats[f"k{k}"] = st
        med = {key: statistics.median(v) for key, v in rates.items()}
        row = {"prompt_tokens": len(prompt), "new_tokens": len(ref), "identical": identical,
               "decode_tokens_per_s": {k: round(v, 2) for k, v in med.items()},
               "speedup": {k: round(v / med["plain"], 3) for k, v in med.items() if k != "plain"},
               "speculative": stats, "text_head": tok.decode(ref)[:120]}
        results["workloads"][name] = row
        print(f"{name:6s} prompt {len(prompt):4d} new {len(ref):4d} identical {identical} plain "
              f"{med['plain']:.1f} tok/s | " + " | ".join(
                  f"{k}: {med[k]:.1f} tok/s x{row['speedup'][k]:.2f} accept {stats[k]['acceptance_rate']:.2f}"
                  for k in rates if k != "plain"), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
