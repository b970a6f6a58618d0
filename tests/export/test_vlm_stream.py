"""Vision-language models stream (issue 51): the image-text-to-text skeleton, each parameter read from the
checkpoint key transformers loads into it (hub Llava-style names renamed at load), both graphs (vision and
language) written lazily from the checkpoint, the streamed reference for verification. Each tiny VLM family the
suite exports is exported streamed and with the whole model loaded (``QEFF_KV_EXPORT_STREAM=0``): the streamed
graphs' greedy tokens (with an image) and logits are the whole-model graphs'.
"""

from __future__ import annotations

import numpy as np
import pytest

from suite import requires_torch

pytestmark = [requires_torch]

CTX, NEW = 48, 6

#: family -> (maker, image tokens in the prompt, prefill chunk, export options)
FAMILIES = {
    "llava": ("make_llava_dir", 16, 4, {}),
    "mistral3": ("make_mistral3_dir", 4, 4, {}),
    "qwen25vl": ("make_qwen25vl_dir", 4, 4, {"image_size": 16}),
    "internvl": ("make_internvl_dir", 4, 4, {}),
    "gemma3": ("make_gemma3_vlm_dir", 16, 16, {}),   # bidirectional images: one chunk holds the image
}
STREAMING = list(FAMILIES)   # every family (Gemma 3's `1 + weight` norms stay nodes over the weight: issue 51)

_DIRS: dict = {}
_EXPORTS: dict = {}


def _family_dir(family: str, factory):
    import hf_models

    if family not in _DIRS:
        _DIRS[family] = getattr(hf_models, FAMILIES[family][0])(factory.mktemp(family))
    return _DIRS[family]


def _export(family: str, single: bool, stream: bool, factory, monkeypatch, model_dir=None):
    """``(result, progress lines)`` of one export (cached per family, layout and path)."""
    from qeff_kv.export import export_model

    key = (family, single, stream, str(model_dir))
    if key not in _EXPORTS:
        _maker, _rows, chunk, kw = FAMILIES[family]
        notes: list[str] = []
        monkeypatch.setenv("QEFF_KV_EXPORT_STREAM", "1" if stream else "0")
        res = export_model(model_dir or _family_dir(family, factory), factory.mktemp("o") / "o", ctx_len=CTX,
                           prefill_seq_len=chunk, single_graph=single, progress=notes.append, **kw)
        _EXPORTS[key] = (res, notes)
    return _EXPORTS[key]


def _prompt(family: str) -> tuple[list[int], int]:
    from hf_models import LLAVA_IMAGE_TOKEN, QWEN_IMAGE_TOKEN

    rows = FAMILIES[family][1]
    tok = LLAVA_IMAGE_TOKEN if family in ("llava", "gemma3") else QWEN_IMAGE_TOKEN
    if family == "gemma3":   # the image alone in the first chunk (its tokens attend both ways)
        return [tok] * rows + [5, 6, 7, 8, 9], tok
    return [1, 5, 6] + [tok] * rows + [7, 8, 9, 40, 41], tok


def _image(family: str) -> np.ndarray:
    from hf_models import llava_image, qwen_patches

    return qwen_patches() if family == "qwen25vl" else llava_image()


def _greedy(res, family: str) -> tuple[list[int], list[np.ndarray]]:
    """Greedy tokens and every step's logits of an export, with the image (through the vision graph when dual)."""
    from hf_models import PlainLoop
    from qeff_kv.contract.mrope import graph_positions, prompt_positions

    man = res.manifest
    loop = PlainLoop(res.onnx_path, CTX).with_image(
        _image(family), None if man["vision_onnx"] is None else res.out_dir / man["vision_onnx"])
    prompt, tok = _prompt(family)
    chunk = FAMILIES[family][2]
    grid = man["vision"].get("grid")
    rows, delta = prompt_positions(prompt, tok, [grid], 2) if grid else (None, 0)
    all_logits = []

    def step(ids: list[int], text: list[int], span: tuple[int, int] | None):
        pad = len(ids) - len(text)
        if grid is None:
            pos = np.array([text + [-1] * pad])
        elif span is None:
            pos = graph_positions(text, np.full((3, 1), text[0] + delta))
        else:
            pos = graph_positions(text + [-1] * pad, rows[:, span[0]:span[1]])
        all_logits.append(loop.step(np.array([ids]), pos))
        return int(all_logits[-1][0, -1].argmax())

    for off in range(0, len(prompt), chunk):
        part = prompt[off:off + chunk]
        tok_next = step(part + [0] * (chunk - len(part)), list(range(off, off + len(part))),
                        (off, off + len(part)))
    toks = [tok_next]
    while len(toks) < NEW:
        toks.append(step([toks[-1]], [len(prompt) + len(toks) - 1], None))
    return toks, all_logits


@pytest.mark.parametrize("single", [False, True], ids=["dual", "single"])
@pytest.mark.parametrize("family", STREAMING)
def test_a_vlm_streams_to_the_whole_model_graphs(family, single, tmp_path_factory, monkeypatch):
    streamed, notes = _export(family, single, True, tmp_path_factory, monkeypatch)
    whole, whole_notes = _export(family, single, False, tmp_path_factory, monkeypatch)
    name = streamed.onnx_path.parent.name
    assert any(n.startswith("building ") and "without its weights (they stream from the checkpoint" in n
               for n in notes), notes
    assert not any("loading the whole model" in n or n.startswith("loading ") for n in notes), notes
    assert any(n.startswith("loading ") for n in whole_notes), whole_notes   # the comparison is the whole path
    assert streamed.manifest["verification"]["status"] == whole.manifest["verification"]["status"] == "passed"
    assert streamed.manifest["checkpoint"]["identity"] == whole.manifest["checkpoint"]["identity"]
    assert (streamed.manifest["vision_onnx"] is None) == single, name
    toks, logits = _greedy(streamed, family)
    want, want_logits = _greedy(whole, family)
    assert len(set(want)) > 1, "greedy tokens do not vary: the parity proves little"
    assert toks == want
    for got, ref in zip(logits, want_logits):
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)


def _renamed_copy(src, dest):
    """The tiny Llava's checkpoint under the class's own names (``model.language_model...``, ``lm_head...``,
    ``model.vision_tower...``), as transformers 5 names the parameters, instead of the hub names it saves."""
    import shutil

    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dest)
    tensors = load_file(str(src / "model.safetensors"))

    def own(key: str) -> str:
        if key.startswith("language_model.lm_head."):
            return key[len("language_model."):]
        if key.startswith("language_model.model."):
            return "model.language_model." + key[len("language_model.model."):]
        return "model." + key

    save_file({own(k): v for k, v in tensors.items()}, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest, {own(k): k for k in tensors}


def test_the_hub_names_and_the_class_names_both_stream(tmp_path_factory, monkeypatch):
    """A Llava checkpoint under the hub's names (what the tiny model saves: transformers 5 renames on load and
    back on save) and the same tensors under the class's own names stream to the same graph."""
    import torch

    from qeff_kv.export.weights import stream
    from qeff_kv.export.weights.checkpoint_store import CheckpointStore
    from qeff_kv.export.weights.expert_keys import converted_store

    hub = _family_dir("llava", tmp_path_factory)
    own, back = _renamed_copy(hub, tmp_path_factory.mktemp("own") / "tiny-llava")
    skeleton = stream.skeleton(hub, torch.float32)
    hub_names = converted_store(CheckpointStore(hub), skeleton).renamed   # model name -> checkpoint key
    assert hub_names["model.language_model.layers.0.self_attn.q_proj.weight"] == \
        "language_model.model.layers.0.self_attn.q_proj.weight"
    assert hub_names["lm_head.weight"] == "language_model.lm_head.weight"
    assert hub_names["model.vision_tower.post_layernorm.weight"] == "vision_tower.post_layernorm.weight"
    own_store = CheckpointStore(own)
    assert converted_store(own_store, skeleton) is own_store   # the class's own names: nothing renamed
    assert set(own_store.keys()) == set(hub_names) and {back[k] for k in own_store.keys()} == set(hub_names.values())

    res, notes = _export("llava", False, True, tmp_path_factory, monkeypatch, model_dir=own)
    assert any("without its weights" in n for n in notes) and not any("whole model" in n for n in notes), notes
    ref, _ = _export("llava", False, True, tmp_path_factory, monkeypatch)
    assert _greedy(res, "llava")[0] == _greedy(ref, "llava")[0]   # (identities differ: the stored names differ)


def test_a_folded_cut_of_a_weight_is_read_as_that_cut():
    """InternVL's vision position table is folded as ``[:, :1]`` and ``[:, 1:]``: each is read from the checkpoint
    as that cut; a cut along the last axis (which a stand-in cannot tell apart) or a transposed one is not a cut,
    and two cuts of one weight with one shape (the exporter would merge their equal stand-ins) are refused."""
    import torch

    from qeff_kv.export.weights import stream
    from qeff_kv.export.weights.views import sliced_view

    p = stream.stand_in((1, 17, 32), torch.float32)
    assert sliced_view(p[:, :1], (1, 17, 32)) == ((0, 1), (0, 1), (0, 32))
    assert sliced_view(p[:, 1:], (1, 17, 32)) == ((0, 1), (1, 17), (0, 32))
    assert sliced_view(p[:, 3:9], (1, 17, 32)) == ((0, 1), (3, 9), (0, 32))
    assert sliced_view(p, (1, 17, 32)) is None and sliced_view(p[..., :5], (1, 17, 32)) is None
    q = stream.stand_in((6, 4), torch.float32)
    assert sliced_view(q.t()[:, 1:], (6, 4)) is None and sliced_view(q[2:5], (6, 4)) == ((2, 5), (0, 4))
    the_plan = stream.Plan(keys={p.untyped_storage().data_ptr(): "pos"},
                           shapes={p.untyped_storage().data_ptr(): (1, 17, 32)})
    assert stream.lineage({"a": p[:, :1], "b": p[:, 1:]}, the_plan) == {
        "a": ("pos", None, None, ((0, 1), (0, 1), (0, 32))), "b": ("pos", None, None, ((0, 1), (1, 17), (0, 32)))}
    with pytest.raises(stream.StreamRefused, match=r"^two views of pos of shape \(1, 1, 32\) are folded$"):
        stream.lineage({"a": p[:, 1:2], "b": p[:, 2:3]}, the_plan)
