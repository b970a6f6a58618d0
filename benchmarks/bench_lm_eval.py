"""lm-evaluation-harness's ``local-completions`` model against ``qeff-kv serve``: the multiple-choice accuracy of
several exports of one model, side by side (e.g. fp32 vs int4 weights).

    python benchmarks/bench_lm_eval.py --lm-eval /tmp/venv/bin/python NAME=EXPORT [NAME=EXPORT ...] [--json PATH]

Any export scores (one exported with ``--speculative-tokens K`` returns every position's logits of a prefill
chunk in one run, faster; another is fed one position per run: the same values). lm-eval scores
each choice with a loglikelihood request (``/v1/completions`` with ``echo: true, logprobs: 1, max_tokens: 1``, the
prompt as token ids), which reads the prompt tokens' logprobs. For each export the script starts ``qeff-kv serve``
on a free port, runs ``lm_eval`` (installed in the interpreter given by ``--lm-eval``: lm-eval is not a
dependency of qeff-kv) on a local task (by default ``tiny_mc``, ``benchmarks/data/tiny_mc.jsonl``: 40 four-way
questions, 20 capitals and 20 everyday facts; read from disk, nothing downloaded), with the export's own ``tokenizer.json``,
and reports ``acc`` and ``acc_norm`` with their standard errors, and the scoring throughput (the server's prompt
tokens over the sum of its times to first token, from ``/metrics``). ``--task-file`` takes another JSONL file of
``{"question", "choices", "label"}`` (the task is named after the file: ``--task-file benchmarks/data/facts_mc.jsonl``,
506 questions of plain facts written for this project, is ``facts_mc``; an optional ``"topic"`` field gives
per-topic accuracies).

With two or more exports the script also compares each with the first (``--baseline`` names another) **question by
question**, from lm-eval's logged samples (``--log_samples``): how many questions' chosen answer differs, how many
the baseline gets right and the other wrong and the reverse, the accuracy difference with the standard error of the
paired difference (``sqrt(var(d) / n)`` over the per-question differences ``d`` in {-1, 0, 1}) and its 95%
interval, McNemar's exact two-sided p on the discordant questions, and the largest change of any choice's
loglikelihood. Two exports of one model agree on most questions, so the paired standard error is far smaller than
the two accuracies' own (``sqrt(se_a^2 + se_b^2)``, also printed): it resolves a change of one point where the
accuracies alone cannot.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
DATA = HERE / "data" / "tiny_mc.jsonl"
TASK_YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(export: Path, port: int, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "qeff_kv_cli.main", "serve", str(export), "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"qeff-kv serve {export} exited: see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return proc
        except OSError:
            time.sleep(1)
    proc.kill()
    raise SystemExit(f"qeff-kv serve {export} did not start in 300 s: see {log}")


def run_lm_eval(python: str, export: Path, port: int, task_dir: Path, task: str, out: Path) -> dict:
    name = export.name
    args = (f"model={name},base_url=http://127.0.0.1:{port}/v1/completions,tokenizer_backend=huggingface,"
            f"tokenizer={export},tokenized_requests=True,num_concurrent=1,max_retries=1")
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    cmd = [python, "-m", "lm_eval", "--model", "local-completions", "--model_args", args, "--tasks", task,
           "--include_path", str(task_dir), "--batch_size", "1", "--output_path", str(out), "--log_samples"]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env=env)
    wall = time.perf_counter() - t0
    found = sorted(out.rglob("results_*.json"))
    if not found:
        raise SystemExit(f"lm_eval wrote no results under {out}")
    res = json.loads(found[-1].read_text())["results"][task]
    tokens, scoring_s = scoring_metrics(port)
    return {"acc": res["acc,none"], "acc_stderr": res["acc_stderr,none"], "acc_norm": res["acc_norm,none"],
            "acc_norm_stderr": res["acc_norm_stderr,none"], "wall_s": round(wall, 1), "prompt_tokens": tokens,
            "scoring_s": round(scoring_s, 1), "scored_tok_s": round(tokens / scoring_s, 1) if scoring_s else None,
            "samples": read_samples(out, task)}


def read_samples(out: Path, task: str) -> list[dict]:
    """lm-eval's logged samples, one per question in ``doc_id`` order: the choices' loglikelihoods, the gold
    index, the topic, and the choice ``acc`` and ``acc_norm`` pick (argmax of the loglikelihood, and of it over the
    choice's length in characters, as lm-eval computes them; checked against lm-eval's own per-question scores)."""
    found = sorted(out.rglob(f"samples_{task}_*.jsonl"))
    if not found:
        raise SystemExit(f"lm_eval wrote no samples under {out}")
    samples = []
    for line in found[-1].read_text().splitlines():
        s = json.loads(line)
        choices = s["doc"]["choices"]
        lls = [float(r[0]) for r in s["filtered_resps"]]
        pred = max(range(len(lls)), key=lambda i: lls[i])
        pred_norm = max(range(len(lls)), key=lambda i: lls[i] / len(choices[i]))
        gold = int(s["doc"]["label"])
        if float(pred == gold) != float(s["acc"]) or float(pred_norm == gold) != float(s["acc_norm"]):
            raise SystemExit(f"question {s['doc_id']}: the recomputed choice disagrees with lm-eval's score")
        samples.append({"doc_id": s["doc_id"], "topic": s["doc"].get("topic", ""), "gold": gold, "lls": lls,
                        "pred": pred, "pred_norm": pred_norm})
    return sorted(samples, key=lambda x: x["doc_id"])


def mcnemar_p(b: int, c: int) -> float:
    """McNemar's exact two-sided p: under no change, the discordant questions split as a fair coin."""
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(b, c) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def paired_metric(base: list[dict], other: list[dict], key: str) -> dict:
    """The paired comparison of one metric (``pred`` for acc, ``pred_norm`` for acc_norm) over the same questions."""
    n = len(base)
    right_a = [s[key] == s["gold"] for s in base]
    right_b = [s[key] == s["gold"] for s in other]
    d = [int(b) - int(a) for a, b in zip(right_a, right_b)]
    mean = sum(d) / n
    se = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1) / n) if n > 1 else 0.0
    sd = [math.sqrt(p * (1 - p) / (n - 1)) if n > 1 else 0.0 for p in (sum(right_a) / n, sum(right_b) / n)]
    lost = sum(1 for x in d if x < 0)
    gained = sum(1 for x in d if x > 0)
    return {"differ": sum(1 for a, b in zip(base, other) if a[key] != b[key]), "base_right_other_wrong": lost,
            "base_wrong_other_right": gained, "delta": mean, "delta_stderr": se,
            "ci95": [mean - 1.96 * se, mean + 1.96 * se], "mcnemar_p": mcnemar_p(lost, gained),
            "unpaired_stderr": math.hypot(*sd)}


def paired(base: dict, other: dict) -> dict:
    a, b = base["samples"], other["samples"]
    if [s["doc_id"] for s in a] != [s["doc_id"] for s in b] or [s["gold"] for s in a] != [s["gold"] for s in b]:
        raise SystemExit("the two exports were not scored on the same questions")
    dll = [abs(x - y) for sa, sb in zip(a, b) for x, y in zip(sa["lls"], sb["lls"])]
    return {"n": len(a), "acc": paired_metric(a, b, "pred"), "acc_norm": paired_metric(a, b, "pred_norm"),
            "max_abs_ll_change": max(dll), "mean_abs_ll_change": sum(dll) / len(dll)}


def scoring_metrics(port: int) -> tuple[int, float]:
    """The server's prompt tokens and the sum of its times to first token (``/metrics``): with ``max_tokens: 1``
    and one request at a time, the time spent scoring prompts (lm-eval's own overhead excluded)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("qeff_kv_prompt_tokens_total", "qeff_kv_time_to_first_token_seconds_sum"):
            values[name] = float(value)
    return int(values.get("qeff_kv_prompt_tokens_total", 0)), values.get("qeff_kv_time_to_first_token_seconds_sum", 0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("exports", nargs="+", help="NAME=EXPORT_FOLDER")
    ap.add_argument("--lm-eval", required=True, help="a Python interpreter with lm-eval installed")
    ap.add_argument("--task-file", type=Path, default=DATA)
    ap.add_argument("--baseline", help="the export the others are compared with, question by question (default: "
                                       "the first)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    task = a.task_file.stem
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-lm-eval-") as tmp:
        task_dir = Path(tmp) / "tasks"
        task_dir.mkdir()
        (task_dir / f"{task}.yaml").write_text(TASK_YAML.format(task=task, data=a.task_file.resolve()))
        for item in a.exports:
            name, _, folder = item.partition("=")
            export, port = Path(folder), free_port()
            proc = start_server(export, port, Path(tmp) / f"{name}.log")
            try:
                results[name] = run_lm_eval(a.lm_eval, export, port, task_dir, task, Path(tmp) / name)
            finally:
                proc.terminate()
                proc.wait(timeout=60)
            print(name, {k: v for k, v in results[name].items() if k != "samples"}, flush=True)
    base = a.baseline or next(iter(results))
    comparisons = {name: paired(results[base], r) for name, r in results.items() if name != base}
    report(a.task_file, results, base, comparisons)
    if a.json:
        a.json.write_text(json.dumps({"task_file": a.task_file.name, "baseline": base, "exports": results,
                                      "paired": comparisons}, indent=1))


def report(task_file: Path, results: dict, base: str, comparisons: dict) -> None:
    n = sum(1 for _ in task_file.open())
    print(f"\n{task_file.name}: {n} questions, 4 choices each\n")
    print("| export | acc | acc_norm | lm_eval wall (s) | prompt tokens | scoring (s) | scored tokens/s |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['acc']:.3f} ± {r['acc_stderr']:.3f} | {r['acc_norm']:.3f} ± {r['acc_norm_stderr']:.3f} "
              f"| {r['wall_s']} | {r['prompt_tokens']} | {r['scoring_s']} | {r['scored_tok_s']} |")
    topics = sorted({s["topic"] for r in results.values() for s in r["samples"]} - {""})
    if topics:
        print("\n| export | " + " | ".join(topics) + " |\n|---|" + "---|" * len(topics))
        for name, r in results.items():
            cells = []
            for t in topics:
                got = [s["pred"] == s["gold"] for s in r["samples"] if s["topic"] == t]
                cells.append(f"{sum(got)}/{len(got)}")
            print(f"| {name} | " + " | ".join(cells) + " |")
    if comparisons:
        print(f"\nPaired against {base} (n questions; right->wrong / wrong->right; difference ± paired standard "
              f"error [95% interval]; McNemar exact p):\n")
        print("| export | metric | chosen answer differs | right->wrong | wrong->right | difference (points) "
              "| 95% interval | McNemar p | unpaired stderr (points) | max \\|Δ loglik\\| |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for name, c in comparisons.items():
            for metric in ("acc", "acc_norm"):
                m = c[metric]
                lo, hi = m["ci95"]
                print(f"| {name} | {metric} | {m['differ']} of {c['n']} | {m['base_right_other_wrong']} | "
                      f"{m['base_wrong_other_right']} | {100 * m['delta']:+.2f} ± {100 * m['delta_stderr']:.2f} | "
                      f"[{100 * lo:+.2f}, {100 * hi:+.2f}] | {m['mcnemar_p']:.3g} | "
                      f"{100 * m['unpaired_stderr']:.2f} | {c['max_abs_ll_change']:.3g} |")


if __name__ == "__main__":
    main()
