"""Vision-language export (contract section 6, issue 10): Llava in the dual layout (vision graph + language
graph) and the single layout, on every target, with the prefix on the language KV only; greedy tokens equal to
transformers' ``generate`` with the image, the image split across prefill chunks.

The model is a tiny seeded Llava (tests/helpers/hf_models.py ``make_llava_dir``): 16 image rows per 32x32 image.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from suite import requires_torch

pytestmark = [requires_torch]

CTX, CHUNK, NEW = 48, 4, 8
TARGETS = ("portable", "onnxruntime", "onnxruntime-fused")


def _prompt(image_token: int) -> list[int]:
    # 3 text tokens, the 16 image tokens (straddling chunks of 4 at 3..18), then text
    return [1, 5, 6] + [image_token] * 16 + [7, 8, 9, 40, 41]


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    from hf_models import make_llava_dir

    return make_llava_dir(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="module")
def llava_exports(llava, tmp_path_factory):
    from qeff_kv.export import export_model

    root = tmp_path_factory.mktemp("llava_exports")
    cache: dict = {}

    def get(target: str, single: bool):
        key = (target, single)
        if key not in cache:
            cache[key] = export_model(llava, root / f"{target}-{'single' if single else 'dual'}", ctx_len=CTX,
                                      prefill_seq_len=CHUNK, target=target, single_graph=single,
                                      kv_cache_prefix="VLLM")
        return cache[key]

    return get


@pytest.fixture(scope="module")
def reference(llava):
    from hf_models import LLAVA_IMAGE_TOKEN, hf_vlm_greedy, llava_image

    want = hf_vlm_greedy(llava, _prompt(LLAVA_IMAGE_TOKEN), llava_image(), NEW)
    assert len(set(want)) > 1, "greedy tokens do not vary: the parity proves little"
    other = hf_vlm_greedy(llava, _prompt(LLAVA_IMAGE_TOKEN), llava_image(seed=5), NEW)
    assert other != want, "the image does not change the tokens: the parity proves little"
    return want


@pytest.mark.parametrize("single", [False, True], ids=["dual", "single"])
@pytest.mark.parametrize("target", TARGETS)
def test_llava_parity_with_the_image(target, single, llava_exports, reference):
    from hf_models import LLAVA_IMAGE_TOKEN, PlainLoop, llava_image

    res = llava_exports(target, single)
    assert res.manifest["verification"]["status"] == "passed"
    vision = None if single else res.out_dir / res.manifest["vision_onnx"]
    loop = PlainLoop(res.onnx_path, CTX).with_image(llava_image(), vision)
    assert loop.greedy(_prompt(LLAVA_IMAGE_TOKEN), NEW, CHUNK) == reference


def _io(path) -> tuple[list[str], list[str]]:
    m = onnx.load(str(path), load_external_data=False)
    return [i.name for i in m.graph.input], [o.name for o in m.graph.output]


def test_dual_layout_names_and_manifest(llava_exports):
    res = llava_exports("portable", False)
    ins, outs = _io(res.onnx_path)
    kv_in = [f"past_{k}.{i}_VLLM" for i in range(2) for k in ("key", "value")]
    assert ins == ["input_ids", "vision_embeds", "position_ids", "image_idx", *kv_in]
    assert outs == ["logits", "vision_embeds_RetainedState", "image_idx_output",
                    *[n + "_RetainedState" for n in kv_in]]
    man = res.manifest
    assert (man["layout"], man["onnx"], man["vision_onnx"]) == ("dual", "tiny-llava.onnx", "tiny-llava_vision.onnx")
    assert man["image_token_id"] == 120
    assert man["vision"] == {"image_size": 32, "channels": 3, "vision_size": 16, "hidden_size": 64,
                             "image_token_id": 120}
    meta = {p.key: p.value for p in onnx.load(str(res.onnx_path), load_external_data=False).metadata_props}
    assert json.loads(meta["qeff_kv.vision"]) == man["vision"]   # a bare .onnx carries what the runtime needs
    vin, vout = _io(res.out_dir / man["vision_onnx"])
    assert (vin, vout) == (["pixel_values"], ["vision_embeds"])
    vm = onnx.load(str(res.out_dir / man["vision_onnx"]), load_external_data=False)
    assert [d.dim_param or d.dim_value for d in vm.graph.output[0].type.tensor_type.shape.dim] == ["batch_size", 16, 64]
    assert {p.name for p in res.files} >= {"tiny-llava.onnx", "tiny-llava_vision.onnx", "custom_io_vision.yaml",
                                           "specializations_vision.json", "manifest.json"}
    m = onnx.load(str(res.onnx_path), load_external_data=False)
    dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in list(m.graph.input) + list(m.graph.output)}
    assert dims["vision_embeds"] == dims["vision_embeds_RetainedState"] == ["vision_batch_size", "vision_size", 64]
    assert dims["image_idx"] == [1, 1]


def test_single_layout_names(llava_exports):
    res = llava_exports("portable", True)
    ins, outs = _io(res.onnx_path)
    assert ins[:4] == ["input_ids", "position_ids", "pixel_values", "image_idx"]
    assert outs[:3] == ["logits", "pixel_values_RetainedState", "image_idx_output"]
    assert res.manifest["layout"] == "single" and res.manifest["vision_onnx"] is None
    assert not (res.out_dir / "tiny-llava_vision.onnx").exists()


@pytest.mark.parametrize("single", [False, True], ids=["dual", "single"])
def test_prefix_only_on_language_kv_and_check_passes(single, llava_exports):
    from qeff_kv.contract import naming
    from qeff_kv.tools.check import check

    res = llava_exports("onnxruntime", single)
    ins, outs = _io(res.onnx_path)
    selected = naming.select(".*VLLM.*", ins + outs)
    assert selected == [n for n in ins + outs if n.startswith("past_")]
    report = check(res.onnx_path)
    assert report.ok, report.format_text()


def test_verification_uses_the_image(llava, tmp_path, monkeypatch):
    """A language graph that ignores the image rows is refused at export."""
    from qeff_kv.errors import VerificationError
    from qeff_kv.export import export_model
    from qeff_kv.export.modeling import vlm

    monkeypatch.setattr(vlm, "merge_image_rows",
                        lambda text, ids, pos, rows, idx, tok: (text, idx))
    with pytest.raises(VerificationError, match="^verification failed after "):
        export_model(llava, tmp_path / "o", ctx_len=CTX, prefill_seq_len=CHUNK)
    assert not (tmp_path / "o" / "manifest.json").exists()


def test_vlm_refusals_are_one_line(llava, tmp_path):
    from qeff_kv.errors import ExportError
    from qeff_kv.export import export_model

    with pytest.raises(ExportError, match="^--weights is not supported for vision-language exports yet$"):
        export_model(llava, tmp_path / "o", ctx_len=CTX, prefill_seq_len=CHUNK, target="onnxruntime",
                     weights="int4")
    with pytest.raises(ExportError, match=r"^ctx_len 16 cannot hold one image \(16 image tokens\)"):
        export_model(llava, tmp_path / "o", ctx_len=16, prefill_seq_len=CHUNK)
    assert not (tmp_path / "o").exists()
    assert json.loads((llava / "config.json").read_text())["image_token_index"] == 120   # the input is untouched



def test_an_image_encoder_that_does_not_run_is_one_line(llava, tmp_path, monkeypatch):
    """A vision-language class without get_image_features, or whose get_image_features fails on one image of
    the configured size (the family matrix met 18 such wrappers: idefics2, llava_next...): a one-line ExportError
    naming the class, not the encoder's traceback; nothing written."""
    import transformers
    from qeff_kv.errors import ExportError
    from qeff_kv.export import export_model

    cls = transformers.LlavaForConditionalGeneration

    def broken(self, pixel_values, **kw):
        raise ValueError("not enough values to unpack (expected 5, got 4)\nsecond line")

    monkeypatch.setattr(cls, "get_image_features", broken)
    with pytest.raises(ExportError) as err:
        export_model(llava, tmp_path / "o", ctx_len=CTX, prefill_seq_len=CHUNK)
    assert str(err.value) == ("LlavaForConditionalGeneration's image encoder does not run on one image of its "
                              "configured size through get_image_features: ValueError: not enough values to unpack "
                              "(expected 5, got 4)")
    monkeypatch.setattr(cls, "get_image_features", None)
    with pytest.raises(ExportError, match=r"^LlavaForConditionalGeneration has no get_image_features \(its images "
                                          r"reach the language model another way\); qeff-kv does not export its "
                                          r"vision side$"):
        export_model(llava, tmp_path / "o", ctx_len=CTX, prefill_seq_len=CHUNK)
    assert not (tmp_path / "o").exists()

# --- Gemma3: sliding layers (ring buffers) and bidirectional attention within each image ----------------------

G3_CTX, G3_CHUNK = 48, 16


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    from hf_models import make_gemma3_vlm_dir

    return make_gemma3_vlm_dir(tmp_path_factory.mktemp("gemma3"))


def _g3_prompt(tok: int) -> list[int]:
    # 5 text tokens, the 16-token image (a chunk of its own: chunks never split an image), 20 more: 41 positions,
    # past the sliding window of 24, so layer 0's ring wraps
    return [1, 5, 6, 7, 8] + [tok] * 16 + [int(t) for t in np.random.default_rng(3).integers(3, 110, size=20)]


@pytest.mark.parametrize("single", [False, True], ids=["dual", "single"])
@pytest.mark.parametrize("target", ["portable", "onnxruntime"])
def test_gemma3_parity_with_bidirectional_images(target, single, gemma3, tmp_path):
    from hf_models import LLAVA_IMAGE_TOKEN, PlainLoop, hf_vlm_greedy, llava_image
    from qeff_kv.contract.chunking import plan_chunks
    from qeff_kv.export import export_model

    res = export_model(gemma3, tmp_path / "o", ctx_len=G3_CTX, prefill_seq_len=G3_CHUNK, target=target,
                       single_graph=single)
    assert res.manifest["sliding_cache"] == "ring" and res.manifest["verification"]["status"] == "passed"
    prompt = _g3_prompt(LLAVA_IMAGE_TOKEN)
    want = hf_vlm_greedy(gemma3, prompt, llava_image(), 6)
    assert len(set(want)) > 1
    loop = PlainLoop(res.onnx_path, G3_CTX).with_image(
        llava_image(), None if single else res.out_dir / res.manifest["vision_onnx"])
    logits = None
    for off, n in plan_chunks(prompt, G3_CHUNK, run_token=LLAVA_IMAGE_TOKEN, keep_runs_whole=True):
        part = prompt[off:off + n]
        ids = np.array([part + [0] * (G3_CHUNK - n)])
        pos = np.array([list(range(off, off + n)) + [-1] * (G3_CHUNK - n)])
        logits = loop.step(ids, pos)
    toks, p = [int(logits[0, -1].argmax())], len(prompt)
    while len(toks) < 6:
        toks.append(int(loop.step(np.array([[toks[-1]]]), np.array([[p]]))[0, -1].argmax()))
        p += 1
    assert toks == want


def test_gemma3_verification_needs_the_bidirectional_mask(gemma3, tmp_path, monkeypatch):
    from qeff_kv.errors import VerificationError
    from qeff_kv.export import export_model
    from qeff_kv.export.modeling import vlm

    monkeypatch.setattr(vlm, "image_blocks", lambda ids, pos, tok: None)   # a causal mask only
    with pytest.raises(VerificationError, match="^verification failed after "):
        export_model(gemma3, tmp_path / "o", ctx_len=G3_CTX, prefill_seq_len=G3_CHUNK)


def test_gemma3_refusals(gemma3, tmp_path):
    from qeff_kv.errors import ExportError
    from qeff_kv.export import export_model

    with pytest.raises(ExportError, match=r"^Gemma3ForConditionalGeneration's 16 image tokens attend to each other "
                                          r"both ways, so one prefill chunk must hold a whole image; use "
                                          r"--prefill-seq-len 16 or more$"):
        export_model(gemma3, tmp_path / "o", ctx_len=G3_CTX, prefill_seq_len=8)
    with pytest.raises(ExportError, match=r"^--target onnxruntime-fused cannot express "
                                          r"Gemma3ForConditionalGeneration's attention within an image both ways"):
        export_model(gemma3, tmp_path / "o", ctx_len=G3_CTX, prefill_seq_len=G3_CHUNK, target="onnxruntime-fused")
    assert not (tmp_path / "o").exists()


# --- Qwen2.5-VL: patch rows of a fixed grid, multimodal RoPE positions [4, batch, seq_len] --------------------

Q_GRID = [1, 4, 4]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    from hf_models import make_qwen25vl_dir

    return make_qwen25vl_dir(tmp_path_factory.mktemp("qwen25vl"))


def _q_prompt(tok: int) -> list[int]:
    # text, <vision_start>, the 4 image tokens (straddling chunks of 4 at 3..6), <vision_end>, text
    return [1, 5, 148] + [tok] * 4 + [149, 7, 8, 9, 20, 33]


def _mrope_greedy(loop, prompt, image_token, new, chunk):
    from qeff_kv.contract.mrope import graph_positions, prompt_positions

    rows, delta = prompt_positions(prompt, image_token, [Q_GRID], 2)
    logits = None
    for off in range(0, len(prompt), chunk):
        part = prompt[off:off + chunk]
        n = len(part)
        pos = graph_positions(list(range(off, off + n)) + [-1] * (chunk - n), rows[:, off:off + n])
        logits = loop.step(np.array([part + [0] * (chunk - n)]), pos)
    toks, p = [int(logits[0, -1].argmax())], len(prompt)
    while len(toks) < new:
        pos = graph_positions([p], np.full((3, 1), p + delta))
        toks.append(int(loop.step(np.array([[toks[-1]]]), pos)[0, -1].argmax()))
        p += 1
    return toks


@pytest.mark.parametrize("single", [False, True], ids=["dual", "single"])
@pytest.mark.parametrize("target", TARGETS)
def test_qwen25vl_parity_with_multimodal_rope(target, single, qwen, tmp_path):
    from hf_models import QWEN_IMAGE_TOKEN, PlainLoop, hf_vlm_greedy, qwen_patches
    from qeff_kv.export import export_model

    res = export_model(qwen, tmp_path / "o", ctx_len=CTX, prefill_seq_len=CHUNK, target=target, single_graph=single,
                       image_size=16)
    man = res.manifest
    assert man["verification"]["status"] == "passed"
    assert man["vision"] == {"image_size": 16, "channels": 3, "grid": Q_GRID, "patch_dim": 96, "image_token_id": 150,
                             "spatial_merge_size": 2, "vision_size": 4, "hidden_size": 64}
    ins, _ = _io(res.onnx_path)
    assert "image_grid_thw" not in ins   # the grid is fixed in the graph
    m = onnx.load(str(res.onnx_path), load_external_data=False)
    pos = next(i for i in m.graph.input if i.name == "position_ids")
    assert [d.dim_param or d.dim_value for d in pos.type.tensor_type.shape.dim] == [4, "batch_size", "seq_len"]
    prompt = _q_prompt(QWEN_IMAGE_TOKEN)
    want = hf_vlm_greedy(qwen, prompt, qwen_patches(), NEW, Q_GRID)
    loop = PlainLoop(res.onnx_path, CTX).with_image(
        qwen_patches(), None if single else res.out_dir / man["vision_onnx"])
    assert _mrope_greedy(loop, prompt, QWEN_IMAGE_TOKEN, NEW, CHUNK) == want


def test_qwen25vl_verification_needs_the_multimodal_rows(qwen, tmp_path, monkeypatch):
    """Text positions on every RoPE row (what a runner unaware of multimodal RoPE would feed) fail verification."""
    from qeff_kv.contract import mrope
    from qeff_kv.errors import VerificationError
    from qeff_kv.export import export_model

    monkeypatch.setattr(mrope, "prompt_positions",
                        lambda tokens, tok, grids, merge: (np.tile(np.arange(len(tokens)), (3, 1)), 0))
    with pytest.raises(VerificationError, match="^verification failed after "):
        export_model(qwen, tmp_path / "o", ctx_len=CTX, prefill_seq_len=CHUNK, image_size=16)


def test_qwen25vl_image_size_must_fit_the_patch_grid(qwen, tmp_path):
    from qeff_kv.errors import ExportError
    from qeff_kv.export import export_model

    with pytest.raises(ExportError, match=r"^--image-size 12 is not a multiple of patch_size x spatial_merge_size "
                                          r"\(4 x 2\)"):
        export_model(qwen, tmp_path / "o", ctx_len=CTX, prefill_seq_len=CHUNK, image_size=12)


# --- Exaone4.5: Qwen2.5-VL's patch rows, 1-D positions of its exaone4 text model (sliding rings) -------------------

@pytest.fixture(scope="module")
def exaone45(tmp_path_factory):
    from hf_models import make_exaone45_dir

    return make_exaone45_dir(tmp_path_factory.mktemp("exaone45"))


EXAONE45_PROMPT = [1, 5, 6] + [150] * 4 + [7, 8, 9, 20, 33, 41, 42]   # 150: the image token


@pytest.fixture(scope="module")
def exaone45_refs(exaone45):
    from hf_models import hf_vlm_greedy, qwen_patches

    refs = [hf_vlm_greedy(exaone45, EXAONE45_PROMPT, qwen_patches(seed), NEW, Q_GRID) for seed in (0, 3)]
    assert refs[0] != refs[1] and len(set(refs[0])) > 1   # the image and the tokens matter
    return refs


@pytest.mark.parametrize("target", TARGETS)
def test_exaone45_exports_its_exaone4_text_model_with_the_image(target, exaone45, exaone45_refs, tmp_path):
    """Exaone4.5 (no causal-LM mapping: image-text-to-text only) exports like Qwen2.5-VL's patch rows of one grid,
    but its exaone4 text model takes 1-D positions (no multimodal RoPE rows: verification feeds none); greedy tokens
    with the image equal transformers' on two images, the image straddling chunks, the sliding layers' window (6)
    wrapping in the prompt."""
    from hf_models import PlainLoop, qwen_patches
    from qeff_kv.export import export_model

    res = export_model(exaone45, tmp_path / "o", ctx_len=CTX, prefill_seq_len=CHUNK, target=target, image_size=16)
    man = res.manifest
    assert man["verification"]["status"] == "passed"
    assert man["vision"]["grid"] == Q_GRID and man["vision"]["vision_size"] == 4
    m = onnx.load(str(res.onnx_path), load_external_data=False)
    pos = next(i for i in m.graph.input if i.name == "position_ids")
    assert [d.dim_param or d.dim_value for d in pos.type.tensor_type.shape.dim] == ["batch_size", "seq_len"]
    got = [PlainLoop(res.onnx_path, CTX).with_image(qwen_patches(seed), res.out_dir / man["vision_onnx"])
           .greedy(EXAONE45_PROMPT, NEW, CHUNK) for seed in (0, 3)]
    assert got == exaone45_refs


# --- InternVL (pixel-shuffled rows) and Mistral3 (Pixtral encoder taking image_sizes): 4 rows per image --------

@pytest.mark.parametrize("single", [False, True], ids=["dual", "single"])
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("maker", ["make_internvl_dir", "make_mistral3_dir"])
def test_more_architectures_parity(maker, target, single, tmp_path_factory):
    import hf_models
    from hf_models import QWEN_IMAGE_TOKEN, PlainLoop, hf_vlm_greedy, llava_image
    from qeff_kv.export import export_model

    model = _built(maker, tmp_path_factory)
    res = export_model(model, tmp_path_factory.mktemp("o") / "o", ctx_len=CTX, prefill_seq_len=CHUNK, target=target,
                       single_graph=single)
    assert res.manifest["verification"]["status"] == "passed" and res.manifest["vision"]["vision_size"] == 4
    prompt = [1, 5, 6] + [QWEN_IMAGE_TOKEN] * 4 + [7, 8, 9, 40, 41]
    want = hf_vlm_greedy(model, prompt, llava_image(), NEW)
    assert want != hf_vlm_greedy(model, prompt, llava_image(seed=5), NEW), "the image does not change the tokens"
    loop = PlainLoop(res.onnx_path, CTX).with_image(
        llava_image(), None if single else res.out_dir / res.manifest["vision_onnx"])
    assert loop.greedy(prompt, NEW, CHUNK) == want
    # and in qeff-kv's runtime (Mistral3's processor also gives image_sizes: accepted when they are the export's)
    from qeff_kv.runtime import VisionLanguageModel

    inputs = {"pixel_values": llava_image()}
    if maker == "make_mistral3_dir":
        inputs["image_sizes"] = np.array([[32, 32]])
    [g] = VisionLanguageModel(res.out_dir).generate([(prompt, inputs)], max_new_tokens=NEW)
    assert g.tokens == want
    del hf_models


_BUILT: dict = {}


def _built(maker: str, factory):
    import hf_models

    if maker not in _BUILT:
        _BUILT[maker] = getattr(hf_models, maker)(factory.mktemp(maker))
    return _BUILT[maker]
