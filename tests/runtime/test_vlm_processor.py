"""Image files + a prompt -> a vision-language export's inputs (``qeff_kv.runtime.multimodal.processor.image_prompt``), with
the processor the exporter copies into the export folder.

The model is the tiny seeded Llava of tests/helpers/hf_models.py with a working ``LlavaProcessor`` (``add_llava_processor``):
one 32x32 image is 16 ``<image>`` tokens (id 120). The reference is transformers' own processor read from the model
folder.
"""

from __future__ import annotations

import importlib.util
import shutil

import numpy as np
import pytest

from suite import requires_torch

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
requires_transformers = pytest.mark.skipif(not HAS_TRANSFORMERS, reason="needs transformers (the [image] extra)")

IMAGE_ROWS = 16
PROMPT = "What is in the picture?"


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    from hf_models import add_llava_processor, make_llava_dir

    model_dir = make_llava_dir(tmp_path_factory.mktemp("llava"))
    add_llava_processor(model_dir)
    return model_dir


@pytest.fixture(scope="module")
def exported(llava, tmp_path_factory):
    from qeff_kv.export import export_model

    return export_model(llava, tmp_path_factory.mktemp("export") / "out", ctx_len=64, prefill_seq_len=8).out_dir


@pytest.fixture(scope="module")
def processor_only(tmp_path_factory):
    """A folder with the processor files alone (no model): enough for ``image_prompt``, and needs no torch."""
    from hf_models import add_llava_processor

    folder = tmp_path_factory.mktemp("processor")
    add_llava_processor(folder)
    return folder


@pytest.fixture(scope="module")
def png(tmp_path_factory):
    from hf_models import write_png

    root = tmp_path_factory.mktemp("images")
    return write_png(root / "photo.png", seed=0), write_png(root / "other.png", seed=1)


def _reference(model_dir, text: str, images):
    import transformers
    from PIL import Image

    # the PIL image processor, as image_prompt uses: with torchvision installed transformers would pick its
    # torchvision backend, whose resampling differs from PIL's by a few levels
    proc = transformers.AutoProcessor.from_pretrained(model_dir, backend="pil")
    return proc, proc(text=[text], images=[Image.open(p).convert("RGB") for p in images], return_tensors="np")


# ---------------------------------------------------------------------------------------------- export
@requires_torch
def test_export_copies_the_processor_files(llava, exported):
    from qeff_kv.export.sources import PROCESSOR_FILES, TOKENIZER_FILES

    assert set(PROCESSOR_FILES) == {"preprocessor_config.json", "processor_config.json"}
    assert {"chat_template.jinja", "chat_template.json"} <= set(TOKENIZER_FILES)
    for name in ("preprocessor_config.json", "processor_config.json", "chat_template.jinja", "tokenizer.json",
                 "tokenizer_config.json"):
        assert (exported / name).is_file(), name
        assert (exported / name).read_bytes() == (llava / name).read_bytes(), name


@requires_torch
def test_plain_prompt_expands_the_image_like_transformers(llava, exported, png):
    from hf_models import LLAVA_IMAGE_TOKEN
    from qeff_kv.runtime.multimodal.processor import image_prompt

    ids, arrays = image_prompt(exported, "a cat", [png[0]])
    assert ids.count(LLAVA_IMAGE_TOKEN) == IMAGE_ROWS
    proc, want = _reference(llava, "<image>a cat", [png[0]])
    assert ids == want["input_ids"][0].tolist()
    assert ids == [1] + [LLAVA_IMAGE_TOKEN] * IMAGE_ROWS + proc.tokenizer.convert_tokens_to_ids(["a", "cat"])
    assert set(arrays) == {"pixel_values"}
    assert arrays["pixel_values"].shape == (1, 3, 32, 32) and arrays["pixel_values"].dtype == np.float32
    np.testing.assert_allclose(arrays["pixel_values"], want["pixel_values"], rtol=0, atol=1e-6)


@requires_torch
def test_chat_prompt_renders_the_template(llava, exported, png):
    from hf_models import LLAVA_IMAGE_TOKEN
    from qeff_kv.runtime.multimodal.processor import image_prompt

    ids, arrays = image_prompt(exported, PROMPT, [png[0]], chat=True, system="be brief")
    assert ids.count(LLAVA_IMAGE_TOKEN) == IMAGE_ROWS
    text = f"system: be brief\nuser: <image>{PROMPT}\nassistant:"
    proc, want = _reference(llava, text, [png[0]])
    assert ids == want["input_ids"][0].tolist()
    decoded = proc.tokenizer.decode(ids)
    assert decoded.startswith("<s> system : be brief user : <image>")
    assert decoded.endswith("What is in the picture ? assistant :")
    np.testing.assert_allclose(arrays["pixel_values"], want["pixel_values"], rtol=0, atol=1e-6)
    # without a system turn
    ids2, _ = image_prompt(exported, PROMPT, [png[0]], chat=True)
    assert proc.tokenizer.decode(ids2).startswith("<s> user : <image>")


@requires_transformers
def test_several_images_in_order(processor_only, png):
    from hf_models import LLAVA_IMAGE_TOKEN
    from qeff_kv.runtime.multimodal.processor import image_prompt

    ids, arrays = image_prompt(processor_only, "a cat", list(png))
    assert ids.count(LLAVA_IMAGE_TOKEN) == 2 * IMAGE_ROWS
    _, want = _reference(processor_only, "<image><image>a cat", png)
    assert arrays["pixel_values"].shape == (2, 3, 32, 32)
    np.testing.assert_allclose(arrays["pixel_values"], want["pixel_values"], rtol=0, atol=1e-6)
    assert not np.allclose(arrays["pixel_values"][0], arrays["pixel_values"][1])
    ids_chat, arrays_chat = image_prompt(processor_only, "a cat", list(png), chat=True)
    assert ids_chat.count(LLAVA_IMAGE_TOKEN) == 2 * IMAGE_ROWS
    np.testing.assert_array_equal(arrays_chat["pixel_values"], arrays["pixel_values"])


@requires_transformers
def test_image_processor_nested_in_processor_config(processor_only, png, tmp_path):
    """transformers 5 saves the image processor inside processor_config.json, without preprocessor_config.json."""
    from qeff_kv.runtime.multimodal.processor import image_prompt

    folder = tmp_path / "nested"
    shutil.copytree(processor_only, folder)
    (folder / "preprocessor_config.json").unlink()
    ids, arrays = image_prompt(folder, "a cat", [png[0]])
    want_ids, want = image_prompt(processor_only, "a cat", [png[0]])
    assert ids == want_ids and set(arrays) == set(want) == {"pixel_values"}
    np.testing.assert_array_equal(arrays["pixel_values"], want["pixel_values"])


# -------------------------------------------------------------------------------------------- refusals
@requires_transformers
def test_missing_or_unreadable_image_is_one_line(processor_only, tmp_path):
    from qeff_kv.errors import RuntimeInputError
    from qeff_kv.runtime.multimodal.processor import image_prompt

    missing = tmp_path / "nope.png"
    with pytest.raises(RuntimeInputError) as exc:
        image_prompt(processor_only, "a cat", [missing])
    assert str(exc.value) == f"image {missing}: no such file"
    bad = tmp_path / "bad.png"
    bad.write_text("not an image\n")
    with pytest.raises(RuntimeInputError) as exc:
        image_prompt(processor_only, "a cat", [bad])
    assert str(exc.value).startswith(f"image {bad}: cannot read it as an image (")
    assert "\n" not in str(exc.value)


@requires_transformers
def test_folder_without_image_processor(processor_only, png, tmp_path):
    from qeff_kv.errors import RuntimeInputError
    from qeff_kv.runtime.multimodal.processor import image_prompt

    folder = tmp_path / "text-only"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(processor_only / name, folder / name)
    with pytest.raises(RuntimeInputError) as exc:
        image_prompt(folder, "a cat", [png[0]])
    assert str(exc.value) == (f"{folder}: no image processor (preprocessor_config.json is missing); "
                              f"give the image arrays with --image-inputs FILE.npz")


@requires_transformers
def test_other_refusals_are_one_line(processor_only, png):
    from qeff_kv.errors import RuntimeInputError
    from qeff_kv.runtime.multimodal.processor import image_prompt

    with pytest.raises(RuntimeInputError, match="^no image given$"):
        image_prompt(processor_only, "a cat", [])
    with pytest.raises(RuntimeInputError, match=r"^a system prompt needs the chat template \(--chat\)$"):
        image_prompt(processor_only, "a cat", [png[0]], system="be brief")
    # an extra placeholder in the text: the processor refuses (more image tokens than images)
    with pytest.raises(RuntimeInputError) as exc:
        image_prompt(processor_only, "<image> a cat", [png[0]])
    assert str(exc.value).startswith(f"{processor_only}: the processor failed on the prompt and images (")
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize("hidden", ["transformers", "PIL"])
def test_missing_dependency(hidden, monkeypatch, tmp_path):
    from qeff_kv.errors import MissingDependencyError
    from qeff_kv.runtime.multimodal.processor import image_prompt

    monkeypatch.setitem(__import__("sys").modules, hidden, None)
    with pytest.raises(MissingDependencyError) as exc:
        image_prompt(tmp_path, "a cat", [tmp_path / "photo.png"])
    assert str(exc.value) == ("--image needs transformers and Pillow (pip install 'qeff-kv[image]'); "
                              "or give --image-inputs FILE.npz")


# ---------------------------------------------------------------------------------------------- the CLI
@requires_torch
def test_cli_generate_with_an_image_file(llava, exported, png):
    """``qeff-kv generate out/ --image photo.png --prompt ... --chat``: the export's processor, then the runtime;
    the tokens equal transformers' generate on the processor's own inputs."""
    import json

    import torch
    import transformers
    from click.testing import CliRunner

    from qeff_kv_cli.main import main

    r = CliRunner().invoke(main, ["generate", str(exported), "--image", str(png[0]), "--prompt", PROMPT, "--chat",
                                  "--max-new-tokens", "8", "--ignore-eos", "--json"])
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout.splitlines()[-1])
    _, inputs = _reference(llava, f"user: <image>{PROMPT}\nassistant:", [png[0]])
    model = transformers.AutoModelForImageTextToText.from_pretrained(llava, dtype=torch.float32,
                                                                     attn_implementation="eager").eval()
    ids = torch.from_numpy(inputs["input_ids"])
    with torch.no_grad():
        out = model.generate(ids, pixel_values=torch.from_numpy(inputs["pixel_values"]),
                             attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    want = out[0, ids.shape[1]:].tolist()
    assert len(set(want)) > 1
    assert got["sequences"][0]["tokens"] == want
    assert got["sequences"][0]["prompt_tokens"] == ids.shape[1]
    assert got["timings"]["images"] == 1
    # --image takes one --prompt and nothing else: one line, exit 2
    r = CliRunner().invoke(main, ["generate", str(exported), "--image", str(png[0]), "--prompt-ids", "1,2"])
    assert r.exit_code == 2 and r.stderr.strip().splitlines()[-1].startswith(
        "error: --image goes with exactly one --prompt")


@requires_torch
def test_cli_generate_resizes_to_the_patch_grid_of_the_export(tmp_path_factory, png):
    """Qwen2.5-VL: the export is traced for one grid (16x16 images); a 48x40 photo is resized to it (and said so),
    and its processor works without torchvision (image processor + tokenizer; the placeholder expanded here). The
    tokens equal transformers' generate on the same resized image."""
    import json

    import torch
    import transformers
    from click.testing import CliRunner
    from PIL import Image

    from hf_models import QWEN_IMAGE_TOKEN, add_qwen25vl_processor, make_qwen25vl_dir
    from qeff_kv.export import export_model
    from qeff_kv.runtime.multimodal.processor import image_prompt
    from qeff_kv_cli.main import main

    model_dir = make_qwen25vl_dir(tmp_path_factory.mktemp("qwen"))
    add_qwen25vl_processor(model_dir)
    out = export_model(model_dir, tmp_path_factory.mktemp("qwen_export") / "out", ctx_len=48, prefill_seq_len=4,
                       image_size=16).out_dir
    vision = json.loads((out / "manifest.json").read_text())["vision"]
    ids, arrays = image_prompt(out, "w9 w10", [png[0]], image_size=16, vision=vision)
    assert ids == [148] + [QWEN_IMAGE_TOKEN] * 4 + [149, 9, 10]
    assert arrays["image_grid_thw"].tolist() == [[1, 4, 4]] and arrays["pixel_values"].shape == (16, 96)
    ip = transformers.AutoImageProcessor.from_pretrained(model_dir, backend="pil")
    resized = Image.open(png[0]).convert("RGB").resize((16, 16), Image.BICUBIC)
    want_arrays = ip(images=[resized], return_tensors="np")
    np.testing.assert_allclose(arrays["pixel_values"], want_arrays["pixel_values"], rtol=0, atol=1e-6)
    _, unresized = image_prompt(out, "w9 w10", [png[0]], vision=vision)
    assert unresized["image_grid_thw"].tolist() != [[1, 4, 4]]   # why the resize: the photo's own grid

    r = CliRunner().invoke(main, ["generate", str(out), "--image", str(png[0]), "--prompt", "w9 w10", "--chat",
                                  "--max-new-tokens", "8", "--ignore-eos", "--json"])
    assert r.exit_code == 0, r.output
    assert f"resized {png[0]} 48x40 -> 16x16 (the export's fixed image size)" in r.stderr
    got = json.loads(r.stdout.splitlines()[-1])
    chat_ids = [QWEN_WORDS_ID["user"], QWEN_WORDS_ID[":"], 148] + [QWEN_IMAGE_TOKEN] * 4 + [149, 9, 10,
                                                                                              QWEN_WORDS_ID["assistant"],
                                                                                              QWEN_WORDS_ID[":"]]
    assert got["resized_images"] == [{"image": str(png[0]), "from": [48, 40], "to": [16, 16]}]
    model = transformers.AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32,
                                                                     attn_implementation="eager").eval()
    t = torch.tensor([chat_ids])
    with torch.no_grad():
        gen = model.generate(t, pixel_values=torch.from_numpy(want_arrays["pixel_values"]),
                             image_grid_thw=torch.tensor([[1, 4, 4]]), mm_token_type_ids=(t == QWEN_IMAGE_TOKEN).long(),
                             attention_mask=torch.ones_like(t), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    assert got["sequences"][0]["prompt_tokens"] == len(chat_ids)
    assert got["sequences"][0]["tokens"] == gen[0, len(chat_ids):].tolist()


#: hf_models.add_qwen25vl_processor: its words take the free ids from 4 up
QWEN_WORDS_ID = {"user": 4, "assistant": 5, "system": 6, ":": 7}


# ------------------------------------------------------------------- Qwen2.5-VL: one patch grid per export
QWEN_VISION = {"image_token_id": 150}   # the export manifest's vision facts image_prompt falls back on


@pytest.fixture(scope="module")
def qwen_processor(tmp_path_factory):
    """The processor files of a tiny Qwen2.5-VL alone (no model, no torch): patch 4, merge 2, 64..4096 pixels."""
    from hf_models import add_qwen25vl_processor

    folder = tmp_path_factory.mktemp("qwen_processor")
    add_qwen25vl_processor(folder)
    return folder


def _qwen_reference(folder, image, side: int, **kwargs):
    """transformers' Qwen2-VL image processor (PIL) on ``image`` resized to ``side x side`` (PIL, bicubic)."""
    import transformers
    from PIL import Image

    ip = transformers.AutoImageProcessor.from_pretrained(folder, backend="pil")
    resized = Image.open(image).convert("RGB").resize((side, side), Image.BICUBIC)
    return ip(images=[resized], return_tensors="np", **kwargs)


@requires_transformers
def test_qwen_image_size_gives_the_traced_grid(qwen_processor, png):
    """A 48x40 photo, resized to the export's 16x16: a 1x4x4 patch grid, 4 image tokens between vision start/end,
    the same arrays as transformers' image processor on the photo resized alike."""
    from hf_models import QWEN_IMAGE_TOKEN
    from qeff_kv.runtime.multimodal.processor import image_prompt

    ids, arrays = image_prompt(qwen_processor, "w9 w10", [png[0]], image_size=16, vision=QWEN_VISION)
    assert ids == [148] + [QWEN_IMAGE_TOKEN] * 4 + [149, 9, 10]
    assert set(arrays) == {"pixel_values", "image_grid_thw"}
    assert arrays["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert arrays["pixel_values"].shape == (16, 96) and arrays["pixel_values"].dtype == np.float32
    want = _qwen_reference(qwen_processor, png[0], 16)
    np.testing.assert_array_equal(arrays["image_grid_thw"], want["image_grid_thw"])
    np.testing.assert_allclose(arrays["pixel_values"], want["pixel_values"], rtol=0, atol=1e-6)
    # through the chat template: the same image tokens, inside the user turn
    ids_chat, arrays_chat = image_prompt(qwen_processor, "w9 w10", [png[0]], chat=True, image_size=16,
                                         vision=QWEN_VISION)
    w = QWEN_WORDS_ID
    assert ids_chat == [w["user"], w[":"], 148] + [QWEN_IMAGE_TOKEN] * 4 + [149, 9, 10, w["assistant"], w[":"]]
    np.testing.assert_array_equal(arrays_chat["pixel_values"], arrays["pixel_values"])
    # two photos: one grid each
    ids2, arrays2 = image_prompt(qwen_processor, "w9", list(png), image_size=16, vision=QWEN_VISION)
    assert ids2 == ([148] + [QWEN_IMAGE_TOKEN] * 4 + [149]) * 2 + [9]
    assert arrays2["image_grid_thw"].tolist() == [[1, 4, 4]] * 2 and arrays2["pixel_values"].shape == (32, 96)


@requires_transformers
def test_qwen_without_image_size_the_photo_keeps_its_own_grid(qwen_processor, png):
    """Why the resize: the Qwen2-VL image processor picks the grid from the photo's size (48x40 -> 1x10x12), not
    the grid the export was traced for."""
    from hf_models import QWEN_IMAGE_TOKEN
    from qeff_kv.runtime.multimodal.processor import image_prompt

    ids, arrays = image_prompt(qwen_processor, "w9 w10", [png[0]], vision=QWEN_VISION)
    assert arrays["image_grid_thw"].tolist() == [[1, 10, 12]] != [[1, 4, 4]]
    assert arrays["pixel_values"].shape == (120, 96)
    assert ids == [148] + [QWEN_IMAGE_TOKEN] * 30 + [149, 9, 10]


@requires_transformers
def test_image_size_overrides_the_processors_pixel_bounds(qwen_processor, png, tmp_path):
    """A processor whose least pixel count exceeds image_size^2 would scale the 16x16 image up (to 32x32, a 1x8x8
    grid): image_prompt asks it for exactly image_size^2 pixels."""
    import json

    import transformers

    from qeff_kv.runtime.multimodal.processor import exact_size_kwargs, image_prompt

    folder = tmp_path / "min1024"
    shutil.copytree(qwen_processor, folder)
    cfg = json.loads((folder / "preprocessor_config.json").read_text())
    cfg["size"]["shortest_edge"] = 1024
    (folder / "preprocessor_config.json").write_text(json.dumps(cfg))
    assert _qwen_reference(folder, png[0], 16)["image_grid_thw"].tolist() == [[1, 8, 8]]
    ids, arrays = image_prompt(folder, "w9", [png[0]], image_size=16, vision=QWEN_VISION)
    assert arrays["image_grid_thw"].tolist() == [[1, 4, 4]] and ids.count(150) == 4
    exact = {"size": {"shortest_edge": 256, "longest_edge": 256}}
    want = _qwen_reference(folder, png[0], 16, **exact)
    np.testing.assert_allclose(arrays["pixel_values"], want["pixel_values"], rtol=0, atol=1e-6)
    # the kwargs: pixel bounds for a Qwen2-VL image processor only; a real one at 448 (patch 14) keeps 1x32x32
    ip = transformers.AutoImageProcessor.from_pretrained(folder, backend="pil")
    assert exact_size_kwargs(ip, 16) == exact and exact_size_kwargs(ip, None) == {}
    assert exact_size_kwargs(transformers.CLIPImageProcessorPil(), 16) == {}
    assert exact_size_kwargs(transformers.Qwen2VLImageProcessorPil(), 448) == {
        "size": {"shortest_edge": 448 * 448, "longest_edge": 448 * 448}}


@requires_transformers
def test_image_size_on_a_fixed_size_processor(processor_only, png):
    """Llava's CLIP processor has no pixel bounds: image_size only resizes the image first (to 32x32, the size it
    crops to, so the arrays are the processor's on the resized image)."""
    from hf_models import LLAVA_IMAGE_TOKEN
    from qeff_kv.runtime.multimodal.processor import image_prompt

    ids, arrays = image_prompt(processor_only, "a cat", [png[0]], image_size=32)
    assert ids.count(LLAVA_IMAGE_TOKEN) == IMAGE_ROWS and arrays["pixel_values"].shape == (1, 3, 32, 32)
    import transformers
    from PIL import Image

    proc = transformers.AutoProcessor.from_pretrained(processor_only, backend="pil")
    resized = Image.open(png[0]).convert("RGB").resize((32, 32), Image.BICUBIC)
    want = proc(text=["<image>a cat"], images=[resized], return_tensors="np")
    assert ids == want["input_ids"][0].tolist()
    np.testing.assert_allclose(arrays["pixel_values"], want["pixel_values"], rtol=0, atol=1e-6)


@requires_transformers
def test_image_sizes_of(png, tmp_path):
    from hf_models import write_png
    from qeff_kv.errors import RuntimeInputError
    from qeff_kv.runtime.multimodal.processor import image_sizes_of

    small = write_png(tmp_path / "small.png", size=(16, 24))
    assert image_sizes_of([png[0], small]) == [(48, 40), (16, 24)]
    assert image_sizes_of([]) == []
    missing = tmp_path / "nope.png"
    with pytest.raises(RuntimeInputError) as exc:
        image_sizes_of([png[0], missing])
    assert str(exc.value) == f"image {missing}: no such file"
    bad = tmp_path / "bad.png"
    bad.write_text("not an image\n")
    with pytest.raises(RuntimeInputError) as exc:
        image_sizes_of([bad])
    assert str(exc.value).startswith(f"image {bad}: cannot read it as an image (") and "\n" not in str(exc.value)
