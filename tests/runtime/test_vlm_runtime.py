"""Vision-language models in qeff-kv's runtime (issue 10): a vision stage feeding the language ``Session``.

Llava (CLIP + Llama), Qwen2.5-VL (multimodal RoPE) and Gemma3 (bidirectional image blocks, a sliding ring), in the
dual and single layouts, give transformers' greedy tokens with the image; the image buffer is bound in place and
the vision graph runs once per image; several sequences with different images share a continuous-batching graph;
a state file hands a prefill over to another graph of the same checkpoint; refusals are one line.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from suite import requires_torch

pytestmark = [requires_torch]

CTX, CHUNK, NEW = 48, 4, 8
LLAVA_TOKEN, QWEN_TOKEN = 120, 150
GRID = [1, 4, 4]


def llava_prompt(images: int = 1) -> list[int]:
    # 3 text tokens, 16 image tokens per image (straddling chunks of 4), then text
    return [1, 5, 6] + [LLAVA_TOKEN] * (16 * images) + [7, 8, 9, 40, 41]


def qwen_prompt(images: int = 1) -> list[int]:
    body = []
    for _ in range(images):
        body += [148] + [QWEN_TOKEN] * 4 + [149, 11]
    return [1, 5] + body + [7, 8, 9, 20, 33]


def gemma3_prompt() -> list[int]:
    # the 16-token image in one chunk of its own; 41 positions pass the sliding window of 24
    return [1, 5, 6, 7, 8] + [LLAVA_TOKEN] * 16 + [int(t) for t in np.random.default_rng(3).integers(3, 110, size=20)]


def qwen_inputs(images: int = 1, seed: int = 0) -> dict:
    from hf_models import qwen_patches

    return {"pixel_values": np.concatenate([qwen_patches(seed + i) for i in range(images)]),
            "image_grid_thw": np.array([GRID] * images)}


def llava_inputs(images: int = 1, seed: int = 0) -> dict:
    from hf_models import llava_image

    return {"pixel_values": np.concatenate([llava_image(seed + i) for i in range(images)])}


def hf_greedy(model_dir, prompt, inputs: dict | None, new: int = NEW) -> list[int]:
    """transformers ``generate``, greedy, eager attention, with the image inputs (several images allowed)."""
    import inspect

    import torch
    import transformers

    model = transformers.AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32,
                                                                     attn_implementation="eager").eval()
    ids = torch.tensor([prompt], dtype=torch.int64)
    extra = {k: torch.from_numpy(np.asarray(v)) for k, v in (inputs or {}).items()}
    params = inspect.signature(model.forward).parameters
    if inputs and "token_type_ids" in params:
        extra["token_type_ids"] = (ids == model.config.image_token_id).to(torch.int64)
    if "image_grid_thw" in extra:
        extra["mm_token_type_ids"] = (ids == model.config.image_token_id).to(torch.int64)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **extra, max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


# ------------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from hf_models import make_gemma3_vlm_dir, make_llava_dir, make_qwen25vl_dir

    root = tmp_path_factory.mktemp("vlm_models")
    return {"llava": make_llava_dir(root), "qwen": make_qwen25vl_dir(root), "gemma3": make_gemma3_vlm_dir(root)}


@pytest.fixture(scope="module")
def exports(models, tmp_path_factory):
    """``exports(model, target="portable", single=False, cb=False)``: each exported once, prefix VLLM."""
    from qeff_kv.export import export_model

    root = tmp_path_factory.mktemp("vlm_runtime_exports")
    cache: dict = {}

    def get(name: str, target: str = "portable", single: bool = False, cb: bool = False):
        key = (name, target, single, cb)
        if key not in cache:
            kw = dict(ctx_len=64, prefill_seq_len=16) if name == "gemma3" else dict(ctx_len=CTX, prefill_seq_len=CHUNK)
            if name == "qwen":
                kw["image_size"] = 16
            out = root / "-".join([name, target, "single" if single else "dual", "cb" if cb else "one"])
            res = export_model(models[name], out, target=target, single_graph=single, kv_cache_prefix="VLLM",
                               continuous_batching=cb, full_batch_size=3 if cb else None, **kw)
            assert res.manifest["verification"]["status"] == "passed"
            cache[key] = res.out_dir
        return cache[key]

    return get


@pytest.fixture(scope="module")
def want(models):
    """transformers' greedy tokens for each model's prompt and image."""
    return {
        "llava": hf_greedy(models["llava"], llava_prompt(), llava_inputs()),
        "qwen": hf_greedy(models["qwen"], qwen_prompt(), qwen_inputs()),
        "gemma3": hf_greedy(models["gemma3"], gemma3_prompt(), llava_inputs()),
    }


CASES = {"llava": (llava_prompt, llava_inputs), "qwen": (qwen_prompt, qwen_inputs),
         "gemma3": (gemma3_prompt, llava_inputs)}


# ------------------------------------------------------------------------------------------------ parity
@pytest.mark.parametrize("single", [False, True], ids=["dual", "single"])
@pytest.mark.parametrize("name,target", [("llava", "portable"), ("llava", "onnxruntime-fused"),
                                         ("qwen", "portable"), ("qwen", "onnxruntime"), ("gemma3", "portable"),
                                         ("gemma3", "onnxruntime")])
def test_greedy_tokens_equal_transformers_with_the_image(name, target, single, exports, want):
    from qeff_kv.runtime import VisionLanguageModel

    assert len(set(want[name])) > 1, "greedy tokens do not vary: the parity proves little"
    model = VisionLanguageModel(exports(name, target, single))
    make_prompt, make_inputs = CASES[name]
    [g] = model.generate([(make_prompt(), make_inputs())], max_new_tokens=NEW)
    assert g.tokens == want[name]
    assert model.session.inplace
    assert (model.vision is None) == single
    assert model.session.timings.images == 1


def test_the_image_matters(models, exports, want):
    """Another image gives other tokens (so the parity above is about the image)."""
    from qeff_kv.runtime import VisionLanguageModel

    other = hf_greedy(models["llava"], llava_prompt(), llava_inputs(seed=5))
    assert other != want["llava"]
    model = VisionLanguageModel(exports("llava"))
    [g] = model.generate([(llava_prompt(), llava_inputs(seed=5))], max_new_tokens=NEW)
    assert g.tokens == other


def test_bound_in_place_and_the_vision_graph_runs_once_per_image(models, exports):
    from qeff_kv.runtime import VisionLanguageModel

    model = VisionLanguageModel(exports("llava"))
    s = model.session
    kv_before = s.kv_data_pointers()
    prompt, inputs = llava_prompt(images=2), llava_inputs(images=2)
    p = model.prompt(prompt, inputs)
    assert model.vision.runs == 2 and p.images.count == 2 and p.images.rows == 32
    [g] = s.generate([p], max_new_tokens=NEW)
    assert g.tokens == hf_greedy(models["llava"], prompt, inputs)
    # the vision graph wrote each image's rows into the buffer the language graph reads and writes
    bound = s.bound_output_pointers()
    assert bound["vision_embeds_RetainedState"] == p.images.value.data_ptr() == p.images.array.ctypes.data
    assert s.kv_data_pointers() == kv_before
    assert all(bound[n + "_RetainedState"] == ptr for n, ptr in kv_before.items())
    assert model.vision.runs == 2   # decode steps never rerun it


def test_two_images_with_multimodal_rope(models, exports):
    """Two Qwen2.5-VL images: each image's RoPE rows and the text offset after each."""
    from qeff_kv.runtime import VisionLanguageModel

    prompt, inputs = qwen_prompt(images=2), qwen_inputs(images=2, seed=3)
    model = VisionLanguageModel(exports("qwen"))
    [g] = model.generate([(prompt, inputs)], max_new_tokens=NEW)
    assert g.tokens == hf_greedy(models["qwen"], prompt, inputs)
    marks = [(m.start, m.end, m.delta) for m in g.sequence.rope_marks]
    assert marks == [(3, 7, -2), (10, 14, -4)]   # 2x2 merged tokens advance RoPE by 2, not 4


def test_sequences_with_different_images_share_a_continuous_batching_graph(models, exports):
    from qeff_kv.runtime import VisionLanguageModel

    model = VisionLanguageModel(exports("llava", cb=True))
    assert model.session.continuous_batching and model.session.max_sequences == 3
    text_only = [1, 9, 30, 31, 77, 5]
    gens = model.generate([(llava_prompt(), llava_inputs(seed=0)), (llava_prompt(), llava_inputs(seed=5)),
                           text_only], max_new_tokens=NEW)
    assert [g.sequence.slot for g in gens] == [0, 1, 2]
    assert gens[0].tokens == hf_greedy(models["llava"], llava_prompt(), llava_inputs(seed=0))
    assert gens[1].tokens == hf_greedy(models["llava"], llava_prompt(), llava_inputs(seed=5))
    assert gens[2].tokens == hf_greedy(models["llava"], text_only, None)


def test_an_image_token_generated_after_the_prompt_keeps_its_text_embedding(models, exports):
    """transformers merges images into the prompt only; a decode step never reads the image rows."""
    import torch
    import transformers

    from qeff_kv.runtime import VisionLanguageModel

    model = VisionLanguageModel(exports("llava"))
    s = model.session
    seq = s.add_sequence()
    s.prefill(seq, llava_prompt(), model.images(llava_prompt(), llava_inputs()))
    got = s.decode({seq: LLAVA_TOKEN})[seq]
    hf = transformers.AutoModelForImageTextToText.from_pretrained(models["llava"], dtype=torch.float32,
                                                                  attn_implementation="eager").eval()
    ids = torch.tensor([llava_prompt()])
    from qeff_kv.export import transformers_adapter as adapter

    with torch.no_grad():
        out = hf(input_ids=ids, pixel_values=torch.from_numpy(llava_inputs()["pixel_values"]), use_cache=True)
        step = hf(input_ids=torch.tensor([[LLAVA_TOKEN]]), use_cache=True,
                  **adapter.with_cache(hf, adapter.returned_cache(out)))
    np.testing.assert_allclose(got, step.logits[0, -1].numpy(), atol=1e-4)


def test_text_only_prompt_on_a_vision_language_graph(models, exports):
    from qeff_kv.runtime import Session

    s = Session(exports("qwen"))
    prompt = [1, 5, 9, 30, 31, 77]
    [g] = s.generate([prompt], max_new_tokens=NEW)
    assert g.tokens == hf_greedy(models["qwen"], prompt, None)


def test_an_image_in_a_later_prefill_call_continues_the_rope_positions(models, exports, want):
    """Text first, then the image in a second prefill call: the image's RoPE rows start where the text ended."""
    from qeff_kv.runtime import VisionLanguageModel

    model = VisionLanguageModel(exports("qwen"))
    s = model.session
    prompt = qwen_prompt()
    seq = s.add_sequence()
    s.prefill(seq, prompt[:2])
    logits = s.prefill(seq, prompt[2:], model.images(prompt[2:], qwen_inputs()))
    toks = [int(np.argmax(logits))]
    while len(toks) < NEW:
        toks.append(int(np.argmax(s.decode({seq: toks[-1]})[seq])))
    assert toks == want["qwen"]
    assert [(m.start, m.end, m.delta) for m in seq.rope_marks] == [(3, 7, -2)]


def test_a_second_turn_with_an_image_after_generated_text(models, exports):
    """A sequence continues with a new prompt holding an image; the token it generated last is fed first."""
    from qeff_kv.runtime import Prompt, VisionLanguageModel

    model = VisionLanguageModel(exports("qwen"))
    first = [1, 5, 9, 30]
    [g1] = model.generate([first], max_new_tokens=3)
    turn = [148] + [QWEN_TOKEN] * 4 + [149, 7, 8]
    [g2] = model.generate([(g1.sequence, Prompt(turn, model.images(turn, qwen_inputs())))], max_new_tokens=NEW)
    full = first + g1.tokens + turn
    assert g1.tokens + g2.tokens == hf_greedy(models["qwen"], first, None, 3) + hf_greedy(models["qwen"], full,
                                                                                          qwen_inputs())


# ------------------------------------------------------------------------------------------------ state
@pytest.mark.parametrize("name", ["qwen", "llava"])
def test_prefill_hands_off_to_the_other_layout_with_the_serving_regex(name, exports, want, tmp_path):
    """Prefill on the dual layout, save the buffers ``.*VLLM.*`` selects, decode on the single layout."""
    from safetensors import safe_open

    from qeff_kv.runtime import VisionLanguageModel

    make_prompt, make_inputs = CASES[name]
    prefill = VisionLanguageModel(exports(name))
    [g] = prefill.generate([(make_prompt(), make_inputs())], max_new_tokens=0)
    assert g.finish_reason == "prefill"
    path = prefill.session.save_state(g.sequence, tmp_path / "s.safetensors")
    with safe_open(str(path), "np") as f:
        names, meta = sorted(f.keys()), f.metadata()
    assert names == sorted(p.input_name for p in prefill.session.layout.pairs)   # KV only: no image buffer
    assert all("VLLM" in n for n in names) and meta["selection"] == ".*VLLM.*"
    if name == "qwen":
        assert json.loads(meta["rope_marks"]) == [[3, 7, -2]]
    decode = VisionLanguageModel(exports(name, single=True))
    seq = decode.session.load_state(path)
    [d] = decode.session.generate([seq], max_new_tokens=NEW)
    assert d.tokens == want[name]


def test_rewind_keeps_the_rope_offset_and_refuses_to_cut_an_image(exports, want):
    from qeff_kv.errors import RuntimeInputError
    from qeff_kv.runtime import VisionLanguageModel

    model = VisionLanguageModel(exports("qwen"))
    s = model.session
    [g] = model.generate([(qwen_prompt(), qwen_inputs())], max_new_tokens=NEW)
    seq, n = g.sequence, len(qwen_prompt())
    with pytest.raises(RuntimeInputError, match=r"^cannot rewind to 5: an image holds positions \[3, 7\) and its "
                                                r"multimodal RoPE rows would be cut"):
        s.truncate(seq, 5)
    s.truncate(seq, n)
    [again] = s.generate([(seq, [want["qwen"][0]])], max_new_tokens=NEW - 1)
    assert again.tokens == want["qwen"][1:]
    s.truncate(seq, 3)   # before the image: the offset goes with it
    assert seq.rope_marks == []


# ------------------------------------------------------------------------------------------------ refusals
def test_prompt_and_image_refusals_are_one_line(exports):
    from qeff_kv.errors import RuntimeInputError
    from qeff_kv.runtime import VisionLanguageModel

    model = VisionLanguageModel(exports("llava"))
    cases = [
        (lambda: model.session.generate([llava_prompt()], max_new_tokens=NEW),
         r"^the prompt holds 16 image token\(s\) \(id 120\) but no image was given$"),
        (lambda: model.generate([(llava_prompt(images=2), llava_inputs())], max_new_tokens=NEW),
         r"^the prompt holds 32 image token\(s\) \(id 120\) but its 1 image\(s\) fill 16 \(one token per image row\)$"),
        (lambda: model.images(llava_prompt(), {"pixel_values": np.zeros((1, 3, 16, 16), np.float32)}),
         r"^pixel_values has shape \[1, 3, 16, 16\]; this export takes \[images, 3, 32, 32\]$"),
        (lambda: model.images(llava_prompt(), {"pixel_values": np.zeros((1, 3, 32, 32), np.int64)}),
         r"^pixel_values is int64; expected floats$"),
        # issue 22, class 6: the images axis is not implied, image sizes are integers (never cut from floats)
        (lambda: model.images(llava_prompt(), {"pixel_values": np.zeros((3, 32, 32), np.float32)}),
         r"^pixel_values has shape \[3, 32, 32\]; this export takes \[images, 3, 32, 32\]$"),
        (lambda: model.images(llava_prompt(), {**llava_inputs(), "image_sizes": np.array([[32.0, 32.0]])}),
         r"^image_sizes must be an integer array, got dtype float64$"),
        (lambda: model.images(llava_prompt(), {**llava_inputs(), "pixel_attention_mask": np.ones(3)}),
         r"^image input 'pixel_attention_mask' is not used by this model \(it takes pixel_values\)$"),
        (lambda: model.images(llava_prompt(), {"image_sizes": np.array([[32, 32]])}),
         r"^image inputs have no 'pixel_values' array"),
        (lambda: VisionLanguageModel(exports("llava"), max_sequences=2),
         r"^graph has no batch_index input: max_sequences=2 needs lock-step batching, which is not possible: it is a "
         r"vision-language graph"),
    ]
    for call, message in cases:
        with pytest.raises(RuntimeInputError, match=message):
            call()
    qwen = VisionLanguageModel(exports("qwen"))
    with pytest.raises(RuntimeInputError, match=r"^image_grid_thw \[1, 8, 8\]: this export was traced for image grid "
                                                r"\[1, 4, 4\] \(16x16 images; export again with --image-size"):
        qwen.images(qwen_prompt(), {"pixel_values": qwen_inputs()["pixel_values"], "image_grid_thw": [[1, 8, 8]]})
    with pytest.raises(RuntimeInputError, match=r"^image_grid_thw must be an integer array, got dtype float64$"):
        qwen.images(qwen_prompt(), {"pixel_values": qwen_inputs()["pixel_values"], "image_grid_thw": [[1.0, 4.0, 4.0]]})
    single = VisionLanguageModel(exports("qwen", single=True))
    with pytest.raises(RuntimeInputError, match=r"^a single-layout graph of a patch-row model encodes one image"):
        single.images(qwen_prompt(images=2), qwen_inputs(images=2))
    # refused before anything ran: no sequence was left behind
    assert model.session.sequences == []


def test_graphs_without_our_metadata_need_the_image_token(exports, tmp_path, want):
    """Another exporter's language graph (no manifest, no qeff_kv.vision metadata): the image token is given."""
    from qeff_kv.errors import ContractError, RuntimeInputError
    from qeff_kv.runtime import VisionLanguageModel

    src = exports("llava")
    man = json.loads((src / "manifest.json").read_text())
    m = onnx.load(str(src / man["onnx"]))
    del m.metadata_props[:]
    onnx.save(m, str(tmp_path / "language.onnx"))
    shutil.copy(src / man["vision_onnx"], tmp_path / "language_vision.onnx")
    with pytest.raises(RuntimeInputError, match=r"^vision_embeds graph without qeff-kv's vision metadata or manifest: "
                                                r"give its image token id"):
        VisionLanguageModel(tmp_path / "language.onnx", ctx_len=CTX)
    # the rows per image come from the vision graph's static output
    peer = VisionLanguageModel(tmp_path / "language.onnx", ctx_len=CTX, image_token_id=LLAVA_TOKEN)
    [g] = peer.generate([(llava_prompt(), llava_inputs())], max_new_tokens=NEW)
    assert g.tokens == want["llava"]
    with pytest.raises(ContractError, match=r"a text decoder graph"):
        text = tmp_path / "text"
        text.mkdir()
        from qeff_kv.export import export_model
        from hf_models import make_model_dir

        res = export_model(make_model_dir("llama", tmp_path), text, ctx_len=16, prefill_seq_len=4)
        VisionLanguageModel(res.out_dir)


# ------------------------------------------------------------------------------------------------ CLI
def test_cli_generate_with_image_inputs(exports, want, tmp_path):
    from qeff_kv_cli.main import main

    npz = tmp_path / "image.npz"
    np.savez(npz, **qwen_inputs())
    out = exports("qwen")
    ids = ",".join(map(str, qwen_prompt()))
    r = CliRunner().invoke(main, ["generate", str(out), "--prompt-ids", ids, "--image-inputs", str(npz),
                                  "--max-new-tokens", str(NEW), "--json"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout.splitlines()[-1])
    assert res["sequences"][0]["tokens"] == want["qwen"]
    assert res["timings"]["images"] == 1 and res["timings"]["vision_s"] > 0
    # the processor's own input_ids serve as the prompt
    with_ids = tmp_path / "with_ids.npz"
    np.savez(with_ids, input_ids=np.array([qwen_prompt()]), **qwen_inputs())
    r = CliRunner().invoke(main, ["generate", str(out), "--image-inputs", str(with_ids), "--max-new-tokens", str(NEW),
                                  "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout.splitlines()[-1])["sequences"][0]["tokens"] == want["qwen"]
    # one line, exit 2
    r = CliRunner().invoke(main, ["generate", str(out), "--prompt-ids", "1,5,150,7", "--image-inputs", str(npz)])
    assert r.exit_code == 2
    assert r.stderr.strip().splitlines()[-1] == ("error: an image of grid [1, 4, 4] takes 4 tokens but the prompt has "
                                                 "1 image token(s) there")
    r = CliRunner().invoke(main, ["generate", str(out), "--prompt-ids", ids, "--prompt-ids", ids,
                                  "--image-inputs", str(npz)])
    assert r.exit_code == 2 and r.stderr.strip().splitlines()[-1] == (
        "error: 1 --image-inputs files for 2 prompts; give one per prompt, in order")


# ------------------------------------------------------------------------------------------------ single layout
@pytest.mark.parametrize("name", ["llava", "qwen", "gemma3"])
def test_single_layout_decode_skips_the_vision_encoder(name, exports):
    """On the onnxruntime targets the single graph's encoder sits in an If on image_idx >= 0: with -1 (decode, as
    the runtime feeds it) it does not run, so even pixels it could not encode pass; the portable graph keeps the
    peer's plain form and must encode them."""
    import onnxruntime as ort

    from qeff_kv.graph import graphio

    gated = exports(name, "onnxruntime", single=True)
    plain = exports(name, "portable", single=True)
    out = {}
    for label, folder in (("gated", gated), ("plain", plain)):
        man = json.loads((folder / "manifest.json").read_text())
        model = graphio.load(folder / man["onnx"])
        ops = [n.op_type for n in model.graph]
        out[label] = (model.metadata_props.get("qeff_kv.vision_encoder"), ops.count("If"))
        sess = ort.InferenceSession(str(folder / man["onnx"]), providers=["CPUExecutionProvider"])
        feeds = {}
        for i in sess.get_inputs():
            shape = [1 if isinstance(d, str) else d for d in i.shape]
            if i.name.startswith("past_"):
                shape[2] = man["ctx_len"] if "sliding" not in str(i.shape[2]) else man["sliding_window"]
            feeds[i.name] = np.zeros(shape, np.int64 if "int64" in i.type else np.float32)
        feeds["pixel_values"] = np.zeros((1, 96) if name == "qwen" else (1, 3, 8, 8), np.float32)  # not encodable
        feeds["image_idx"] = np.full((1, 1), -1, np.int64)
        if name == "qwen":
            feeds["position_ids"] = np.zeros((4, 1, 1), np.int64)
        try:
            logits = sess.run(["logits"], feeds)[0]
            out[label] += (bool(np.isfinite(logits).all()),)
        except Exception:   # onnxruntime's error: the encoder ran on pixels it cannot take
            out[label] += (None,)
    assert out["gated"] == ("gated", 1, True)
    assert out["plain"] == (None, 0, None)
