"""The peer's own vision-language and CCL graphs (issue 23): QEfficient's Llava dual pair (vision graph + language
graph, with and without the prefix), its single Llava graphs (32x32 and 336x336 images) and a CCL text graph, read
from ../shared/fixtures/qeff-peer-vlm (``QEFF_KV_PEER_VLM_FIXTURES``; skipped with the reason where absent).

Every graph checks and round-trips through ``rewrite`` with its vision buffers untouched; ``.*VLLM.*`` selects
exactly the KV; ``compile-config`` writes both halves in the peer's conventions; the runtime runs each graph with
an image (text for CCL) and gives transformers' greedy tokens on the fixture's models, the geometry the graphs
leave symbolic inferred (the vision graph's output, the prompt's run of image tokens) or given by a named option.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from suite import requires_torch
from qeff_kv.tools import check as qcheck
from qeff_kv.contract import naming
from qeff_kv.tools.buffers import buffers_report
from qeff_kv.tools.compile_from_graph import write_compile_config_for_graph
from qeff_kv.errors import RuntimeInputError
from qeff_kv.tools.rewrite import rewrite
from qeff_kv_cli.main import main

TOKEN = 397                      # image_token_index of both tiny Llava models
DUAL_VISION = "qeff_llava336_dual_vision.onnx"
DUAL_VLLM, DUAL_PLAIN = "qeff_llava336_dual_vllm_lang.onnx", "qeff_llava336_dual_noprefix_lang.onnx"
SINGLE32, SINGLE336 = "qeff_llava_single_vllm.onnx", "qeff_llava336_single_vllm.onnx"
CCL = "qeff_llama_ccl_vllm.onnx"
KV_GRAPHS = [DUAL_VLLM, DUAL_PLAIN, SINGLE32, SINGLE336, CCL]
NEW = 4
#: the 336 model: (336/8)^2 = 1764 image tokens; ctx_len and prefill chunks sized for them
CTX336, CHUNK336 = 1792, 256
CTX32, CHUNK32 = 40, 8


def prompt(rows: int) -> list[int]:
    return [1, 5, 6] + [TOKEN] * rows + [7, 8, 9, 40, 41]


def image(size: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((1, 3, size, size)).astype(np.float32)


#: a prompt ending in image tokens, run in chunks of 6 at capacity 22: its last chunk would be one image token,
#: unpadded (padding would pass the capacity), which the peer's graph takes for a decode step
ONE_TOKEN_PROMPT, ONE_TOKEN_CTX, ONE_TOKEN_CHUNK = [1, 5, 6] + [TOKEN] * 16, 22, 6


TEXT_PROMPT = [1, 5, 6, 7, 8, 9]


def _io(path):
    m = onnx.load(str(path), load_external_data=False)
    return [i.name for i in m.graph.input], [o.name for o in m.graph.output]


def _one_line_error(res, message: str):
    assert res.exit_code == 2, res.output
    assert res.stderr == f"error: {message}\n"


@pytest.fixture(scope="module")
def fx(peer_vlm_dir):
    return peer_vlm_dir


@pytest.fixture(scope="module")
def want(fx):
    """transformers' greedy tokens (eager, fp32) on the fixture's models, once per module."""
    pytest.importorskip("torch")
    import torch
    import transformers

    def vlm(name, tokens, pixels, new=NEW):
        model = transformers.AutoModelForImageTextToText.from_pretrained(fx / "models" / name, dtype=torch.float32,
                                                                         attn_implementation="eager").eval()
        ids = torch.tensor([tokens])
        extra = {} if pixels is None else {"pixel_values": torch.from_numpy(pixels)}
        with torch.no_grad():
            out = model.generate(ids, **extra, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
        return out[0, len(tokens):].tolist()

    llama = transformers.AutoModelForCausalLM.from_pretrained(fx / "models" / "tiny_llama", dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    ids = torch.tensor([[5, 17, 42, 99, 130, 7, 201, 64]])
    with torch.no_grad():
        text = llama.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, min_new_tokens=32,
                              do_sample=False, eos_token_id=None, pad_token_id=0)[0, 8:].tolist()
    return {"32": vlm("tiny_llava", prompt(16), image(32)),
            "one-token": vlm("tiny_llava", ONE_TOKEN_PROMPT, image(32)),
            "text": vlm("tiny_llava", TEXT_PROMPT, None),
            "336": vlm("tiny_llava_img336", prompt(1764), image(336)),
            "ccl": text}


# ------------------------------------------------------------------------------------------------ graph tools
@pytest.mark.parametrize("name", KV_GRAPHS + [DUAL_VISION])
def test_every_graph_checks(fx, name):
    report = qcheck.check(fx / name)
    assert report.ok, report.failed
    kind = {DUAL_VISION: "vision-encoder", DUAL_VLLM: "dual", DUAL_PLAIN: "dual", CCL: None}.get(name, "single")
    assert report.vision_language == kind and report.ccl == (name == CCL)
    if name != DUAL_VISION:   # every rule ran (no sidecar beside the peer's graphs): the regexes select exactly the KV
        assert {r.id: r.status for r in report.rules if r.status != "pass"} == {"sidecar": "skip", "lora": "skip"}
        assert report.prefix == (None if name == DUAL_PLAIN else "VLLM")


@pytest.mark.parametrize("name", KV_GRAPHS)
def test_rewrite_round_trip_renames_only_the_kv(fx, name, tmp_path):
    ins0, outs0 = _io(fx / name)
    prefixed = name != DUAL_PLAIN
    one = tmp_path / "one.onnx"
    rewrite(fx / name, one, strip=True) if prefixed else rewrite(fx / name, one, prefix="VLLM")
    ins1, outs1 = _io(one)
    kv = [n for n in ins0 + outs0 if naming.parse_kv_name(n) is not None]
    assert kv and all(naming.parse_kv_name(n).prefix == ("VLLM" if prefixed else None) for n in kv)
    # the vision buffers, image_idx, comp_ctx_lengths and logits keep their names and places
    assert [n for n in ins1 if naming.parse_kv_name(n) is None] == [n for n in ins0 if naming.parse_kv_name(n) is None]
    assert [n for n in outs1 if naming.parse_kv_name(n) is None] == \
        [n for n in outs0 if naming.parse_kv_name(n) is None]
    assert all(naming.parse_kv_name(n).prefix == ("VLLM" if not prefixed else None)
               for n in ins1 + outs1 if naming.parse_kv_name(n) is not None)
    assert qcheck.check(one).ok
    back = tmp_path / "back.onnx"
    rewrite(one, back, prefix="VLLM") if prefixed else rewrite(one, back, strip=True)
    assert _io(back) == (ins0, outs0)


def test_stripping_the_dual_language_graph_gives_the_peers_unprefixed_names(fx, tmp_path):
    rewrite(fx / DUAL_VLLM, tmp_path / "stripped.onnx", strip=True)
    assert _io(tmp_path / "stripped.onnx") == _io(fx / DUAL_PLAIN)
    rewrite(fx / DUAL_PLAIN, tmp_path / "prefixed.onnx", prefix="VLLM")
    assert _io(tmp_path / "prefixed.onnx") == _io(fx / DUAL_VLLM)


def test_rewrite_refuses_the_vision_graph(fx, tmp_path):
    r = CliRunner().invoke(main, ["rewrite", str(fx / DUAL_VISION), "-o", str(tmp_path / "v.onnx"),
                                  "--kv-cache-prefix", "VLLM"])
    _one_line_error(r, "graph is a vision encoder graph (pixel_values -> vision_embeds; no KV buffers, nothing "
                       "retained); the KV-cache prefix belongs to the language graph beside it")
    assert not (tmp_path / "v.onnx").exists()


@pytest.mark.parametrize("name", [DUAL_VLLM, SINGLE32, SINGLE336, CCL])
def test_serving_regex_selects_exactly_the_kv(fx, name):
    sel = buffers_report(fx / name, regex=".*VLLM.*").to_json()["selection"]
    ins, outs = _io(fx / name)
    assert sel["selected"] == [n for n in ins + outs if naming.parse_kv_name(n) is not None]
    assert sel["equals_kv_set"] is True and len(sel["selected"]) == (8 if name == CCL else 12)
    r = CliRunner().invoke(main, ["buffers", str(fx / name), "--regex", ".*VLLM.*"])
    assert r.exit_code == 0 and f"= exactly the {len(sel['selected'])} KV buffers" in r.output


def _pairs(text: str) -> list[tuple[str, str]]:
    lines = text.split("\n")
    return [(line[len(" - IOName: "):], lines[i + 1].strip()[len("Precision: "):])
            for i, line in enumerate(lines) if line.startswith(" - IOName: ")]


def test_compile_config_dual_pair_in_the_peers_conventions(fx, tmp_path):
    """The peer (QEfficient ebf55e8, Llava kv_offload): language specializations carry img_size, vision_size =
    (336/8)^2 and vision_batch_size; the vision program batch_size and img_size; vision buffers at the model dtype,
    KV at the KV precision. vision_size comes from the vision graph's shapes at --img-size."""
    r = CliRunner().invoke(main, ["compile-config", str(fx / DUAL_VLLM), "-o", str(tmp_path), "--prefill-seq-len",
                                  str(CHUNK336), "--ctx-len", str(CTX336), "--vision-model", str(fx / DUAL_VISION)])
    _one_line_error(r, "the vision-language graph's img_size is unknown (axis pixel_values dim 2 is symbolic); "
                       "give --img-size N")
    r = CliRunner().invoke(main, ["compile-config", str(fx / DUAL_VLLM), "-o", str(tmp_path), "--prefill-seq-len",
                                  str(CHUNK336), "--ctx-len", str(CTX336), "--vision-model", str(fx / DUAL_VISION),
                                  "--img-size", "336"])
    assert r.exit_code == 0, r.output
    prefill = {"batch_size": "1", "seq_len": str(CHUNK336), "ctx_len": str(CTX336), "img_size": "336",
               "vision_size": "1764", "vision_batch_size": "1"}
    assert json.loads((tmp_path / "specializations.json").read_text()) == {
        "specializations": [prefill, {**prefill, "seq_len": "1"}]}
    assert json.loads((tmp_path / "specializations_vision.json").read_text()) == {
        "specializations": [{"batch_size": "1", "img_size": "336"}]}
    ins, outs = _io(fx / DUAL_VLLM)
    kv_in = [n for n in ins if naming.parse_kv_name(n) is not None]
    kv_out = [n for n in outs if naming.parse_kv_name(n) is not None]
    assert _pairs((tmp_path / "custom_io.yaml").read_text()) == (
        [("vision_embeds", "float32")] + [(n, "float16") for n in kv_in]
        + [("vision_embeds_RetainedState", "float32")] + [(n, "float16") for n in kv_out])
    assert _pairs((tmp_path / "custom_io_vision.yaml").read_text()) == [("pixel_values", "float32"),
                                                                        ("vision_embeds", "float32")]


def test_compile_config_single_graph(fx, tmp_path):
    paths = write_compile_config_for_graph(fx / SINGLE32, tmp_path, prefill_seq_len=8, ctx_len=64, img_size=32)
    assert [p.name for p in paths] == ["custom_io.yaml", "specializations.json"]
    entry = {"batch_size": "1", "seq_len": "8", "ctx_len": "64", "img_size": "32", "vision_batch_size": "1"}
    assert json.loads(paths[1].read_text()) == {"specializations": [entry, {**entry, "seq_len": "1"}]}
    ins, outs = _io(fx / SINGLE32)
    assert _pairs(paths[0].read_text()) == (
        [("pixel_values", "float32")] + [(n, "float16") for n in ins if naming.parse_kv_name(n) is not None]
        + [("pixel_values_RetainedState", "float32")]
        + [(n, "float16") for n in outs if naming.parse_kv_name(n) is not None])


# ------------------------------------------------------------------------------------------------ runtime
@requires_torch
def test_single_graph_on_the_command_line(fx, want, tmp_path):
    """The rows per image come from the prompt (one run of image tokens), the image size from the image."""
    npz = tmp_path / "image.npz"
    np.savez(npz, pixel_values=image(32))
    args = ["generate", str(fx / SINGLE32), "--prompt-ids", ",".join(map(str, prompt(16))), "--image-inputs",
            str(npz), "--ctx-len", str(CTX32), "--prefill-seq-len", str(CHUNK32), "--max-new-tokens", str(NEW),
            "--json"]
    _one_line_error(CliRunner().invoke(main, args),
                    "pixel_values graph without qeff-kv's vision metadata or manifest: give its image token id "
                    "(image_token_id=..., --image-token-id)")
    r = CliRunner().invoke(main, args + ["--image-token-id", str(TOKEN)])
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout.splitlines()[-1])
    assert res["sequences"][0]["tokens"] == want["32"]
    assert res["timings"]["images"] == 1


@requires_torch
def test_single_graph_round_tripped_through_rewrite_runs_exactly(fx, want, tmp_path):
    from qeff_kv.runtime import VisionLanguageModel

    rewrite(fx / SINGLE32, tmp_path / "abc.onnx", prefix="ABC")
    rewrite(tmp_path / "abc.onnx", tmp_path / "back.onnx", prefix="VLLM")
    vlm = VisionLanguageModel(tmp_path / "back.onnx", image_token_id=TOKEN, ctx_len=CTX32, prefill_seq_len=CHUNK32)
    [g] = vlm.generate([(prompt(16), {"pixel_values": image(32)})], max_new_tokens=NEW)
    assert g.tokens == want["32"]


@requires_torch
def test_an_image_token_never_sits_alone_in_a_chunk(fx, want, monkeypatch):
    """The peer's merge keeps the text embedding when seq_len == 1: a last chunk of one image token (unpadded: at
    the capacity) takes a token from the chunk before it. The plain plan would get other tokens."""
    from qeff_kv.contract.chunking import plan_chunks
    from qeff_kv.runtime import VisionLanguageModel
    from qeff_kv.runtime.multimodal import media

    def run():
        vlm = VisionLanguageModel(fx / SINGLE32, image_token_id=TOKEN, ctx_len=ONE_TOKEN_CTX,
                                  prefill_seq_len=ONE_TOKEN_CHUNK)
        return vlm.generate([(ONE_TOKEN_PROMPT, {"pixel_values": image(32)})], max_new_tokens=3)[0].tokens

    assert media.plan_prompt(ONE_TOKEN_PROMPT, ONE_TOKEN_CHUNK, TOKEN) == [(0, 6), (6, 6), (12, 5), (17, 2)]
    with pytest.raises(RuntimeInputError, match=r"^image token at prompt position 3 would be fed in a chunk of one "
                                                r"token, .* use a prefill length of 2 or more \(--prefill-seq-len\)$"):
        media.plan_prompt(ONE_TOKEN_PROMPT, 1, TOKEN)
    assert run() == want["one-token"][:3]
    monkeypatch.setattr(media, "plan_prompt", lambda t, c, i, keep_runs_whole=False: plan_chunks(t, c))
    assert run() != want["one-token"][:3]


@requires_torch
@pytest.mark.parametrize("lang", [DUAL_VLLM, DUAL_PLAIN])
def test_dual_pair_gives_transformers_tokens(fx, want, lang, tmp_path):
    """``generate LANG --vision-graph VISION``: 1764 rows per image, learnt from the vision graph's output."""
    npz = tmp_path / "image.npz"
    np.savez(npz, pixel_values=image(336))
    base = ["generate", str(fx / lang), "--image-token-id", str(TOKEN), "--prompt-ids",
            ",".join(map(str, prompt(1764))), "--image-inputs", str(npz), "--ctx-len", str(CTX336),
            "--prefill-seq-len", str(CHUNK336), "--max-new-tokens", str(NEW), "--json"]
    if lang == DUAL_VLLM:   # no manifest names the vision graph: the option does
        _one_line_error(CliRunner().invoke(main, base),
                        f"no vision graph for {lang}: give it (vision=..., --vision-graph; the dual layout's "
                        "<name>_vision.onnx)")
    r = CliRunner().invoke(main, base + ["--vision-graph", str(fx / DUAL_VISION)])
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout.splitlines()[-1])
    assert res["sequences"][0]["tokens"] == want["336"]
    assert res["timings"]["images"] == 1 and res["timings"]["prefill_tokens"] == len(prompt(1764))


@requires_torch
def test_dual_pair_in_the_library_writes_the_rows_in_place_once_learnt(fx, want):
    from qeff_kv.runtime import VisionLanguageModel

    vlm = VisionLanguageModel(fx / DUAL_VLLM, fx / DUAL_VISION, image_token_id=TOKEN, ctx_len=CTX336,
                              prefill_seq_len=CHUNK336)
    assert vlm.facts.get("vision_size") is None and vlm.facts["hidden_size"] == 96   # symbolic rows, static hidden
    p = vlm.prompt(prompt(1764), {"pixel_values": image(336)})
    assert p.images.array.shape == (1, 1764, 96) and vlm.vision.runs == 1
    [g] = vlm.generate([p], max_new_tokens=NEW)
    assert g.tokens == want["336"]
    # a second image of that size: written straight into its row (the rows of that input shape are known now)
    assert vlm.vision._out_dims == {(1, 3, 336, 336): (1764, 96)}
    again = vlm.images(prompt(1764), {"pixel_values": image(336)})
    np.testing.assert_array_equal(again.array, p.images.array)
    assert vlm.vision.runs == 2
    # given, the rows must agree with the prompt
    fixed = VisionLanguageModel(fx / DUAL_VLLM, fx / DUAL_VISION, image_token_id=TOKEN, ctx_len=CTX336,
                                prefill_seq_len=CHUNK336, image_size=336, vision_size=1764)
    [g] = fixed.generate([(prompt(1764), {"pixel_values": image(336)})], max_new_tokens=NEW)
    assert g.tokens == want["336"]
    wrong = VisionLanguageModel(fx / DUAL_VLLM, fx / DUAL_VISION, image_token_id=TOKEN, ctx_len=CTX336,
                                vision_size=10)
    with pytest.raises(RuntimeInputError, match=r"^the vision graph made 1764 rows per image; this graph's "
                                                r"vision_size is 10 \(metadata, manifest, --vision-size\)$"):
        wrong.images(prompt(10), {"pixel_values": image(336)})


@requires_torch
def test_single_336_graph_gives_transformers_tokens(fx, want):
    from qeff_kv.runtime import VisionLanguageModel

    vlm = VisionLanguageModel(fx / SINGLE336, image_token_id=TOKEN, ctx_len=CTX336, prefill_seq_len=CHUNK336)
    [g] = vlm.generate([(prompt(1764), {"pixel_values": image(336)})], max_new_tokens=NEW)
    assert g.tokens == want["336"]


@requires_torch
def test_geometry_that_cannot_be_inferred_names_its_option(fx, want, tmp_path):
    from qeff_kv.runtime import VisionLanguageModel

    single = VisionLanguageModel(fx / SINGLE32, image_token_id=TOKEN, ctx_len=CTX32, prefill_seq_len=CHUNK32)
    with pytest.raises(RuntimeInputError, match=r"^pixel_values graph: a text-only prompt runs its vision encoder on "
                                                r"a placeholder image, and the image size of this graph is recorded "
                                                r"nowhere: give it \(VisionLanguageModel\(image_size=\.\.\.\), "
                                                r"--image-size\), or an image first$"):
        single.generate([TEXT_PROMPT], max_new_tokens=2)
    assert single.session.sequences == []
    with pytest.raises(RuntimeInputError, match=r"^the image rows per image \(vision_size\) of this graph are "
                                                r"recorded nowhere, and the prompt's image tokens "
                                                r"\(runs of \[2, 14\]\) are not one run of one length per image "
                                                r"for its 1 image\(s\): give vision_size=\.\.\. \(--vision-size\)$"):
        single.images([1] + [TOKEN] * 2 + [5] + [TOKEN] * 14, {"pixel_values": image(32)})
    # with --image-size the text-only prompt runs (its placeholder is an image the encoder takes)
    sized = VisionLanguageModel(fx / SINGLE32, image_token_id=TOKEN, ctx_len=CTX32, prefill_seq_len=CHUNK32,
                                image_size=32)
    [g] = sized.generate([TEXT_PROMPT], max_new_tokens=NEW)
    assert g.tokens == want["text"] and sized.media.bound.array.shape == (1, 3, 32, 32)
    # a graph whose pixel_values dims are static says its image size itself (a plain Session runs text)
    from qeff_kv.runtime import Session

    m = onnx.load(str(fx / SINGLE32))
    for v in list(m.graph.input) + list(m.graph.output):
        if v.name.startswith("pixel_values"):
            for axis in (2, 3):
                v.type.tensor_type.shape.dim[axis].dim_value = 32
    onnx.save(m, str(tmp_path / "static.onnx"))
    [g] = Session(tmp_path / "static.onnx", image_token_id=TOKEN, ctx_len=CTX32,
                  prefill_seq_len=CHUNK32).generate([TEXT_PROMPT], max_new_tokens=NEW)
    assert g.tokens == want["text"]
    # the image must have that size; a vision graph does not go with the single layout
    with pytest.raises(RuntimeInputError, match=r"^pixel_values has shape \[1, 3, 16, 16\]; this export takes "
                                                r"\[images, 3, 32, 32\]$"):
        sized.images(prompt(16), {"pixel_values": image(16)})
    with pytest.raises(RuntimeInputError, match=r"^a vision graph was given for a single-layout graph"):
        VisionLanguageModel(fx / SINGLE32, fx / DUAL_VISION, image_token_id=TOKEN, ctx_len=CTX32)
    # a given size must agree with what the graph fixes
    m = onnx.load(str(fx / DUAL_VLLM))
    for v in list(m.graph.input) + list(m.graph.output):
        if v.name.startswith("vision_embeds"):
            v.type.tensor_type.shape.dim[1].dim_value = 16
    onnx.save(m, str(tmp_path / "fixed.onnx"))
    with pytest.raises(RuntimeInputError, match=r"^vision_size=10 \(--vision-size\) was given, but this graph's "
                                                r"vision_size is 16$"):
        VisionLanguageModel(tmp_path / "fixed.onnx", fx / DUAL_VISION, image_token_id=TOKEN, ctx_len=CTX32,
                            vision_size=10)


def test_ccl_graph_steps_its_lengths_and_stays_exact(fx, want):
    from qeff_kv.runtime import Session

    s = Session(fx / CCL, ctx_len=64, prefill_seq_len=8)
    assert s.ccl is not None and s.ccl.lengths == [1, 2, 4, 8, 16, 32, 64]
    seq = s.add_sequence()
    logits = s.prefill(seq, [5, 17, 42, 99, 130, 7, 201, 64])
    seen, out = [s.binding.ccl_bound], []
    for _ in range(32):
        tok = int(np.argmax(logits))
        out.append(tok)
        logits = s.decode({seq: tok})[seq]
        seen.append(s.binding.ccl_bound)
    assert out == want["ccl"]
    assert seen[0] == 8 and seen[-1] == 64 and sorted(set(seen)) == [8, 16, 32, 64]
    assert seen == sorted(seen)
