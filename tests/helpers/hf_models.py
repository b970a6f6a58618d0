"""Tiny seeded Hugging Face models of each supported architecture, HF reference generation, and a plain
onnxruntime loop (feed each ``_RetainedState`` output back into its input) to run exported graphs.

torch/transformers are imported inside the functions: importing this module needs neither.
"""

from __future__ import annotations

import inspect

from pathlib import Path

import numpy as np

from qeff_kv.contract import naming
from qeff_kv.contract.layout import KVLayout, TensorInfo, dtype_from_ort

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.15, bos_token_id=1,
              eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)

ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(head_dim=16)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(head_dim=16, sliding_window=4096)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict()),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(sliding_window=None)),
    "granite": ("GraniteConfig", "GraniteForCausalLM",
                dict(embedding_multiplier=2.0, attention_multiplier=0.3, residual_multiplier=0.5,
                     logits_scaling=4.0)),
}


def make_model_dir(arch: str, root: Path, seed: int = 0, **overrides) -> Path:
    """Save a tiny random model of ``arch`` (seeded) with safetensors weights; return its folder.

    ``overrides`` replace entries of the config (e.g. ``vocab_size=256``)."""
    import torch
    import transformers

    cfg_cls, model_cls, extra = ARCHS[arch]
    cfg = getattr(transformers, cfg_cls)(**{**COMMON, **extra, **overrides})
    cfg.architectures = [model_cls]
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(cfg).eval()
    out = root / f"tiny-{arch}"
    model.save_pretrained(out, safe_serialization=True)
    return out


def load_causal_lm(model_dir: Path):
    """The folder's causal LM in fp32 with eager attention: ``AutoModelForCausalLM``, or the class the config's
    ``architectures`` names where transformers maps the type to no causal LM (Mistral4)."""
    import torch
    import transformers

    kw = dict(dtype=torch.float32, attn_implementation="eager")
    try:
        return transformers.AutoModelForCausalLM.from_pretrained(model_dir, **kw).eval()
    except ValueError as exc:
        if "Unrecognized configuration class" not in str(exc):
            raise
        arch = transformers.AutoConfig.from_pretrained(model_dir).architectures[0]
        return getattr(transformers, arch).from_pretrained(model_dir, **kw).eval()


def hf_greedy(model_dir: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens from transformers ``generate`` (eager attention, fp32)."""
    import torch
    import transformers

    model = load_causal_lm(model_dir)
    ids = torch.tensor([prompt], dtype=torch.int64)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def hf_greedy_whole(model_dir: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens from transformers' forward over the whole sequence at every step, without a cache: the
    reference of recurrent and hybrid families (transformers' own cached steps of some of them, Bamba's, do not
    continue the state exactly)."""
    import torch
    import transformers

    model = load_causal_lm(model_dir)
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            seq.append(int(model(torch.tensor([seq]), use_cache=False).logits[0, -1].argmax()))
    return seq[len(prompt):]


class PlainLoop:
    """The simplest correct runner: numpy KV buffers fed back each step (no IOBinding)."""

    def __init__(self, onnx_path: Path | str, ctx_len: int, batch: int = 1):
        import onnxruntime as ort

        self.sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
        ins = [TensorInfo(i.name, dtype_from_ort(i.type), tuple(i.shape)) for i in self.sess.get_inputs()]
        outs = [TensorInfo(o.name, dtype_from_ort(o.type), tuple(o.shape)) for o in self.sess.get_outputs()]
        self.layout = KVLayout.from_io(ins, outs).require_valid()
        self.out_names = [o.name for o in outs]
        self.kv = {}
        # a sliding layer's ring buffer holds `sliding_window` slots (graph metadata), the others ctx_len
        window = self.sess.get_modelmeta().custom_metadata_map.get(naming.SLIDING_WINDOW_META)
        for p in self.layout.pairs:
            shape = [batch if i == 0 else d if isinstance(d, int) else
                     int(window) if d == naming.SLIDING_DIM else ctx_len for i, d in enumerate(p.input.shape)]
            self.kv[p.input_name] = np.zeros(shape, dtype=np.dtype(p.input.dtype))
        self.has_batch_index = any(t.name == "batch_index" for t in ins)

    #: non-KV inputs fed every step (a vision-language graph's image: see :meth:`with_image`)
    extra: dict = {}

    def with_image(self, pixel_values: np.ndarray, vision_onnx: Path | str | None = None) -> "PlainLoop":
        """Feed this vision-language graph an image: ``vision_embeds`` from the vision graph (dual layout) or
        ``pixel_values`` (single), and ``image_idx`` chained from each step's ``image_idx_output``."""
        import onnxruntime as ort

        self.extra = {"image_idx": np.zeros((1, 1), np.int64)}
        if vision_onnx is not None:
            vis = ort.InferenceSession(str(vision_onnx), providers=["CPUExecutionProvider"])
            self.extra["vision_embeds"] = vis.run(None, {"pixel_values": pixel_values})[0]
        else:
            self.extra["pixel_values"] = pixel_values
        return self

    def step(self, ids: np.ndarray, pos: np.ndarray, batch_index: np.ndarray | None = None) -> np.ndarray:
        feeds = {"input_ids": ids.astype(np.int64), "position_ids": pos.astype(np.int64), **self.kv, **self.extra}
        if self.has_batch_index:
            feeds["batch_index"] = batch_index.astype(np.int64)
        out = dict(zip(self.out_names, self.sess.run(None, feeds)))
        for p in self.layout.pairs:
            self.kv[p.input_name] = out[p.output_name]
        if "image_idx" in self.extra:
            self.extra["image_idx"] = out["image_idx_output"]
        return out["logits"]

    def prefill(self, prompt: list[int], chunk: int, slot: int | None = None) -> np.ndarray:
        """Right-padded chunks with position -1 for padding; returns the last chunk's logits."""
        pos = 0
        logits = None
        while pos < len(prompt):
            part = prompt[pos:pos + chunk]
            n = len(part)
            ids = np.array([part + [0] * (chunk - n)])
            pids = np.array([list(range(pos, pos + n)) + [-1] * (chunk - n)])
            bi = None if slot is None else np.array([[slot]])
            logits = self.step(ids, pids, bi)
            pos += n
        return logits

    def greedy(self, prompt: list[int], max_new_tokens: int, chunk: int) -> list[int]:
        logits = self.prefill(prompt, chunk, slot=0 if self.has_batch_index else None)
        assert np.isfinite(logits).all()
        toks = [int(logits[0, -1].argmax())]
        pos = len(prompt)
        while len(toks) < max_new_tokens:
            bi = np.array([[0]]) if self.has_batch_index else None
            logits = self.step(np.array([[toks[-1]]]), np.array([[pos]]), bi)
            toks.append(int(logits[0, -1].argmax()))
            pos += 1
        return toks


# ------------------------------------------------------------------------------------- vision-language
LLAVA_IMAGE_TOKEN = 120


def make_llava_dir(root: Path, seed: int = 0) -> Path:
    """A tiny seeded Llava (CLIP vision 32x32 in 8x8 patches: 16 image rows; Llama text, vocab 128) with
    safetensors weights; its greedy tokens vary with the image."""
    import torch
    import transformers

    vc = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, image_size=32, patch_size=8, projection_dim=32)
    tc = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  max_position_embeddings=128, initializer_range=0.15, bos_token_id=1,
                                  eos_token_id=2, pad_token_id=0)
    cfg = transformers.LlavaConfig(vision_config=vc, text_config=tc, image_token_id=LLAVA_IMAGE_TOKEN,
                                   projector_hidden_act="gelu", vision_feature_select_strategy="default",
                                   vision_feature_layer=-2)
    cfg.architectures = ["LlavaForConditionalGeneration"]
    torch.manual_seed(seed)
    out = root / "tiny-llava"
    transformers.LlavaForConditionalGeneration(cfg).eval().save_pretrained(out, safe_serialization=True)
    return out


#: The tiny Llava tokenizer's words (ids 4...; the rest up to 127 are w<id>, with ``<image>`` at 120).
LLAVA_WORDS = ("user assistant system : ? . , ! a an the cat dog what What is in picture photo of be brief "
               "describe Describe it").split()
LLAVA_CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {% for c in m['content'] %}"
                       "{% if c['type'] == 'image' %}<image>{% else %}{{ c['text'] }}{% endif %}{% endfor %}"
                       "{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")


def word_level_tokenizer(specials: dict[str, int], size: int, words):
    """A ``tokenizers`` word-level tokenizer of ``size`` ids: the special tokens at their ids, ``words`` on the free
    ids from the lowest up, ``w<i>`` on the rest; split on whitespace, ``[UNK]`` for anything else."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    vocab = dict(specials)
    names = iter(words)
    for i in range(size):
        if i not in specials.values():
            vocab[next(names, f"w{i}")] = i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return tok


def add_llava_processor(model_dir: Path) -> None:
    """Save a working ``LlavaProcessor`` into a tiny Llava folder of :func:`make_llava_dir`: a word-level
    tokenizer over its 128 ids (``<pad>`` 0, ``<s>`` 1 prepended to every text, ``</s>`` 2, ``[UNK]`` 3, the
    special ``<image>`` at :data:`LLAVA_IMAGE_TOKEN`), a CLIP image processor resizing and cropping to 32x32,
    and a chat template placing ``<image>`` per image. One image expands to the model's 16 image tokens:
    (32 / 8)^2 patches + 1 CLS, less the CLS that ``vision_feature_select_strategy="default"`` drops.

    The image processor is saved twice, as hub Llava folders have it: ``preprocessor_config.json`` and nested in
    ``processor_config.json`` (transformers 5's form)."""
    import transformers
    from tokenizers import processors

    tok = word_level_tokenizer({"<pad>": 0, "<s>": 1, "</s>": 2, "[UNK]": 3, "<image>": LLAVA_IMAGE_TOKEN}, 128,
                               LLAVA_WORDS)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", 1)])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                pad_token="<pad>", unk_token="[UNK]",
                                                extra_special_tokens={"image_token": "<image>"})
    image_processor = transformers.CLIPImageProcessorPil(size={"shortest_edge": 32},
                                                         crop_size={"height": 32, "width": 32})
    processor = transformers.LlavaProcessor(image_processor=image_processor, tokenizer=fast, patch_size=8,
                                            vision_feature_select_strategy="default", num_additional_image_tokens=1,
                                            chat_template=LLAVA_CHAT_TEMPLATE)
    processor.save_pretrained(model_dir)
    image_processor.save_pretrained(model_dir)


def write_png(path: Path, seed: int = 0, size: tuple[int, int] = (48, 40)) -> Path:
    """A seeded random RGB PNG of ``size`` (width, height); 48x40 so the image processor resizes and crops."""
    from PIL import Image

    w, h = size
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path)
    return path


def make_gemma3_vlm_dir(root: Path, seed: int = 0) -> Path:
    """A tiny seeded Gemma3 vision-language model (SigLIP 32x32 in 4x4 patches pooled to 16 rows; Gemma3 text
    with a sliding window of 24 on layer 0). The projector weight, zero at init, is drawn at random so the image
    matters; with this seed and init scale the greedy tokens vary and depend on the bidirectional image mask."""
    import torch
    import transformers

    vc = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, image_size=32, patch_size=4)
    tc = transformers.Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       max_position_embeddings=128, initializer_range=0.05, query_pre_attn_scalar=8,
                                       sliding_window=24, layer_types=["sliding_attention", "full_attention"],
                                       bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg = transformers.Gemma3Config(vision_config=vc, text_config=tc, mm_tokens_per_image=16,
                                    image_token_index=LLAVA_IMAGE_TOKEN, boi_token_index=118, eoi_token_index=119,
                                    initializer_range=0.05)
    cfg.architectures = ["Gemma3ForConditionalGeneration"]
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 0.3)
    out = root / "tiny-gemma3-vlm"
    model.save_pretrained(out, safe_serialization=True)
    return out


QWEN_IMAGE_TOKEN = 150


def make_qwen25vl_dir(root: Path, seed: int = 0) -> Path:
    """A tiny seeded Qwen2.5-VL (patch 4, merge 2, windowed vision attention; 16x16 images are a 1x4x4 patch
    grid, 4 image tokens whose multimodal RoPE rows differ from their text positions)."""
    import torch
    import transformers

    cfg = transformers.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=160, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=64,
                           patch_size=4, spatial_merge_size=2, temporal_patch_size=2, window_size=16,
                           fullatt_block_indexes=[1], in_channels=3),
        image_token_id=QWEN_IMAGE_TOKEN, video_token_id=151, vision_start_token_id=148, vision_end_token_id=149)
    cfg.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    torch.manual_seed(seed)
    out = root / "tiny-qwen25vl"
    transformers.Qwen2_5_VLForConditionalGeneration(cfg).eval().save_pretrained(out, safe_serialization=True)
    return out


def make_exaone45_dir(root: Path, seed: int = 0) -> Path:
    """A tiny seeded Exaone4.5 (its vision encoder: Qwen2.5-VL's patch rows with a 2-D RoPE of its own, patch 4,
    merge 2; 16x16 images are a 1x4x4 patch grid, 4 image tokens) over an exaone4 text model with 1-D positions
    (sliding layers with a window of 6, global layers without RoPE)."""
    import torch
    import transformers

    cfg = transformers.Exaone4_5_Config(
        text_config=dict(model_type="exaone4", vocab_size=160, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=256, initializer_range=0.15, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0, sliding_window=6, sliding_window_pattern=2),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, num_key_value_heads=4,
                           out_hidden_size=64, patch_size=4, spatial_merge_size=2, temporal_patch_size=2,
                           window_size=16, fullatt_block_indexes=[1], in_channels=3),
        image_token_id=QWEN_IMAGE_TOKEN, video_token_id=151)
    cfg.architectures = ["Exaone4_5_ForConditionalGeneration"]
    torch.manual_seed(seed)
    out = root / "tiny-exaone4_5"
    transformers.Exaone4_5_ForConditionalGeneration(cfg).eval().save_pretrained(out, safe_serialization=True)
    return out


def qwen_patches(seed: int = 0) -> np.ndarray:
    """A 16x16 image as the processor's patch rows: [1*4*4 patches, 3 channels * 2 frames * 4 * 4]."""
    return np.random.default_rng(seed).standard_normal((16, 96)).astype(np.float32)


def make_internvl_dir(root: Path, seed: int = 0) -> Path:
    """A tiny seeded InternVL (32x32 images in 8x8 patches, pixel-shuffled to 4 image rows; Qwen2 text)."""
    import torch
    import transformers

    vc = transformers.InternVLVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, image_size=[32, 32], patch_size=[8, 8])
    tc = transformers.Qwen2Config(vocab_size=160, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                  initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg = transformers.InternVLConfig(vision_config=vc, text_config=tc, image_token_id=QWEN_IMAGE_TOKEN,
                                      downsample_ratio=0.5)
    cfg.architectures = ["InternVLForConditionalGeneration"]
    torch.manual_seed(seed)
    out = root / "tiny-internvl"
    transformers.InternVLForConditionalGeneration(cfg).eval().save_pretrained(out, safe_serialization=True)
    return out


def make_mistral3_dir(root: Path, seed: int = 0) -> Path:
    """A tiny seeded Mistral3 (Pixtral encoder, 32x32 images in 8x8 patches merged 2x2: 4 image rows)."""
    import torch
    import transformers

    vc = transformers.PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, image_size=32, patch_size=8, head_dim=8)
    tc = transformers.MistralConfig(vocab_size=160, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    max_position_embeddings=128, initializer_range=0.1, bos_token_id=1,
                                    eos_token_id=2, pad_token_id=0, sliding_window=None)
    cfg = transformers.Mistral3Config(vision_config=vc, text_config=tc, image_token_index=QWEN_IMAGE_TOKEN,
                                      spatial_merge_size=2)
    cfg.architectures = ["Mistral3ForConditionalGeneration"]
    torch.manual_seed(seed)
    out = root / "tiny-mistral3"
    transformers.Mistral3ForConditionalGeneration(cfg).eval().save_pretrained(out, safe_serialization=True)
    return out


def llava_image(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((1, 3, 32, 32)).astype(np.float32)


def hf_vlm_greedy(model_dir: Path, prompt: list[int], pixel_values: np.ndarray, max_new_tokens: int,
                  grid: list[int] | None = None) -> list[int]:
    """Greedy tokens from transformers ``generate`` with the image (eager attention, fp32)."""
    import torch
    import transformers

    model = transformers.AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32,
                                                                     attn_implementation="eager").eval()
    ids = torch.tensor([prompt], dtype=torch.int64)
    extra = {}
    params = inspect.signature(model.forward).parameters
    if "token_type_ids" in params:   # Gemma3: bidirectional image blocks
        extra["token_type_ids"] = (ids == model.config.image_token_id).to(torch.int64)
    sizes = inspect.signature(model.get_image_features).parameters.get("image_sizes")
    if grid is None and sizes is not None and sizes.default is inspect.Parameter.empty:   # Mistral3 (Pixtral)
        extra["image_sizes"] = torch.tensor([list(pixel_values.shape[-2:])], dtype=torch.int64)
    if grid is not None:             # Qwen2.5-VL: patch rows, their grid, and the modality of every token
        extra["image_grid_thw"] = torch.tensor([grid], dtype=torch.int64)
        if "mm_token_type_ids" in params:   # multimodal RoPE (Qwen2.5-VL; not Exaone4.5: 1-D text positions)
            extra["mm_token_type_ids"] = (ids == model.config.image_token_id).to(torch.int64)
    with torch.no_grad():
        out = model.generate(ids, pixel_values=torch.from_numpy(pixel_values), attention_mask=torch.ones_like(ids),
                             **extra,
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


QWEN_WORDS = ("user", "assistant", "system", ":")
QWEN_CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {% for c in m['content'] %}{% if c['type'] == 'image' %}"
                      "<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ c['text'] }}{% endif %}{% endfor %} "
                      "{% endfor %}{% if add_generation_prompt %}assistant :{% endif %}")


def add_qwen25vl_processor(model_dir: Path) -> None:
    """Save into a tiny Qwen2.5-VL folder of :func:`make_qwen25vl_dir` what its hub folder holds for the processor:
    a word-level tokenizer over its 160 ids (``<|vision_start|>`` 148, ``<|vision_end|>`` 149, ``<|image_pad|>``
    :data:`QWEN_IMAGE_TOKEN`, ``<|video_pad|>`` 151; words ``w<i>`` at id ``i``), a Qwen2-VL image processor (PIL:
    patch 4, merge 2, 2 frames; a 16x16 image is a 1x4x4 grid, 4 image tokens) whose config names
    ``Qwen2_5_VLProcessor`` (which transformers cannot build without torchvision, as on a serving host), and a
    chat template placing ``<|vision_start|><|image_pad|><|vision_end|>`` per image."""
    import json

    import transformers

    tok = word_level_tokenizer({"<pad>": 0, "<s>": 1, "</s>": 2, "[UNK]": 3, "<|vision_start|>": 148,
                                "<|vision_end|>": 149, "<|image_pad|>": QWEN_IMAGE_TOKEN, "<|video_pad|>": 151}, 160,
                               QWEN_WORDS)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                        unk_token="[UNK]").save_pretrained(model_dir)
    transformers.Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2,
                                          size={"shortest_edge": 64, "longest_edge": 4096}).save_pretrained(model_dir)
    cfg_path = model_dir / "preprocessor_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["processor_class"] = "Qwen2_5_VLProcessor"
    cfg_path.write_text(json.dumps(cfg, indent=2))
    (model_dir / "chat_template.jinja").write_text(QWEN_CHAT_TEMPLATE)
