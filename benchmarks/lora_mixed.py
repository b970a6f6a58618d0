"""LoRA adapters mixed per row (issue 50, docs/lora.md): what mixing costs a decode step, what adapters cost in memory
against one base per adapter, and a load/unload while sequences keep decoding.

    python benchmarks/lora_mixed.py [--hidden 1024] [--layers 4] [--rank 16] [--rows 8] [--adapters 4]
        [--memory-adapters 10] [--context 64] [--steps 10] [--rounds 3] [--threads 2] [--work DIR]
        [--out benchmarks/results/lora_mixed.json]

The model is a seeded random-weight Llama of a realistic width (hidden 1024, 16 heads of 64, 4 KV heads,
intermediate 2816, vocabulary 16384, 4 layers by default; ``torch.manual_seed(0)``, saved as safetensors shards of
at most 100 MB). Its adapters are PEFT folders written with numpy (rank ``--rank`` on q, k, v, o, gate, up and down
projections of every layer, ``lora_alpha`` = 2 r, seeded normal A and B: every B non-zero). Exports (``--no-verify``:
the benchmark checks tokens itself), ctx_len 256, prefill 64:

* ``lora``: the base with ``--max-lora-rank R --continuous-batching --full-batch-size ROWS`` (the default targets);
* ``plain``: the same base without adapters, ``--continuous-batching --full-batch-size ROWS``;
* ``merged-i``: one per decode adapter, its delta merged into the base weights numerically (``W + (alpha / r) B A``
  in the safetensors, what PEFT's ``merge_and_unload`` computes), ``--continuous-batching --full-batch-size``
  ROWS / ADAPTERS: what serving these adapters without mixing takes.

(a) **Decode step**, ``ROWS`` rows prefilled with ``--context`` seeded tokens each: on the ``lora`` graph with the rows
on ``ADAPTERS`` different adapters (``ROWS / ADAPTERS`` rows each) against ``ROWS`` base rows; the ``plain`` graph's
``ROWS`` base rows; the merged exports, each decoding its rows, one after the other (a step of all rows is their
sum). Median over ``--rounds`` x ``--steps`` timed steps after a warm-up step, the variants interleaved round by
round (a shared machine's load hits them alike). Tokens: 8 greedy steps of each mixed row against the same row on its
merged export, and of each base row against the ``plain`` graph.

(b) **Memory** of ``--memory-adapters`` adapters in one session: ``session.lora.nbytes()`` (the bound stacks: the
zero slot and one per adapter at the graph's rank) against the adapters' own bytes (their A and B as loaded) and
against one base per adapter (the graph's weight bytes x N).

(c) **Load and unload while serving**: a base row and two adapter rows decode 12 greedy steps; the run is repeated
with a new adapter loaded after step 4 and an idle one unloaded after step 8, and the rows' tokens compared with the
undisturbed run's. Then 5 cycles, the rows still decoding: a step, a load, the first step after it (the stacks
rebuilt and bound), an unload, the first step after it; the medians.

Prints a table and writes ``--out`` (JSON). A script, not a test: no timed assertion anywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MODULE_PATH = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
               "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
CTX_LEN, PREFILL = 256, 64


# ---------------------------------------------------------------------------------------------- the model
def shape(hidden: int, layers: int) -> dict:
    """A Llama config of ``hidden`` width: heads of 64, a quarter as many KV heads, intermediate ~2.75 hidden."""
    heads = hidden // 64
    return dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=max(1, heads // 4), head_dim=64, intermediate_size=int(hidden * 2.75) // 256 * 256,
                vocab_size=16384, tie_word_embeddings=True, rope_theta=500000.0, max_position_embeddings=4096,
                rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)


def build_model(out: Path, cfg: dict) -> Path:
    """The seeded random-weight Llama of ``cfg`` in ``out`` (safetensors, shards of at most 100 MB)."""
    if (out / "config.json").exists():
        return out
    import torch
    import transformers

    config = transformers.LlamaConfig(**cfg)
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():   # q and k a little larger than the default init, so the greedy tokens vary
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(3.0)
            layer.self_attn.k_proj.weight.mul_(3.0)
    model.save_pretrained(out, safe_serialization=True, max_shard_size="100MB")
    return out


def linear_shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    """``module -> (in_features, out_features)`` of each adapted projection."""
    h, i, kv = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_key_value_heads"] * cfg["head_dim"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, i),
            "up_proj": (h, i), "down_proj": (i, h)}


def write_adapter(out: Path, base: Path, cfg: dict, rank: int, seed: int) -> Path:
    """A PEFT LoRA folder (``adapter_config.json`` + ``adapter_model.safetensors``) of rank ``rank`` on every target
    of every layer, seeded normal A (std 1/sqrt(in)) and B (std 0.5/sqrt(r)), ``lora_alpha`` 2 r."""
    from safetensors.numpy import save_file

    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for name, (fan_in, fan_out) in linear_shapes(cfg).items():
            key = f"base_model.model.model.layers.{layer}.{MODULE_PATH[name]}.{name}"
            tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((rank, fan_in)) / np.sqrt(fan_in)).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = (rng.standard_normal((fan_out, rank)) * 0.5 / np.sqrt(rank)).astype(
                np.float32)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
              "target_modules": list(TARGETS), "bias": "none", "use_rslora": False, "use_dora": False,
              "fan_in_fan_out": False, "init_lora_weights": True, "base_model_name_or_path": str(base)}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out


def merge(base: Path, adapter: Path, out: Path) -> Path:
    """``base`` with ``adapter`` merged into its weights (``W + (alpha / r) B @ A``), as a model folder ``out``."""
    if (out / "config.json").exists():
        return out
    from safetensors.numpy import load_file, save_file

    cfg = json.loads((adapter / "adapter_config.json").read_text())
    scale = cfg["lora_alpha"] / cfg["r"]
    lora = load_file(str(adapter / "adapter_model.safetensors"))
    out.mkdir(parents=True)
    for f in sorted(base.iterdir()):
        if f.suffix != ".safetensors":
            if f.is_file():
                (out / f.name).write_bytes(f.read_bytes())
            continue
        weights = load_file(str(f))
        for name, w in weights.items():
            key = "base_model.model." + name.removesuffix(".weight")
            if f"{key}.lora_A.weight" in lora:
                a, b = lora[f"{key}.lora_A.weight"], lora[f"{key}.lora_B.weight"]
                weights[name] = (w + scale * (b @ a)).astype(w.dtype)
        save_file(weights, str(out / f.name), metadata={"format": "pt"})
    return out


def export(model: Path, out: Path, **kw) -> Path:
    """``qeff-kv export`` of ``model`` into ``out`` (reused when there); the graph's path."""
    from qeff_kv.export.api import export_model

    man = out / "manifest.json"
    if not man.exists():
        t0 = time.perf_counter()
        export_model(model, out, ctx_len=CTX_LEN, prefill_seq_len=PREFILL, verify=False, force=True,
                     continuous_batching=True, **kw)
        print(f"exported {out.name} in {time.perf_counter() - t0:.1f} s", flush=True)
    return out / json.loads(man.read_text())["onnx"]


def weight_bytes(graph: Path) -> int:
    """The graph file and its external data: what one base takes."""
    return sum(p.stat().st_size for p in graph.parent.iterdir() if p.name.startswith(graph.name))


# ---------------------------------------------------------------------------------------------- sessions
class Rows:
    """``rows`` sequences of one session, each prefilled with its prompt (adapter ``names[i]`` or the base)."""

    def __init__(self, session, prompts: list[list[int]], names: list[str | None]):
        self.session = session
        self.seqs = [session.add_sequence(adapter=n) for n in names]
        self.first = [int(np.argmax(session.prefill(s, p))) for s, p in zip(self.seqs, prompts)]
        self.next = list(self.first)
        self.context = len(prompts[0])

    def step(self) -> list[int]:
        """One decode step of every row, greedy; the tokens fed."""
        fed = list(self.next)
        out = self.session.decode(list(zip(self.seqs, fed)))
        self.next = [int(np.argmax(out[s])) for s in self.seqs]
        return fed

    def rewind(self) -> None:
        """Back to the prompts (the timed steps leave the context as it was)."""
        for s in self.seqs:
            self.session.truncate(s, self.context)
        self.next = list(self.first)

    def greedy(self, steps: int) -> list[list[int]]:
        toks = [self.step() for _ in range(steps)]
        self.rewind()
        return [list(col) for col in zip(*toks)]


def session(graph: Path, rows: int, threads: int):
    from qeff_kv.runtime import Session

    return Session(graph.parent, max_sequences=rows, threads=threads)


def prompts_for(rows: int, context: int, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [[int(t) for t in rng.integers(3, vocab - 1, context)] for _ in range(rows)]


# ---------------------------------------------------------------------------------------------- (a) decode step
def decode_variants(graphs: dict, adapters: list[Path], args) -> tuple[dict, dict]:
    """The sessions of (a): variant name -> list of :class:`Rows` (a step of the variant steps each in turn)."""
    n, per = args.rows, args.rows // args.adapters
    prompts = prompts_for(n, args.context, 16384)
    mixed = session(graphs["lora"], n, args.threads)
    names = [f"a{i}" for i in range(args.adapters)]
    for name, folder in zip(names, adapters):
        mixed.lora.load(name, folder)
    row_names = [names[r // per] for r in range(n)]
    variants = {"lora graph, mixed adapters": [Rows(mixed, prompts, row_names)],
                "lora graph, base rows": [Rows(session(graphs["lora"], n, args.threads), prompts, [None] * n)],
                "plain graph (no adapter inputs)": [Rows(session(graphs["plain"], n, args.threads), prompts,
                                                         [None] * n)],
                "merged export per adapter": [Rows(session(graphs[f"merged-{i}"], per, args.threads),
                                                   prompts[i * per:(i + 1) * per], [None] * per)
                                              for i in range(args.adapters)]}
    return variants, {"row_adapters": row_names}


def time_variants(variants: dict, args) -> dict:
    """Step time quartiles (ms; the median in the middle) of each variant (every set of rows of it stepped once a
    step), interleaved by round."""
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(args.rounds):
        for name, sets in variants.items():
            for rows in sets:   # warm-up
                rows.step()
            for _ in range(args.steps):
                t0 = time.perf_counter()
                for rows in sets:
                    rows.step()
                times[name].append(time.perf_counter() - t0)
            for rows in sets:
                rows.rewind()
    return {k: [round(1e3 * q, 2) for q in statistics.quantiles(v, n=4)] for k, v in times.items()}


def token_agreement(variants: dict, steps: int = 8) -> dict:
    """Greedy tokens of the mixed rows against the merged exports, and of the base rows against the plain graph."""
    mixed = variants["lora graph, mixed adapters"][0].greedy(steps)
    merged = [row for rows in variants["merged export per adapter"] for row in rows.greedy(steps)]
    base = variants["lora graph, base rows"][0].greedy(steps)
    plain = variants["plain graph (no adapter inputs)"][0].greedy(steps)
    same = lambda a, b: sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb))   # noqa: E731
    total = len(mixed) * steps
    return {"steps": steps, "rows": len(mixed), "mixed_vs_merged_same_tokens": same(mixed, merged),
            "base_rows_vs_plain_same_tokens": same(base, plain), "tokens": total,
            "rows_differ_between_adapters": len({tuple(r) for r in mixed}) > 1}


# ---------------------------------------------------------------------------------------------- (b) memory
def adapter_own_bytes(folder: Path) -> int:
    from safetensors.numpy import load_file

    return sum(v.size * 4 for v in load_file(str(folder / "adapter_model.safetensors")).values())


def memory(graphs: dict, adapters: list[Path], args) -> dict:
    """``--memory-adapters`` adapters in one session of the lora graph: the bound stacks against their own bytes
    and against one base per adapter."""
    s = session(graphs["lora"], 1, args.threads)
    for i, folder in enumerate(adapters):
        s.lora.load(f"m{i}", folder)
    Rows(s, prompts_for(1, 8, 16384), [None]).step()   # the stacks are built and bound at the first run
    stacks, own = s.lora.nbytes(), sum(adapter_own_bytes(f) for f in adapters)
    base = weight_bytes(graphs["plain"])
    return {"adapters": len(adapters), "stack_bytes": stacks, "adapters_own_bytes": own, "base_bytes": base,
            "bases_bytes": base * len(adapters), "stack_over_own": round(stacks / own, 3),
            "bases_over_stack": round(base * len(adapters) / stacks, 1)}


# ---------------------------------------------------------------------------------------------- (c) load/unload
def load_unload(graphs: dict, adapters: list[Path], spare: Path, args, steps: int = 12, cycles: int = 5) -> dict:
    """A base row, an ``a0`` row and an ``a1`` row decode ``steps`` greedy steps undisturbed, then again with
    ``spare`` loaded after step 4 and the idle adapter unloaded after step 8: the tokens compared. Then ``cycles``
    times, rows still decoding: a step, load ``spare``, a step (the stacks rebuilt and bound), unload it, a step;
    the medians."""
    s = session(graphs["lora"], 3, args.threads)
    for name, folder in (("a0", adapters[0]), ("a1", adapters[1]), ("idle", adapters[2])):
        s.lora.load(name, folder)
    prompts, names = prompts_for(3, args.context, 16384), [None, "a0", "a1"]
    undisturbed = Rows(s, prompts, names)
    ref = undisturbed.greedy(steps)
    for seq in undisturbed.seqs:
        s.remove_sequence(seq)
    rows, fed = Rows(s, prompts, names), []
    for i in range(steps):
        if i == 4:
            s.lora.load("new", spare)
        if i == 8:
            s.lora.unload("idle")
        fed.append(rows.step())
    got = [list(col) for col in zip(*fed)]
    out = {"steps": steps, "loaded_after": s.lora.names, "base_row_tokens_unchanged": got[0] == ref[0],
           "adapter_rows_tokens_unchanged": got[1:] == ref[1:], "cycles": cycles}
    s.lora.unload("new")
    t: dict[str, list[float]] = {}
    for _ in range(cycles):
        for label, action in (("step_ms", None), ("load_ms", lambda: s.lora.load("new", spare)),
                              ("first_step_after_load_ms", None), ("unload_ms", lambda: s.lora.unload("new")),
                              ("first_step_after_unload_ms", None)):
            t0 = time.perf_counter()
            action() if action is not None else rows.step()
            t.setdefault(label, []).append(time.perf_counter() - t0)
    out.update({k: round(1e3 * statistics.median(v), 2) for k, v in t.items()})
    return out


# ---------------------------------------------------------------------------------------------- main
def prepare(args) -> tuple[dict, list[Path], Path, dict]:
    """The model, the adapters (decode ones first), the merged models and the exports; returns the graphs."""
    work = Path(args.work)
    cfg = shape(args.hidden, args.layers)
    base = build_model(work / "base", cfg)
    count = max(args.adapters, args.memory_adapters) + 1
    adapters = [write_adapter(work / "adapters" / f"a{i}", base, cfg, args.rank, seed=100 + i) for i in range(count)]
    graphs = {"lora": export(base, work / "export-lora", max_lora_rank=args.rank, full_batch_size=args.rows),
              "plain": export(base, work / "export-plain", full_batch_size=args.rows)}
    for i in range(args.adapters):
        merged = merge(base, adapters[i], work / f"merged-{i}")
        graphs[f"merged-{i}"] = export(merged, work / f"export-merged-{i}", full_batch_size=args.rows // args.adapters)
    params = sum(int(np.prod(s)) for s in _param_shapes(base))
    return graphs, adapters[:-1], adapters[-1], {**cfg, "parameters": params}


def _param_shapes(model: Path):
    from safetensors import safe_open

    for f in sorted(model.glob("*.safetensors")):
        with safe_open(str(f), "np") as st:
            for k in st.keys():
                yield st.get_slice(k).get_shape()


def print_table(res: dict) -> None:
    a, b, c = res["decode"], res["memory"], res["load_unload"]
    mixed = a["step_ms"]["lora graph, mixed adapters"]
    print(f"\n{'decode step, ' + str(a['rows']) + ' rows':<52} {'ms':>8} {'mixed/this':>11}")
    for name, ms in a["step_ms"].items():
        q = a["step_ms_quartiles"][name]
        print(f"{name:<52} {ms:8.2f} {mixed / ms:11.2f}   (quartiles {q[0]:.1f}-{q[2]:.1f})")
    t = a["tokens"]
    print(f"tokens: mixed rows = merged exports {t['mixed_vs_merged_same_tokens']}/{t['tokens']}, "
          f"base rows = plain graph {t['base_rows_vs_plain_same_tokens']}/{t['tokens']}")
    mib = 1 << 20
    print(f"\nmemory, {b['adapters']} adapters: stacks {b['stack_bytes'] / mib:.1f} MiB (their own "
          f"{b['adapters_own_bytes'] / mib:.1f} MiB, x{b['stack_over_own']}) against {b['adapters']} bases "
          f"{b['bases_bytes'] / mib:.0f} MiB ({b['bases_over_stack']}x)")
    print(f"\nload {c['load_ms']} ms, first step after {c['first_step_after_load_ms']} ms; unload {c['unload_ms']} ms, "
          f"first step after {c['first_step_after_unload_ms']} ms; a step {c['step_ms']} ms (3 rows); base row "
          f"unchanged {c['base_row_tokens_unchanged']}, adapter rows unchanged {c['adapter_rows_tokens_unchanged']}")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--adapters", type=int, default=4, help="adapters the mixed rows take (rows divide evenly)")
    ap.add_argument("--memory-adapters", type=int, default=10)
    ap.add_argument("--context", type=int, default=64, help="tokens each row holds before the timed steps")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", default="/tmp/qeff-kv-lora-mixed")
    ap.add_argument("--out", default=str(HERE / "results" / "lora_mixed.json"))
    args = ap.parse_args(argv)
    if args.rows % args.adapters:
        ap.error("--rows must be a multiple of --adapters")
    graphs, adapters, spare, model = prepare(args)
    variants, extra = decode_variants(graphs, adapters[:args.adapters], args)
    quartiles = time_variants(variants, args)
    decode = {"rows": args.rows, "adapters": args.adapters, "context": args.context, "steps": args.steps,
              "rounds": args.rounds, **extra, "step_ms": {k: q[1] for k, q in quartiles.items()},
              "step_ms_quartiles": quartiles, "tokens": token_agreement(variants)}
    del variants
    res = {"model": model, "rank": args.rank, "threads": args.threads, "ctx_len": CTX_LEN, "cpus": os.cpu_count(),
           "load_average": [round(x, 1) for x in os.getloadavg()], "decode": decode,
           "load_unload": load_unload(graphs, adapters, spare, args),
           "memory": memory(graphs, adapters[:args.memory_adapters], args)}
    print_table(res)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {args.out}")
    return res


if __name__ == "__main__":
    main()
