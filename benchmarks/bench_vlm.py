"""Vision-language runtime: the vision stage, and what binding the image buffer in place saves per decode step.

    python benchmarks/bench_vlm.py                  # 5 rounds, 2 threads
    python benchmarks/bench_vlm.py --rounds 2       # a smoke run

The model is a Llava with random seeded weights whose *buffers* have Llava-1.5-7B's geometry: a 336x336 image in
14x14 patches gives 576 image rows, and the language hidden size is 2048 (so one image's ``vision_embeds`` is
576 x 2048 x 4 bytes = 4.7 MB, what Llava-1.5-7B's 576 x 4096 rows take in float16). The towers are small (CLIP
4 layers of 256, Llama 2 layers of 2048, vocabulary 8192) so the decode step is short and any per-step copy shows.
Exported once (dual layout, ``onnxruntime`` target, verified at export).

Reported:

* **vision stage**: milliseconds per image (the vision graph writing its rows in place into the image buffer);
* **prefill** of one image (576 tokens) plus 16 text tokens, chunks of 256;
* **single layout**: the decode step of the single graph as exported for onnxruntime (the vision encoder in an
  ``If`` on ``image_idx >= 0``: decode steps skip it) against the same export with that pass off (the encoder runs
  in every step), and their prefill;
* **decode step** with ``N`` images held in the language graph's retained ``vision_embeds`` buffer (N = 1, 4, 16),
  at the same position: qeff-kv's binding (the buffer bound as input *and* output: nothing copied) against the
  same session with only that output rebound to memory onnxruntime allocates each step (what a runner that feeds
  ``vision_embeds_RetainedState`` back does: one copy of the buffer per step). Each configuration runs once per
  round, interleaved; the figure is the median over rounds of each round's median step time, with min-max.

Figures: docs/performance.md (section "Vision-language models").
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
IMAGE_TOKEN = 8000
STEPS = 24


def build_model(work: Path) -> Path:
    out = work / "llava-geometry"
    if (out / "config.json").exists():
        return out
    import torch
    import transformers

    vc = transformers.CLIPVisionConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                                       num_attention_heads=4, image_size=336, patch_size=14, projection_dim=256)
    tc = transformers.LlamaConfig(vocab_size=8192, hidden_size=2048, intermediate_size=5632, num_hidden_layers=2,
                                  num_attention_heads=16, num_key_value_heads=16, head_dim=128,
                                  max_position_embeddings=16384, initializer_range=0.02, bos_token_id=1,
                                  eos_token_id=2, pad_token_id=0)
    cfg = transformers.LlavaConfig(vision_config=vc, text_config=tc, image_token_id=IMAGE_TOKEN,
                                   projector_hidden_act="gelu", vision_feature_select_strategy="default",
                                   vision_feature_layer=-2)
    cfg.architectures = ["LlavaForConditionalGeneration"]
    torch.manual_seed(0)
    transformers.LlavaForConditionalGeneration(cfg).eval().save_pretrained(out, safe_serialization=True)
    return out


def export(model: Path, work: Path) -> Path:
    out = work / "llava-geometry-ort"
    if (out / "manifest.json").exists():
        return out
    from qeff_kv.export import export_model

    return export_model(model, out, ctx_len=1024, prefill_seq_len=256, target="onnxruntime").out_dir


def export_single(model: Path, work: Path, gated: bool) -> Path:
    """The single layout, onnxruntime target: as exported (the encoder gated on image_idx >= 0), or with the gate
    pass switched off (the peer's plain single graph, which encodes the image in every call)."""
    out = work / ("llava-geometry-ort-single" + ("" if gated else "-plain"))
    if (out / "manifest.json").exists():
        return out
    import dataclasses

    from qeff_kv.export import export_model, targets

    saved = targets.REGISTRY["onnxruntime"]
    if not gated:   # the target's registry entry without the gate: the pipeline leaves GateVisionEncoderPass out
        targets.REGISTRY["onnxruntime"] = dataclasses.replace(saved, gates_vision_encoder=False)
    try:
        return export_model(model, out, ctx_len=1024, prefill_seq_len=256, target="onnxruntime",
                            single_graph=True).out_dir
    finally:
        targets.REGISTRY["onnxruntime"] = saved


def decode_ms(session, seq) -> float:
    """Median decode step (ms) at ``seq``'s position."""
    times, pos = [], seq.length
    for _ in range(STEPS // 3):
        t0 = time.perf_counter()
        session.decode({seq: 5})
        times.append(time.perf_counter() - t0)
        session.truncate(seq, pos)
    return statistics.median(times) * 1e3


def step_ms(session, seq, images, copy: bool) -> float:
    """Median decode step (ms) with ``images`` bound, in place or with the output copied each step."""
    media = session.media
    media.begin(session.binding.io, session.binding.bind_out, images)
    media.end()
    if copy:
        session.binding.io.bind_output(media.output_name, "cpu")
    times = []
    pos = seq.length
    for _ in range(STEPS):
        t0 = time.perf_counter()
        session.decode({seq: 5})
        times.append(time.perf_counter() - t0)
        session.truncate(seq, pos)   # same position every step
    if copy:   # back to the in-place binding
        session.binding.bind_out(media.output_name, media.bound.value)
    return statistics.median(times) * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", type=Path, default=HERE / "work")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "vlm.json")
    args = ap.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    from qeff_kv.runtime import VisionLanguageModel
    from qeff_kv.runtime.multimodal.media import Images

    source = build_model(args.work)
    folder = export(source, args.work)
    singles = {label: export_single(source, args.work, label == "gated") for label in ("gated", "plain")}
    vlm = VisionLanguageModel(folder, threads=args.threads)
    s = vlm.session
    rng = np.random.default_rng(0)
    pixels = rng.standard_normal((1, 3, 336, 336)).astype(np.float32)
    prompt = [1, 5, 6] + [IMAGE_TOKEN] * 576 + list(range(10, 23))
    vision, prefill = [], []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        images = vlm.images(prompt, {"pixel_values": pixels})
        vision.append((time.perf_counter() - t0) * 1e3)
        seq = s.add_sequence()
        t0 = time.perf_counter()
        s.prefill(seq, prompt, images)
        prefill.append((time.perf_counter() - t0) * 1e3)
        s.remove_sequence(seq)
    seq = s.add_sequence()
    s.prefill(seq, prompt, images)
    held = {n: Images(np.ascontiguousarray(np.repeat(images.array, n, axis=0)), n, n * 576) for n in (1, 4, 16)}
    steps: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for n, imgs in held.items():
            for copy in (False, True):
                steps.setdefault(f"{n}:{'copied' if copy else 'in place'}", []).append(step_ms(s, seq, imgs, copy))
    single: dict[str, list[float]] = {}
    single_prefill: dict[str, list[float]] = {}
    opened = {label: VisionLanguageModel(path, threads=args.threads) for label, path in singles.items()}
    seqs = {}
    for label, m in opened.items():
        seqs[label] = m.session.add_sequence()
        t0 = time.perf_counter()
        m.session.prefill(seqs[label], prompt, m.images(prompt, {"pixel_values": pixels}))
        single_prefill[label] = [(time.perf_counter() - t0) * 1e3]
    for _ in range(args.rounds):
        for label, m in opened.items():
            single.setdefault(label, []).append(decode_ms(m.session, seqs[label]))
    result = {
        "model": "Llava geometry (576 rows x 2048 per image), onnxruntime target, float32",
        "threads": args.threads, "rounds": args.rounds,
        "vision_ms_per_image": round(statistics.median(vision), 1),
        "prefill_ms_592_tokens": round(statistics.median(prefill), 1),
        "decode_step_ms": {k: {"median": round(statistics.median(v), 2), "min": round(min(v), 2),
                               "max": round(max(v), 2)} for k, v in steps.items()},
        "image_buffer_mib": {str(n): round(i.array.nbytes / 2**20, 1) for n, i in held.items()},
        "single_layout_decode_step_ms": {k: {"median": round(statistics.median(v), 2), "min": round(min(v), 2),
                                             "max": round(max(v), 2)} for k, v in single.items()},
        "single_layout_prefill_ms_592_tokens": {k: round(v[0], 1) for k, v in single_prefill.items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
