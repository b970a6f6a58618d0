"""The family matrix over every CausalLM type of the pinned transformers: tiny seeded models built from each config
class's defaults (benchmarks/tiny_configs.py), exported on each target and compared token for token with
transformers' greedy decoding, so a transformers bump shows what changed.

Usage:
  nice python benchmarks/family_matrix.py [--types a,b] [--targets portable,onnxruntime,onnxruntime-fused]
        [--jobs 1] [--timeout 300] [--out benchmarks/results/family_matrix.json] [--no-docs]
  python benchmarks/family_matrix.py --docs-only            # regenerate docs/family-matrix.md from the JSON
  python benchmarks/family_matrix.py --compare OLD.json [NEW.json]   # what changed (the next bump)
  python benchmarks/family_matrix.py --bugs                 # every MISMATCH, crash and refusal after loading

Each type runs in a forked child (torch, transformers and qeff_kv imported once in the parent) with a timeout: build
the tiny model, transformers' greedy tokens on two prompts, then per target ``export_model`` (ctx 32, chunks of 4)
and the exported graph's greedy tokens (tests/helpers/hf_models.py ``PlainLoop``). Outcomes per cell:

- ``exact``: the tokens equal transformers' (``generate`` with its cache, or, for recurrent layers whose cached
  steps drift, its forward over the whole sequence: ``reference`` says which);
- ``MISMATCH``: exported and verified, but other tokens: a silent wrong answer, the worst outcome;
- ``refused``: a qeff-kv error (one line), with the seconds to it and whether the model had been loaded;
- ``crash``: any other exception (its type and first line): a bug;
- ``build-failed``: the tiny model could not be built or run in transformers (this script's limit, not qeff-kv's);
- ``timeout``: the cell ran past ``--timeout``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "helpers"), str(Path(__file__).resolve().parent)]

TARGETS = ("portable", "onnxruntime", "onnxruntime-fused")
PROMPTS = [[5, 17, 42, 99, 13, 7, 101, 64, 3, 77, 21], [100, 3, 3, 60, 9]]
CTX, CHUNK, NEW = 32, 4, 8
#: a vision-language wrapper's capacity: one image of 16 rows, the probe's text and its decode steps
VLM_CTX = 128
OUT = ROOT / "benchmarks" / "results" / "family_matrix.json"
DOC = ROOT / "docs" / "family-matrix.md"
#: progress messages that mean the weights were being read (qeff_kv.export.api / sources)
_LOADING = ("loading", "checkpoint identity", "streaming", "tracing", "building bundled")
STATUSES = ("exact", "MISMATCH", "exported", "refused", "crash", "build-failed", "timeout")


def causal_lm_types() -> dict[str, str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def vlm_types() -> dict[str, str]:
    """The image-text-to-text wrappers (``vlm:<model_type>``): exported as a user would export the wrapper; their
    tokens are not compared (that needs an image on both sides), the export's own verification still runs."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return {f"vlm:{t}": c for t, c in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.items()}


def _clean(text: str) -> str:
    """``text`` without this run's temporary folders (so two runs compare equal)."""
    return re.sub(r"\S*family-matrix-[^/\s]+/[^/\s]+/(model\d?|[\w-]+)", "<model>", text)


def _line(exc: BaseException) -> str:
    text = str(exc).strip()
    return _clean(f"{type(exc).__name__}: {text.splitlines()[0][:300]}" if text else type(exc).__name__)


def _cell(model_type: str, target: str, model_dir: Path, work: Path, refs: dict) -> dict:
    """Export ``model_dir`` for ``target`` and compare its greedy tokens with ``refs``; the cell's record."""
    from hf_models import PlainLoop, hf_greedy_whole
    from qeff_kv.errors import QeffKvError
    from qeff_kv.export import export_model

    said: list[str] = []
    t0 = time.monotonic()
    rec = dict(type=model_type, target=target)
    extra = {}
    if refs is None:
        from transformers import AutoConfig

        from tiny_configs import vision_image_size

        try:
            size = vision_image_size(AutoConfig.from_pretrained(model_dir))
        except Exception as exc:   # noqa: BLE001 - the survey's own limit, not qeff-kv's
            return dict(rec, status="build-failed", detail="reading the tiny config back: " + _line(exc))
        extra = dict(image_size=size) if size else {}
    try:
        res = export_model(model_dir, work / target, ctx_len=CTX if refs is not None else VLM_CTX,
                           prefill_seq_len=CHUNK, target=target, progress=said.append, **extra)
    except QeffKvError as exc:
        loaded = any(m.startswith(_LOADING) for m in said)
        return dict(rec, status="refused", error=type(exc).__name__, detail=_clean(str(exc).splitlines()[0][:400]),
                    seconds=round(time.monotonic() - t0, 2), loaded=loaded)
    except Exception as exc:   # noqa: BLE001 - a crash is what the matrix records
        return dict(rec, status="crash", detail=_line(exc), seconds=round(time.monotonic() - t0, 2),
                    loaded=any(m.startswith(_LOADING) for m in said))
    if refs is None or res.manifest.get("vision") or res.manifest.get("vision_onnx"):
        # a vision-language graph: verified at export (with an image), tokens not compared
        return dict(rec, status="exported", seconds=round(time.monotonic() - t0, 2))
    try:
        got = [PlainLoop(res.onnx_path, CTX).greedy(p, NEW, CHUNK) for p in PROMPTS]
    except Exception as exc:   # noqa: BLE001
        return dict(rec, status="crash", detail="running the export: " + _line(exc),
                    seconds=round(time.monotonic() - t0, 2), loaded=True)
    rec.update(seconds=round(time.monotonic() - t0, 2), tokens=got)
    if got == refs["cached"]:   # the tokens are the build record's reference_tokens
        rec.pop("tokens")
        return dict(rec, status="exact", reference="generate" if "whole" not in refs else
                    "forward over the whole sequence")
    if "whole" not in refs:
        try:
            refs["whole"] = [hf_greedy_whole(model_dir, p, NEW) for p in PROMPTS]
        except Exception as exc:   # noqa: BLE001
            refs["whole"] = None
            rec["whole_reference_error"] = _line(exc)
    if got == refs["whole"]:
        rec.pop("tokens")
        return dict(rec, status="exact", reference="forward over the whole sequence", reference_tokens=got)
    return dict(rec, status="MISMATCH", reference_tokens=refs["cached"], whole_tokens=refs["whole"],
                **_placeholder_note(model_dir, got, refs["cached"]))


def _placeholder_note(model_dir: Path, got: list, ref: list) -> dict:
    """Where the tokens part after the model generated one of its config's special placeholder ids (an image or
    audio token, inside the tiny vocabulary), say so: a wrapper may treat that id apart from text."""
    cfg = json.loads((model_dir / "config.json").read_text())
    special = {v: k for k, v in cfg.items() if isinstance(v, int) and not isinstance(v, bool)
               and (k.endswith("_token_id") or k.endswith("_token_index"))
               and k not in ("bos_token_id", "eos_token_id", "pad_token_id")}
    for prompt, g, r in zip(PROMPTS, got, ref):
        first = next((i for i, (a, b) in enumerate(zip(g, r)) if a != b), None)
        if first is None:
            continue
        hit = [t for t in prompt + r[:first] if t in special]
        if hit:
            return {"note": f"the tokens part after the sequence holds {special[hit[0]]} {hit[0]} (a placeholder "
                            "id of the tiny config, generated as text)"}
    return {}


def _references(model_dir: Path) -> dict:
    """transformers' greedy tokens: ``generate`` with its cache; where that fails (some hybrids' caches), the
    forward over the whole sequence at every step."""
    from hf_models import hf_greedy, hf_greedy_whole

    try:
        return {"cached": [hf_greedy(model_dir, p, NEW) for p in PROMPTS]}
    except Exception as exc:   # noqa: BLE001
        whole = [hf_greedy_whole(model_dir, p, NEW) for p in PROMPTS]
        return {"cached": whole, "whole": whole, "generate_error": _line(exc)}


def run_type(model_type: str, class_name: str, targets: list[str], work: Path, sink: Path) -> None:
    """One type in a forked child: build, reference, every target; each record appended to ``sink`` (JSON lines)
    as soon as it is known, so a timeout keeps what finished."""
    from tiny_configs import ATTEMPTS, build_tiny

    def emit(rec):
        with sink.open("a") as f:
            f.write(json.dumps(rec) + "\n")

    t0 = time.monotonic()
    if model_type.startswith("vlm:"):
        model_dir = work / "model"
        try:
            summary = build_tiny(model_type[4:], class_name, model_dir)
        except Exception as exc:   # noqa: BLE001
            emit(dict(type=model_type, stage="build", status="build-failed", detail=_line(exc)))
            return
        emit(dict(type=model_type, stage="build", status="built", seconds=round(time.monotonic() - t0, 2),
                  **summary))
        for target in targets:
            emit(_cell(model_type, target, model_dir, work, None))
        return
    for n, (init, untie) in enumerate(ATTEMPTS):   # the first variant whose greedy tokens vary
        model_dir = work / f"model{n}"
        try:
            summary = build_tiny(model_type, class_name, model_dir, init=init, untie=untie)
        except Exception as exc:   # noqa: BLE001
            emit(dict(type=model_type, stage="build", status="build-failed", detail=_line(exc)))
            return
        try:
            refs = _references(model_dir)
        except Exception as exc:   # noqa: BLE001
            emit(dict(type=model_type, stage="reference", status="build-failed", detail="transformers' greedy: "
                      + _line(exc), **summary))
            return
        vary = all(len(set(toks)) > 1 for toks in refs["cached"])
        if n == 0:
            first = (model_dir, summary, refs)
        if vary:
            break
    else:
        model_dir, summary, refs = first
    emit(dict(type=model_type, stage="build", status="built", seconds=round(time.monotonic() - t0, 2),
              tokens_vary=vary, reference_tokens=refs["cached"], **summary,
              **({"generate_error": refs.pop("generate_error")} if "generate_error" in refs else {})))
    for target in targets:
        emit(_cell(model_type, target, model_dir, work, refs))


def _fork_one(model_type, class_name, targets, tmp: Path, timeout: float):
    import multiprocessing as mp

    work = tmp / model_type.replace("/", "_")
    work.mkdir(parents=True, exist_ok=True)
    sink = work / "records.jsonl"
    proc = mp.get_context("fork").Process(target=run_type, args=(model_type, class_name, targets, work, sink))
    proc.start()
    return proc, sink, time.monotonic() + timeout * (1 + len(targets))


def _collect(model_type, class_name, targets, sink: Path, timed_out: bool, exitcode) -> list[dict]:
    recs = [json.loads(x) for x in sink.read_text().splitlines()] if sink.is_file() else []
    for r in recs:
        r.setdefault("class", class_name)
    build = next((r for r in recs if "stage" in r), None)
    done = {r["target"] for r in recs if "target" in r}
    why = "timeout" if timed_out else f"child exited with {exitcode}"
    if build is None:
        recs.append(dict(type=model_type, stage="build", status="timeout" if timed_out else "build-failed",
                         detail=why, **{"class": class_name}))
    elif build["status"] == "built":
        for t in targets:
            if t not in done:
                recs.append(dict(type=model_type, target=t, status="timeout" if timed_out else "crash",
                                 detail=why, **{"class": class_name}))
    return recs


def run_all(types: dict[str, str], targets: list[str], jobs: int, timeout: float, say=print) -> list[dict]:
    """Every type, ``jobs`` children at a time; the records of every type and cell."""
    import torch
    import transformers  # noqa: F401  - imported once, before forking

    import qeff_kv.export  # noqa: F401

    torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    tmp = Path(tempfile.mkdtemp(prefix="family-matrix-"))
    pending, running, out = list(types.items()), [], []
    while pending or running:
        while pending and len(running) < jobs:
            t, cls = pending.pop(0)
            running.append((t, cls, *_fork_one(t, cls, targets, tmp, timeout)))
        time.sleep(0.2)
        for item in list(running):
            t, cls, proc, sink, deadline = item
            late = time.monotonic() > deadline
            if proc.is_alive() and not late:
                continue
            if proc.is_alive():
                proc.kill()
            proc.join()
            running.remove(item)
            recs = _collect(t, cls, targets, sink, late, proc.exitcode)
            out.extend(recs)
            say(f"{t:28s} " + "  ".join(f"{r.get('target', 'build')}={r['status']}" for r in recs))
    return out


def summarize(records: list[dict]) -> dict:
    """Counts per target: exact / MISMATCH / refused before and after loading / crash / timeout; build outcomes."""
    counts: dict[str, dict[str, int]] = {}
    for r in records:
        key = ("vlm " if r["type"].startswith("vlm:") else "") + r.get("target", "build")
        status = r["status"]
        if status == "refused":
            status = "refused-after-load" if r.get("loaded") else "refused-before-load"
        counts.setdefault(key, {}).setdefault(status, 0)
        counts[key][status] += 1
    return counts


def write_results(records: list[dict], targets, path: Path = OUT) -> dict:
    import transformers

    import qeff_kv

    data = dict(transformers=transformers.__version__, qeff_kv=getattr(qeff_kv, "__version__", "?"),
                targets=list(targets), ctx_len=CTX, prefill_seq_len=CHUNK, new_tokens=NEW, prompts=PROMPTS,
                summary=summarize(records), records=records)
    path.parent.mkdir(parents=True, exist_ok=True)
    head = json.dumps({k: v for k, v in data.items() if k != "records"}, indent=1)[:-2]
    body = ",\n".join("  " + json.dumps(r) for r in records)
    path.write_text(f'{head},\n "records": [\n{body}\n ]\n}}\n')
    return data


def merge(old: dict | None, new_records: list[dict], types) -> list[dict]:
    """A subset run (``--types``, ``--targets``) replaces only its own cells in the results file."""
    if not old:
        return new_records
    fresh = {(r["type"], r.get("target", "build")) for r in new_records}
    kept = [r for r in old.get("records", []) if (r["type"], r.get("target", "build")) not in fresh
            and not (r["type"] in types and "target" not in r)]
    return sorted(kept + new_records, key=lambda r: (r["type"], r.get("target", "")))


# --------------------------------------------------------------------------------------------------- compare
def _cells(data: dict) -> dict:
    return {(r["type"], r.get("target", "build")): r for r in data.get("records", [])}


def _label(r: dict | None) -> str:
    if r is None:
        return "absent"
    s = r["status"]
    if s == "refused":
        s += " after load" if r.get("loaded") else " before load"
    return s


def compare(old: dict, new: dict) -> list[str]:
    """One line per cell whose outcome changed between two results files (types appearing or gone too)."""
    a, b = _cells(old), _cells(new)
    lines = [f"transformers {old.get('transformers')} -> {new.get('transformers')}"]
    for key in sorted(set(a) | set(b)):
        ra, rb = a.get(key), b.get(key)
        la, lb = _label(ra), _label(rb)
        detail_changed = ra and rb and ra.get("detail") != rb.get("detail") and la == lb and lb != "exact"
        if la != lb or detail_changed:
            flag = "  <-- MISMATCH" if lb == "MISMATCH" else ""
            extra = f" ({rb.get('detail')})" if rb and rb.get("detail") else ""
            lines.append(f"{key[0]} [{key[1]}]: {la} -> {lb}{extra}{flag}")
    if len(lines) == 1:
        lines.append("no change")
    return lines


def bugs(data: dict) -> list[str]:
    """Every cell the lead must look at: MISMATCH first, then crashes, then refusals after loading."""
    order = {"MISMATCH": 0, "crash": 1, "refused": 2}
    hits = [r for r in data.get("records", []) if "target" in r and (r["status"] in ("MISMATCH", "crash")
                                                                       or r["status"] == "refused" and r.get("loaded"))]
    hits.sort(key=lambda r: (order[r["status"]], r["type"], TARGETS.index(r["target"])))
    return [f"{r['status'] + (' after load' if r['status'] == 'refused' else '')}: {r['type']} [{r['target']}] "
            f"{r.get('detail') or ''}".rstrip() for r in hits]


# ------------------------------------------------------------------------------------------------------ docs
DOC_HEAD = """# Every CausalLM type of transformers {version}

Generated by `python benchmarks/family_matrix.py` (results: `benchmarks/results/family_matrix.json`); do not edit
by hand. Each model type of transformers' `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` is built as a tiny seeded
random-weight model from its config class's defaults, shrunk generically (hidden 64, vocab 128, 4 heads, head_dim
16, 4 experts, sliding windows of 6, the first layer of every layer kind the defaults have;
`benchmarks/tiny_configs.py`), exported at ctx {ctx} in chunks of {chunk} and run on two prompts, {new} greedy
tokens compared with transformers'. This is a survey of what a user meets, not the proof of the supported
families: [supported-models.md](supported-models.md) lists those, each proved by a test.

- **exact**: the tokens equal transformers' greedy tokens.
- **MISMATCH**: exported, but other tokens than transformers' (a bug: a silent wrong answer).
- **refused**: qeff-kv's one-line error; *(after load)* when it came after the weights were loaded.
- **crash**: another exception (a bug).
- **build-failed**: the generic shrinker could not build or run this type in transformers (the survey's limit).
- **timeout**: the cell ran past the script's timeout.

{counts}

| `model_type` | class | layers kept | {targets} |
|---|---|---|{rule}
"""


def _doc_cell(r: dict | None) -> str:
    if r is None:
        return "-"
    s = r["status"]
    if s == "exact":
        return "exact"
    detail = (r.get("detail") or "").replace("|", "\\|").replace("\n", " ")
    if len(detail) > 140:
        detail = detail[:137] + "..."
    if s == "refused":
        return f"refused{' (after load)' if r.get('loaded') else ''}: {detail}"
    if s == "MISMATCH":
        return "**MISMATCH**" + (f" ({r['note']})" if r.get("note") else "")
    return f"{s}: {detail}" if detail else s


def _rows(data: dict, types: list[str]) -> list[str]:
    cells, targets = _cells(data), data["targets"]
    rows = []
    for t in types:
        b = cells.get((t, "build"), {})
        kinds = ", ".join(b.get("kinds") or []) if len(b.get("kinds") or []) <= 4 else f"{len(b['kinds'])} kinds"
        layers = f"{b.get('layers')}" + (f" ({kinds})" if kinds else "") if b.get("layers") else ""
        if b.get("status") != "built":
            row = [_doc_cell(b)] + [""] * (len(targets) - 1)
        else:
            row = [_doc_cell(cells.get((t, x))) for x in targets]
        rows.append(f"| {t.removeprefix('vlm:')} | `{b.get('class', '')}` | {layers} | " + " | ".join(row) + " |")
    return rows


VLM_HEAD = """
## Vision-language wrappers (image-text-to-text types)

Each wrapper of `MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES`, built the same way (its vision encoder at 4x4
merged patches, 16 image rows), exported at ctx {ctx} as a user would export it. Their tokens are not compared
here (that needs the image on both sides); **exported** means the export and its own verification with an image
passed. A failure here may be the generic shrinker's (an image geometry it got wrong) as well as qeff-kv's.

| `model_type` | class | text layers kept | {targets} |
|---|---|---|{rule}
"""


def render_doc(data: dict) -> str:
    targets = data["targets"]
    order = ["built", "exact", "exported", "MISMATCH", "refused-before-load", "refused-after-load", "crash",
             "build-failed", "timeout"]
    keys = sorted(data["summary"], key=lambda k: (k.startswith("vlm"), k.split()[-1] != "build",
                                                  TARGETS.index(k.split()[-1]) if k.split()[-1] in TARGETS else 0))
    counts = [f"- `{key}`: " + ", ".join(f"{data['summary'][key][st]} {st}" for st in order
                                         if st in data["summary"][key]) for key in keys]
    text = DOC_HEAD.format(version=data["transformers"], ctx=data["ctx_len"], chunk=data["prefill_seq_len"],
                           new=data["new_tokens"], counts="\n".join(counts), targets=" | ".join(targets),
                           rule="---|" * len(targets))
    every = sorted({r["type"] for r in data["records"]})
    text += "\n".join(_rows(data, [t for t in every if not t.startswith("vlm:")])) + "\n"
    vlms = [t for t in every if t.startswith("vlm:")]
    if vlms:
        text += VLM_HEAD.format(ctx=VLM_CTX, targets=" | ".join(targets), rule="---|" * len(targets))
        text += "\n".join(_rows(data, vlms)) + "\n"
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--types", help="comma-separated model types (default: every CausalLM type)")
    ap.add_argument("--targets", default="portable", help="comma-separated targets (default: portable)")
    ap.add_argument("--vlm", action="store_true", help="also the image-text-to-text wrappers (vlm:<type>)")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=300, help="seconds per cell (a type gets this per target + 1)")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--no-docs", action="store_true")
    ap.add_argument("--docs-only", action="store_true")
    ap.add_argument("--bugs", action="store_true", help="list every MISMATCH, crash and refusal after loading")
    ap.add_argument("--compare", nargs="+", metavar="JSON", help="OLD.json [NEW.json (default: --out)]")
    args = ap.parse_args(argv)
    if args.bugs:
        print("\n".join(bugs(json.loads(args.out.read_text()))))
        return 0
    if args.compare:
        old = json.loads(Path(args.compare[0]).read_text())
        new = json.loads(Path(args.compare[1] if len(args.compare) > 1 else args.out).read_text())
        print("\n".join(compare(old, new)))
        return 0
    if not args.docs_only:
        targets = [t for t in args.targets.split(",") if t]
        everything = {**causal_lm_types(), **vlm_types()}
        chosen = args.types.split(",") if args.types else \
            [t for t in everything if args.vlm or not t.startswith("vlm:")]
        unknown = [t for t in chosen if t not in everything]
        if unknown:
            ap.error(f"--types: {', '.join(unknown)} not among transformers' CausalLM types (or vlm:<type> wrappers)")
        types = {t: everything[t] for t in chosen}
        records = run_all(types, targets, args.jobs, args.timeout)
        old = json.loads(args.out.read_text()) if args.out.is_file() else None
        if old:   # a type transformers no longer has leaves the results
            old["records"] = [r for r in old["records"] if r["type"] in everything]
        all_targets = sorted(set(targets) | set(old["targets"] if old else []), key=TARGETS.index)
        data = write_results(merge(old, records, types), all_targets, args.out)
        print(json.dumps(data["summary"], indent=1))
    if not args.no_docs:
        DOC.write_text(render_doc(json.loads(args.out.read_text())))
        print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
