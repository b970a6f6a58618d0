"""LoRA adapters mixed per row on the CUDA execution provider (issue 50 on a GPU machine): the tokens against the
CPU's, and the decode step of mixed adapter rows against base rows on a GPU.

    PYTHONPATH=. python benchmarks/gpu_lora_check.py prepare .gpu/lora            # here: exports, adapters, reference
    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/gpu_lora_check.py run .gpu/lora --out R.json   # the GPU machine

``prepare`` (needs torch, transformers, PEFT) writes ``tiny/`` (a seeded Llama, vocab 256, exported with three PEFT
adapters of non-zero B, continuous batching of 4), ``adapters/`` (the PEFT folders), ``reference.json`` (our
runtime's greedy tokens on the CPU EP for a 4-row batch: the base and each adapter), and two skeletons of a
Llama of hidden 1024 and 8 layers, float16, onnxruntime target, continuous batching of 8 (``med-lora`` exported
with ``--max-lora-rank 16``, ``med-base`` without): graphs without their weights, which ``run`` writes there
(``benchmarks/gpu_check.py``'s ``fill_weights``). ``run`` (numpy and onnxruntime only): the tiny batch on the CPU
and on CUDA against the reference; on the skeleton, four synthetic rank-16 adapters (PEFT folders written there),
the tokens of 8 mixed rows on CUDA against the CPU for a few steps, and the median decode step of 8 rows on 4
adapters, 8 base rows, and 8 rows of the graph without adapter inputs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

PROMPT = [(37 * i + 11) % 250 + 3 for i in range(20)]
STEPS = 12
ADAPTERS = {"a1": dict(r=4, alpha=8, targets=["q_proj", "v_proj", "down_proj"], seed=1),
            "a2": dict(r=8, alpha=16, targets=["q_proj", "k_proj", "o_proj", "up_proj"], seed=2, rslora=True),
            "a3": dict(r=2, alpha=4, targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                              "down_proj"], seed=3)}
ROWS = [None, "a1", "a2", "a3"]
MEDIUM = dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8, head_dim=64,
              intermediate_size=2816, vocab_size=32000, max_position_embeddings=2048)
MED_OPTS = dict(target="onnxruntime", dtype="float16", ctx_len=512, prefill_seq_len=32, continuous_batching=True,
                full_batch_size=8)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def greedy_rows(sess, rows, prompts, steps: int) -> list[list[int]]:
    """Each row's greedy tokens: every row prefilled with its prompt, then ``steps`` decode steps of all rows."""
    seqs = [sess.add_sequence(adapter=a) for a in rows]
    toks = [[int(np.argmax(sess.prefill(q, p)))] for q, p in zip(seqs, prompts)]
    for _ in range(steps - 1):
        out = sess.decode({q: t[-1] for q, t in zip(seqs, toks)})
        for q, t in zip(seqs, toks):
            t.append(int(np.argmax(out[q])))
    for q in seqs:
        sess.remove_sequence(q)
    return toks


# ============================================================================================ prepare (CPU machine)
def prepare(out: Path) -> None:
    from hf_models import make_model_dir
    from lora_adapters import make_adapter

    import gpu_check_prepare as prep
    from qeff_kv.export import export_model
    from qeff_kv.runtime import Session

    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        base = make_model_dir("llama", Path(tmp), vocab_size=256)
        folders = {n: make_adapter(base, out / "adapters" / n, **kw) for n, kw in ADAPTERS.items()}
        shutil.rmtree(out / "tiny", ignore_errors=True)
        export_model(base, out / "tiny", lora=[f"{n}={p}" for n, p in folders.items()], ctx_len=64,
                     prefill_seq_len=16, continuous_batching=True, full_batch_size=4)
        for case, lora in (("med-lora", 16), ("med-base", None)):
            prep.SKELETONS[case] = ("llama", dict(MED_OPTS, **({"max_lora_rank": lora} if lora else {})), MEDIUM)
            prep.make_skeleton(case, out / case, Path(tmp))
    sess = Session(out / "tiny")
    for n in ADAPTERS:
        sess.lora.load(n, out / "adapters" / n)
    tokens = greedy_rows(sess, ROWS, [PROMPT] * len(ROWS), STEPS)
    (out / "reference.json").write_text(json.dumps({"rows": ROWS, "prompt": PROMPT, "tokens": tokens}))
    print("reference", tokens)


# ============================================================================================ run (GPU machine)
def synthetic_adapter(folder: Path, layers: int, hidden: int, inter: int, kv: int, rank: int, seed: int) -> Path:
    """A PEFT folder (config + safetensors) of a rank-``rank`` adapter on every projection, seeded normal weights."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    shapes = {"q_proj": (hidden, hidden), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (hidden, hidden),
              "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    tensors = {}
    for i in range(layers):
        for m, (fan_in, fan_out) in shapes.items():
            where = "self_attn" if m in PROJECTIONS[:4] else "mlp"
            key = f"base_model.model.model.layers.{i}.{where}.{m}"
            tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((rank, fan_in)) * 0.02).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = (rng.standard_normal((fan_out, rank)) * 0.02).astype(np.float32)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(PROJECTIONS),
         "bias": "none", "use_dora": False, "use_rslora": False}))
    return folder


def forced(sessions: dict, rows, tokens: list[list[int]]) -> list[dict]:
    """Both sessions fed the same tokens (the CPU's greedy ones): per step, the largest logit difference and the CPU's
    top-1/top-2 margin of each row where their argmax differ (a flip at a margin below the difference is arithmetic)."""
    logits = {}
    for device, sess in sessions.items():
        seqs = [sess.add_sequence(adapter=a) for a in rows]
        steps = [[sess.prefill(q, PROMPT[:16]) for q in seqs]]
        for k in range(len(tokens[0]) - 1):
            out = sess.decode({q: t[k] for q, t in zip(seqs, tokens)})
            steps.append([out[q] for q in seqs])
        for q in seqs:
            sess.remove_sequence(q)
        logits[device] = np.asarray(steps, np.float64)
    cpu, other = logits.values()
    report = []
    for k in range(cpu.shape[0]):
        flips = [{"row": r, "cpu_margin": round(float(np.diff(np.sort(cpu[k, r])[-2:])[0]), 5)}
                 for r in range(cpu.shape[1]) if int(np.argmax(cpu[k, r])) != int(np.argmax(other[k, r]))]
        report.append({"step": k, "max_abs_diff": round(float(np.max(np.abs(cpu[k] - other[k]))), 5), "flips": flips})
    return report


def step_ms(sess, rows, steps: int = 20, warm: int = 5) -> float:
    """Median milliseconds of a decode step of ``rows`` (adapter names or None), each prefilled with 16 tokens."""
    seqs = [sess.add_sequence(adapter=a) for a in rows]
    toks = {q: int(np.argmax(sess.prefill(q, PROMPT[:16]))) for q in seqs}
    times = []
    for k in range(warm + steps):
        t0 = time.perf_counter()
        out = sess.decode(toks)
        times.append((time.perf_counter() - t0) * 1e3)
        toks = {q: int(np.argmax(v)) for q, v in out.items()}
    for q in seqs:
        sess.remove_sequence(q)
    return round(statistics.median(times[warm:]), 3)


def run(folder: Path, out: Path, ep: str = "cuda") -> None:
    import onnxruntime as ort

    import gpu_check
    from qeff_kv.runtime import Session

    if hasattr(ort, "preload_dlls"):
        ort.preload_dlls()
    result: dict = {"providers": ort.get_available_providers(), "onnxruntime": ort.__version__}
    ref = json.loads((folder / "reference.json").read_text())
    for device in ("cpu", ep):
        sess = Session(folder / "tiny", device=device)
        for n in ADAPTERS:
            sess.lora.load(n, folder / "adapters" / n)
        got = greedy_rows(sess, ref["rows"], [ref["prompt"]] * len(ref["rows"]), STEPS)
        result[f"tiny_{device}"] = {"equal": got == ref["tokens"], "tokens": got}
        print(device, "tiny equal to the CPU machine's reference:", got == ref["tokens"], flush=True)
    for case in ("med-lora", "med-base"):
        result[f"{case}_weights"] = gpu_check.fill_weights(folder / case)
    with tempfile.TemporaryDirectory() as tmp:
        kv = MEDIUM["num_key_value_heads"] * MEDIUM["head_dim"]
        names = [f"s{k}" for k in range(4)]
        paths = {n: synthetic_adapter(Path(tmp) / n, MEDIUM["num_hidden_layers"], MEDIUM["hidden_size"],
                                      MEDIUM["intermediate_size"], kv, 16, seed=k) for k, n in enumerate(names)}
        mixed = [n for n in names for _ in range(2)]
        sessions = {}
        for device in ("cpu", ep):
            sess = sessions[device] = Session(folder / "med-lora", device=device)
            for n, p in paths.items():
                sess.lora.load(n, p)
            toks = greedy_rows(sess, mixed, [PROMPT[:16]] * 8, 4)
            result[f"med_mixed_tokens_{device}"] = toks
        result["med_mixed_ep_equals_cpu"] = result[f"med_mixed_tokens_{ep}"] == result["med_mixed_tokens_cpu"]
        result["med_teacher_forced"] = forced(sessions, mixed, result["med_mixed_tokens_cpu"])
        cuda = sessions[ep]
        plain = Session(folder / "med-base", device=ep)
        steps = result[f"step_ms_{ep}"] = {"8 rows on 4 adapters": [], "8 base rows": [],
                                           "8 rows, graph without adapters": []}
        for _ in range(3):   # interleaved rounds: the medians of each, so that drift hits all three alike
            steps["8 rows on 4 adapters"].append(step_ms(cuda, mixed, steps=40))
            steps["8 base rows"].append(step_ms(cuda, [None] * 8, steps=40))
            steps["8 rows, graph without adapters"].append(step_ms(plain, [None] * 8, steps=40))
    print(json.dumps({k: v for k, v in result.items() if "tokens" not in k}, indent=1), flush=True)
    out.write_text(json.dumps(result, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("verb", choices=("prepare", "run"))
    ap.add_argument("folder", type=Path)
    ap.add_argument("--out", type=Path, default=Path("gpu_lora.json"))
    ap.add_argument("--device", default="cuda", help="run: the device compared with the CPU (cpu: a dry run here)")
    args = ap.parse_args()
    prepare(args.folder) if args.verb == "prepare" else run(args.folder, args.out, args.device)


if __name__ == "__main__":
    main()
