"""lm-evaluation-harness's ``local-completions`` model against ``qeff-kv serve``: the multiple-choice accuracy of
several exports of one model, side by side (e.g. fp32 vs int4 weights).

    python benchmarks/bench_lm_eval.py --lm-eval /tmp/venv/bin/python NAME=EXPORT [NAME=EXPORT ...] [--json PATH]

Any export scores (one exported with ``--speculative-tokens K`` returns every position's logits of a prefill
chunk in one run, faster; another is fed one position per run: the same values). lm-eval scores
each choice with a loglikelihood request (``/v1/completions`` with ``echo: true, logprobs: 1, max_tokens: 1``, the
prompt as token ids), which reads the prompt tokens' logprobs. For each export the script starts ``qeff-kv serve``
on a free port, runs ``lm_eval`` (installed in the interpreter given by ``--lm-eval``: lm-eval is not a
dependency of qeff-kv) on the local task ``tiny_mc`` (``benchmarks/data/tiny_mc.jsonl``: 40 four-way questions,
20 capitals and 20 everyday facts; read from disk, nothing downloaded), with the export's own ``tokenizer.json``,
and reports ``acc`` and ``acc_norm`` with their standard errors, and the scoring throughput (the server's prompt
tokens over the sum of its times to first token, from ``/metrics``). ``--task-file`` takes another JSONL file of
``{"question", "choices", "label"}``.
"""

from __future__ import annotations

import argparse
import json
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
TASK_YAML = """task: tiny_mc
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


def run_lm_eval(python: str, export: Path, port: int, task_dir: Path, out: Path) -> dict:
    name = export.name
    args = (f"model={name},base_url=http://127.0.0.1:{port}/v1/completions,tokenizer_backend=huggingface,"
            f"tokenizer={export},tokenized_requests=True,num_concurrent=1,max_retries=1")
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    cmd = [python, "-m", "lm_eval", "--model", "local-completions", "--model_args", args, "--tasks", "tiny_mc",
           "--include_path", str(task_dir), "--batch_size", "1", "--output_path", str(out)]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env=env)
    wall = time.perf_counter() - t0
    found = sorted(out.rglob("results_*.json"))
    if not found:
        raise SystemExit(f"lm_eval wrote no results under {out}")
    res = json.loads(found[-1].read_text())["results"]["tiny_mc"]
    tokens, scoring_s = scoring_metrics(port)
    return {"acc": res["acc,none"], "acc_stderr": res["acc_stderr,none"], "acc_norm": res["acc_norm,none"],
            "acc_norm_stderr": res["acc_norm_stderr,none"], "wall_s": round(wall, 1), "prompt_tokens": tokens,
            "scoring_s": round(scoring_s, 1), "scored_tok_s": round(tokens / scoring_s, 1) if scoring_s else None}


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
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-lm-eval-") as tmp:
        task_dir = Path(tmp) / "tasks"
        task_dir.mkdir()
        (task_dir / "tiny_mc.yaml").write_text(TASK_YAML.format(data=a.task_file.resolve()))
        for item in a.exports:
            name, _, folder = item.partition("=")
            export, port = Path(folder), free_port()
            proc = start_server(export, port, Path(tmp) / f"{name}.log")
            try:
                results[name] = run_lm_eval(a.lm_eval, export, port, task_dir, Path(tmp) / name)
            finally:
                proc.terminate()
                proc.wait(timeout=60)
            print(name, results[name], flush=True)
    n = sum(1 for _ in a.task_file.open())
    print(f"\n{a.task_file.name}: {n} questions, 4 choices each\n")
    print("| export | acc | acc_norm | lm_eval wall (s) | prompt tokens | scoring (s) | scored tokens/s |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['acc']:.3f} ± {r['acc_stderr']:.3f} | {r['acc_norm']:.3f} ± {r['acc_norm_stderr']:.3f} "
              f"| {r['wall_s']} | {r['prompt_tokens']} | {r['scoring_s']} | {r['scored_tok_s']} |")
    if a.json:
        a.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
