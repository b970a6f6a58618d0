"""Side-by-side decode benchmark: qeff-kv's runtime against transformers, a plain onnxruntime loop and
onnxruntime-genai, interleaved (A B C A B C ...), medians with min-max.

    python benchmarks/bench_decode.py                 # full run (S and M), writes JSON + PNG
    python benchmarks/bench_decode.py --quick         # S only, fewer rounds (a smoke run)

Models are built from configs with a fixed seed (random weights, fp32) and saved as safetensors; every
runtime reads the same weights. Each engine runs in its own worker process (so peak RSS is its own) with
the same number of threads (``--threads``, default 2): torch ``set_num_threads``, onnxruntime
``intra_op_num_threads``, onnxruntime-genai ``session_options.intra_op_num_threads`` in genai_config.json.
Greedy tokens of every engine are compared; a mismatch is reported in the results.
See docs/performance.md for the latest figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bandwidth import bytes_per_token, graph_bytes, measure_bandwidth  # noqa: E402
from workerproc import WorkerProcess, peak_rss  # noqa: E402

HERE = Path(__file__).resolve().parent
MODELS = {
    "S": dict(num_hidden_layers=4, hidden_size=256, intermediate_size=688, num_attention_heads=8,
              num_key_value_heads=4, vocab_size=32000),
    "M": dict(num_hidden_layers=12, hidden_size=768, intermediate_size=2048, num_attention_heads=12,
              num_key_value_heads=4, vocab_size=32000),
}
SEED = 0


# =============================================================================================== models
def build_model(name: str, root: Path) -> Path:
    """Random-weight Llama of size ``name`` (seeded), with a generated word-level tokenizer."""
    out = root / f"llama-{name}"
    if (out / "model.safetensors").is_file():
        return out
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    cfg = transformers.LlamaConfig(max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
                                   tie_word_embeddings=False, **MODELS[name])
    cfg.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(SEED)
    transformers.LlamaForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
    vocab = {f"w{i}": i for i in range(cfg.vocab_size)}
    vocab["<unk>"] = 0
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "w1", "eos_token": "w2",
         "unk_token": "<unk>", "model_max_length": 4096}))
    return out


def prompt_ids(n: int, vocab: int) -> list[int]:
    import random

    rng = random.Random(1234 + n)
    return [rng.randrange(3, vocab) for _ in range(n)]


# =============================================================================================== engines
class Engine:
    """One runtime in a worker process: ``run(prompt, new, capacity)`` -> (tokens, t_first, step times)."""

    def __init__(self, model_dir: Path, work: Path, threads: int):
        self.model_dir, self.work, self.threads = model_dir, work, threads


class QeffEngine(Engine):
    """qeff-kv's runtime on the onnxruntime-target export (attention follows the valid length)."""

    target = "onnxruntime"

    def __init__(self, *a):
        super().__init__(*a)
        self.export_dir = self.work / f"qeff-{self.target}"  # exported by the parent (no torch in this worker)
        self.sessions = {}

    def session(self, capacity: int):
        from qeff_kv.runtime import Session

        if capacity not in self.sessions:
            self.sessions.clear()
            self.sessions[capacity] = Session(self.export_dir, ctx_len=capacity, threads=self.threads)
        return self.sessions[capacity]

    def run(self, prompt, new, capacity):
        import numpy as np

        sess = self.session(capacity)
        for s in list(sess.sequences):
            sess.remove_sequence(s)
        seq = sess.add_sequence()
        t0 = time.perf_counter()
        logits = sess.prefill(seq, prompt)
        tok = int(np.argmax(logits))
        t_first = time.perf_counter() - t0
        toks, steps = [tok], []
        ptrs = sess.kv_data_pointers()
        for _ in range(new - 1):
            t = time.perf_counter()
            logits = sess.decode({seq: tok})[seq]
            tok = int(np.argmax(logits))
            steps.append(time.perf_counter() - t)
            toks.append(tok)
        extra = {"kv_buffers_unchanged": sess.kv_data_pointers() == ptrs,
                 "inplace": bool(getattr(sess, "inplace", False))}
        return toks, t_first, steps, extra


class QeffFusedEngine(QeffEngine):
    """qeff-kv's runtime on the onnxruntime-fused export (GroupQueryAttention appends in place)."""

    target = "onnxruntime-fused"


class PlainOrtEngine(Engine):
    """The peer's reference-runner style: feed each _RetainedState output back through numpy every step."""

    def __init__(self, *a):
        super().__init__(*a)
        import onnxruntime as ort

        folder = self.work / "qeff-portable"  # exported by the parent (no torch in this worker)
        m = json.loads((folder / "manifest.json").read_text())
        so = ort.SessionOptions()
        so.intra_op_num_threads = self.threads
        self.sess = ort.InferenceSession(str(folder / m["onnx"]), so, providers=["CPUExecutionProvider"])
        self.pairs = [(p["input"], p["retained"]) for p in m["buffers"]]
        self.out_names = [o.name for o in self.sess.get_outputs()]
        self.kv_shape = (1, m["n_kv_heads"], None, m["head_dim"])

    def run(self, prompt, new, capacity):
        import numpy as np

        shape = (1, self.kv_shape[1], capacity, self.kv_shape[3])
        kv = {i: np.zeros(shape, np.float32) for i, _ in self.pairs}
        chunk = 128

        def step(ids, pos):
            out = dict(zip(self.out_names, self.sess.run(None, {"input_ids": ids, "position_ids": pos, **kv})))
            for i, o in self.pairs:
                kv[i] = out[o]
            return out["logits"]

        t0 = time.perf_counter()
        p = 0
        while p < len(prompt):
            part = prompt[p:p + chunk]
            n = len(part)
            ids = np.array([part + [0] * (chunk - n)], np.int64)
            pos = np.array([list(range(p, p + n)) + [-1] * (chunk - n)], np.int64)
            logits = step(ids, pos)
            p += n
        tok = int(logits[0, -1].argmax())
        t_first = time.perf_counter() - t0
        toks, steps = [tok], []
        for _ in range(new - 1):
            t = time.perf_counter()
            logits = step(np.array([[tok]], np.int64), np.array([[p]], np.int64))
            tok = int(logits[0, -1].argmax())
            steps.append(time.perf_counter() - t)
            toks.append(tok)
            p += 1
        return toks, t_first, steps, {}


class HFEngine(Engine):
    """transformers ``generate`` (greedy), timestamps from a logits processor called once per step."""

    cache_implementation = None

    def __init__(self, *a):
        super().__init__(*a)
        import torch
        import transformers

        torch.set_num_threads(self.threads)
        self.torch = torch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            self.model_dir, dtype=torch.float32, attn_implementation="eager").eval()

    def run(self, prompt, new, capacity):
        torch = self.torch
        stamps = []

        class Stamp:
            def __call__(self, input_ids, scores):
                stamps.append(time.perf_counter())
                return scores

        ids = torch.tensor([prompt])
        kwargs = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0,
                      logits_processor=[Stamp()], attention_mask=torch.ones_like(ids))
        if self.cache_implementation:
            kwargs["cache_implementation"] = self.cache_implementation
        t0 = time.perf_counter()
        with torch.no_grad():
            out = self.model.generate(ids, **kwargs)
        toks = out[0, len(prompt):].tolist()
        steps = [b - a for a, b in zip(stamps, stamps[1:])]
        return toks, stamps[0] - t0, steps, {}


class HFStaticEngine(HFEngine):
    cache_implementation = "static"


class GenaiEngine(Engine):
    """onnxruntime-genai, its model built by its own builder from the same saved weights."""

    def __init__(self, *a):
        super().__init__(*a)
        import onnxruntime_genai as og

        out = self.work / "genai"
        if not (out / "genai_config.json").is_file():
            subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(self.model_dir),
                            "-o", str(out), "-p", "fp32", "-e", "cpu", "-c", str(self.work / "genai-cache")],
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        cfg_path = out / "genai_config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["model"]["decoder"].setdefault("session_options", {})["intra_op_num_threads"] = self.threads
        cfg_path.write_text(json.dumps(cfg, indent=2))
        self.og = og
        self.model = og.Model(str(out))

    def run(self, prompt, new, capacity):
        og = self.og
        params = og.GeneratorParams(self.model)
        # min_length keeps a random-weight model from stopping at its eos id, as eos_token_id=None does for HF.
        params.set_search_options(max_length=len(prompt) + new, min_length=len(prompt) + new, do_sample=False,
                                  batch_size=1)
        t0 = time.perf_counter()
        gen = og.Generator(self.model, params)
        gen.append_tokens(prompt)
        stamps, toks = [], []
        while len(toks) < new and not gen.is_done():
            gen.generate_next_token()
            toks.append(int(gen.get_next_tokens()[0]))
            stamps.append(time.perf_counter())
        steps = [b - a for a, b in zip(stamps, stamps[1:])]
        return toks, stamps[0] - t0, steps, {}


ENGINES = {"qeff": QeffEngine, "qeff_fused": QeffFusedEngine, "hf_eager": HFEngine, "hf_static": HFStaticEngine, "ort_plain": PlainOrtEngine,
           "genai": GenaiEngine}


def worker(engine: str, model_dir: str, work: str, threads: int) -> None:
    """Serve run requests (JSON lines on stdin) for one engine; answers JSON lines on stdout."""
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    eng = ENGINES[engine](Path(model_dir), Path(work), threads)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("cmd") == "quit":
            break
        toks, t_first, steps, extra = eng.run(req["prompt"], req["new"], req["capacity"])
        print(json.dumps({"tokens": toks, "t_first": t_first, "steps": steps, "extra": extra,
                          "rss_peak": peak_rss()}), flush=True)


class Worker(WorkerProcess):
    def __init__(self, engine, model_dir, work, threads):
        super().__init__(engine, [__file__, "--worker", engine, "--model-dir", str(model_dir), "--work", str(work),
                                  "--threads", str(threads)], threads)

    def run(self, prompt, new, capacity):
        return self.request({"prompt": prompt, "new": new, "capacity": capacity})


# =============================================================================================== driver
def summarize(runs: list[dict]) -> dict:
    steps = [s for r in runs for s in r["steps"]]
    per_run_tps = [len(r["steps"]) / sum(r["steps"]) for r in runs if r["steps"]]
    firsts = [r["t_first"] for r in runs]
    return {
        "decode_tok_s": statistics.median(per_run_tps) if per_run_tps else None,
        "decode_tok_s_min": min(per_run_tps) if per_run_tps else None,
        "decode_tok_s_max": max(per_run_tps) if per_run_tps else None,
        "step_ms_median": statistics.median(steps) * 1e3 if steps else None,
        "first_token_ms": statistics.median(firsts) * 1e3,
        "first_token_ms_min": min(firsts) * 1e3,
        "first_token_ms_max": max(firsts) * 1e3,
        "rss_peak_mb": max(r["rss_peak"] for r in runs) / 2**20,
        "tokens": runs[-1]["tokens"],
        "extra": runs[-1].get("extra", {}),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=HERE / "work", help="models and exports (reused across runs)")
    ap.add_argument("--out", type=Path, default=HERE / "results", help="where decode.json and decode.png go")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="S only, 3 rounds")
    ap.add_argument("--models", default="S,M")
    ap.add_argument("--bw-mib", type=int, default=1024, help="buffer of the bandwidth measurement (MiB)")
    ap.add_argument("--bw-repeats", type=int, default=7, help="timed passes per bandwidth variant")
    ap.add_argument("--engines", default="qeff_fused,qeff,genai,hf_eager,hf_static,ort_plain",
                    help="qeff_fused: our runtime on the onnxruntime-fused export (the headline figures); qeff: on the "
                         "standard-op onnxruntime export")
    ap.add_argument("--worker")
    ap.add_argument("--model-dir")
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker, args.model_dir, str(args.work), args.threads)
        return 0
    if args.quick:
        args.models, args.rounds = "S", 3
    engines = [e for e in args.engines.split(",") if e]
    if "genai" in engines:
        try:
            import onnxruntime_genai  # noqa: F401
        except ImportError:
            print("onnxruntime-genai is not installed: skipping it (pip install 'qeff-kv[bench]')", file=sys.stderr)
            engines.remove("genai")
    args.work.mkdir(parents=True, exist_ok=True)
    results: dict = {"threads": args.threads, "rounds": args.rounds, "engines": engines, "cases": {},
                     "capacity": {}, "roofline": {}, "machine": {"cpus": os.cpu_count()}}
    cases = {"S": [(128, 128, 256), (1536, 64, 2048)], "M": [(128, 128, 256)]}
    results["roofline"]["bandwidth_before"] = measure_bandwidth(args.threads, args.bw_mib << 20, args.bw_repeats)
    for model in args.models.split(","):
        model_dir = build_model(model, args.work)
        work = args.work / f"{model}-exports"
        work.mkdir(exist_ok=True)
        from qeff_kv.export import export_model

        for target in ("onnxruntime-fused", "onnxruntime", "portable"):
            export_model(model_dir, work / f"qeff-{target}", ctx_len=4096, prefill_seq_len=128, target=target)
        print(f"[{model}] starting workers: {', '.join(engines)}", file=sys.stderr, flush=True)
        workers = {e: Worker(e, model_dir, work, args.threads) for e in engines}
        vocab = MODELS[model]["vocab_size"]
        try:
            for plen, new, cap in cases[model]:
                key = f"{model} {plen}->{new}"
                prompt = prompt_ids(plen, vocab)
                runs: dict[str, list] = {e: [] for e in engines}
                for w in workers.values():  # warm-up, not counted
                    w.run(prompt, min(new, 8), cap)
                for r in range(args.rounds):
                    for e, w in workers.items():
                        runs[e].append(w.run(prompt, new, cap))
                    print(f"  {key} round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
                case = {e: summarize(v) for e, v in runs.items()}
                ref = case[engines[0]]["tokens"]
                for e in engines:
                    case[e]["tokens_match_first_engine"] = case[e]["tokens"] == ref
                results["cases"][key] = case
                _print_case(key, case)
            if model == "S" and ("qeff" in workers or "qeff_fused" in workers):
                sweep = {}
                prompt = prompt_ids(128, vocab)
                cap_engines = [e for e in ("qeff_fused", "qeff", "ort_plain") if e in workers]
                for cap in (256, 1024, 4096):
                    runs = {e: [] for e in cap_engines}
                    for e in cap_engines:
                        workers[e].run(prompt, 4, cap)
                    for _ in range(args.rounds):
                        for e in cap_engines:
                            runs[e].append(workers[e].run(prompt, 32, cap))
                    sweep[cap] = {e: summarize(v) for e, v in runs.items()}
                    print(f"  capacity {cap}: " + ", ".join(
                        f"{e} {sweep[cap][e]['step_ms_median']:.3f} ms/step" for e in cap_engines), file=sys.stderr)
                results["capacity"] = {str(k): v for k, v in sweep.items()}
        finally:
            for w in workers.values():
                w.close()
        results["roofline"].setdefault("graphs", {})[model] = {
            t: graph_bytes(work / f"qeff-{t}") for t in ("onnxruntime-fused", "onnxruntime")}
    _roofline(results, args.threads, args.bw_mib, args.bw_repeats)
    _targets(results)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode.json").write_text(json.dumps(results, indent=2) + "\n")
    _plot(results, args.out / "decode.png")
    print(json.dumps(results["targets"], indent=2))
    return 0


def _roofline(results: dict, threads: int, mib: int, repeats: int) -> None:
    """Bandwidth limit of each case: measured streaming bandwidth / bytes one decode step reads.

    Bytes per token come from the fused export's initializers (benchmarks/bandwidth.py) plus the KV cache at the
    mean valid length of the case's decode steps (prompt + new / 2). Every engine is reported against it."""
    # The machine is shared and its bandwidth moves: measured before the engines ran and again now, the faster
    # of the two is the limit (both are recorded).
    roof = results["roofline"]
    runs = [roof.pop("bandwidth_before"), measure_bandwidth(threads, mib << 20, repeats)]
    roof["bandwidth_runs"] = runs
    bw = max(runs, key=lambda r: r["limit_gb_s"])
    roof["bandwidth"] = bw
    print("\nbandwidth before the engines %.1f GB/s, after %.1f GB/s" % (runs[0]["limit_gb_s"], runs[1]["limit_gb_s"]),
          file=sys.stderr)
    print("\nbandwidth (streaming read, %d MiB, %d threads): %s -> limit %.1f GB/s (%s)" % (
        mib, threads, ", ".join(f"{k} {v['gb_s']:.1f}" for k, v in bw["variants"].items()), bw["limit_gb_s"],
        bw["limit_variant"]), file=sys.stderr)
    roof["cases"] = {}
    for key, case in results["cases"].items():
        model, lens = key.split(" ", 1)
        plen, new = (int(x) for x in lens.split("->"))
        valid = plen + new / 2
        nbytes = bytes_per_token(roof["graphs"][model]["onnxruntime-fused"], valid)
        limit = bw["limit_gb_s"] * 1e9 / nbytes
        frac = {e: s["decode_tok_s"] / limit for e, s in case.items() if s.get("decode_tok_s")}
        roof["cases"][key] = {"mean_valid_len": valid, "bytes_per_token": nbytes, "limit_tok_s": limit,
                              "fraction": frac}
        print(f"  {key}: {nbytes / 1e6:.1f} MB/token -> limit {limit:.1f} tok/s; " + ", ".join(
            f"{e} {f:.2f}" for e, f in frac.items()), file=sys.stderr)


def _print_case(key, case):
    print(f"\n{key}", file=sys.stderr)
    for e, s in case.items():
        print(f"  {e:10s} decode {s['decode_tok_s']:8.1f} tok/s [{s['decode_tok_s_min']:.1f}-{s['decode_tok_s_max']:.1f}]"
              f"  step {s['step_ms_median']:.3f} ms  first {s['first_token_ms']:.1f} ms  rss {s['rss_peak_mb']:.0f} MB"
              f"  tokens-match {s['tokens_match_first_engine']}", file=sys.stderr, flush=True)


def _targets(results: dict) -> None:
    """Ratios of the issue's targets, for our headline engine (qeff_fused, else qeff) and for qeff beside it."""
    t = {}
    ours = [e for e in ("qeff_fused", "qeff") if e in results["engines"]]
    for key, case in results["cases"].items():
        for mine in ours:
            q = case[mine]
            for e, s in case.items():
                if e not in ours and s["decode_tok_s"]:
                    t[f"{key}: decode {mine} / {e}"] = q["decode_tok_s"] / s["decode_tok_s"]
                    t[f"{key}: step time {e} / {mine}"] = s["step_ms_median"] / q["step_ms_median"]
            if key.startswith("S 1536") and "hf_eager" in case:
                t[f"{key}: first-token {mine} / hf_eager (<= 1)"] = q["first_token_ms"] / case["hf_eager"]["first_token_ms"]
    for key, roof in results["roofline"].get("cases", {}).items():
        for mine in ours:
            if mine in roof["fraction"]:
                t[f"{key}: {mine} decode / bandwidth limit (<= 1 unless the weights fit in cache)"] = \
                    roof["fraction"][mine]
    cap = results.get("capacity", {})
    for mine in ours:
        if cap and mine in cap.get("256", {}):
            q256, q4096 = cap["256"][mine]["step_ms_median"], cap["4096"][mine]["step_ms_median"]
            t[f"S {mine} step time capacity 4096 / 256 at valid length 128 (<= 1.3)"] = q4096 / q256
            if "ort_plain" in cap["4096"]:
                t[f"S capacity 4096: {mine} speed / plain numpy loop (>= 3)"] = \
                    cap["4096"]["ort_plain"]["step_ms_median"] / q4096
            t[f"S {mine}: KV buffers unchanged across decode steps"] = all(
                cap[c][mine]["extra"].get("kv_buffers_unchanged") for c in cap)
    results["targets"] = t


def _plot(results: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    cases = list(results["cases"])
    engines = results["engines"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    ax = axes[0]
    width = 0.8 / max(len(engines), 1)
    for j, e in enumerate(engines):
        vals = [results["cases"][c].get(e, {}).get("decode_tok_s") or 0 for c in cases]
        ax.bar([i + j * width for i in range(len(cases))], vals, width, label=e)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))], cases)
    ax.set_ylabel("decode tokens/s (median)")
    ax.set_title(f"decode throughput, fp32, batch 1, {results['threads']} threads")
    ax.legend(fontsize=8)
    ax = axes[1]
    cap = results.get("capacity", {})
    if cap:
        caps = sorted(int(c) for c in cap)
        for e in cap[str(caps[0])]:
            ax.plot(caps, [cap[str(c)][e]["step_ms_median"] for c in caps], marker="o", label=e)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("KV capacity (valid length 128)")
        ax.set_ylabel("ms per decode step (median)")
        ax.set_title("model S: step time vs capacity")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
