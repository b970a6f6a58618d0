"""``qeff-kv generate``: options, output, tokenizer support, one-line errors (exit 2).

Runs on our own graphs and on the peer's (``graphs``), each compared with its own reference tokens."""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from qeff_kv_cli.main import main

from suite import PROMPT_A, PROMPT_B

A = ",".join(map(str, PROMPT_A))
B = ",".join(map(str, PROMPT_B))


def run(*args):
    return CliRunner().invoke(main, ["generate", *map(str, args)])


def test_json_output(graphs):
    r = run(graphs / "qeff_llama_vllm.onnx", "--prompt-ids", A, "--max-new-tokens", 8, "--ctx-len", 16, "--json")
    assert r.exit_code == 0, r.output
    lines = [l for l in r.stdout.splitlines() if l.strip()]
    out = json.loads(lines[-1])
    assert out["sequences"][0]["tokens"] == graphs.llama_a
    assert out["sequences"][0]["text"] is None and out["sequences"][0]["finish_reason"] == "length"
    assert out["inplace"] is True and out["ctx_len"] == 16 and out["prefill_seq_len"] == 32
    assert {"prefill_s", "decode_s", "decode_tokens_per_s"} <= set(out["timings"])
    assert "tokens/s" in r.stderr


def test_several_prompts_decode_together(graphs):
    r = run(graphs / "qeff_llama_cb_default.onnx", "--prompt-ids", A, "--prompt-ids", B, "--prompt-ids", "1 2 3",
            "--max-new-tokens", 8, "--ctx-len", 16, "--prefill-seq-len", 4)
    assert r.exit_code == 0, r.output
    lines = r.stdout.strip().splitlines()
    assert lines[0] == "[0] " + " ".join(map(str, graphs.llama_a))
    assert lines[1] == "[1] " + " ".join(map(str, graphs.llama_b))
    assert lines[2].startswith("[2] ")


def test_several_prompts_on_a_graph_without_batch_index_run_in_lock_step(graphs):
    r = run(graphs / "qeff_llama_vllm.onnx", "--prompt-ids", A, "--prompt-ids", B, "--max-new-tokens", 8,
            "--ctx-len", 16, "--prefill-seq-len", 4, "--ignore-eos")
    assert r.exit_code == 0, r.output
    lines = r.stdout.strip().splitlines()
    assert lines[:2] == ["[0] " + " ".join(map(str, graphs.llama_a)), "[1] " + " ".join(map(str, graphs.llama_b))]


@pytest.mark.parametrize("args, message", [
    (["--prompt-ids", A, "--max-new-tokens", 10, "--ctx-len", 16],
     "error: request 0: 0 cached + 8 prompt + 10 new tokens need 17 positions; the capacity is ctx_len=16"),
    (["--prompt-ids", A], "error: the graph leaves ctx_len symbolic ('ctx_len'); give it (--ctx-len N)"),
    (["--prompt", "hello", "--ctx-len", 16], "no tokenizer.json; give --prompt-ids instead"),
    (["--prompt-ids", "5,x", "--ctx-len", 16], "'x' is not an integer"),
    (["--prompt-ids", "5,999", "--ctx-len", 16], "token id 999 is outside the vocabulary [0, 256)"),
    (["--ctx-len", 16], "give --prompt, --prompt-ids or --load-state"),
    (["--prompt-ids", A, "--prompt-ids", B, "--ctx-len", 16, "--max-sequences", 1], "only 1 of 1 slots are free"),
    (["--prompt-ids", A, "--ctx-len", 16, "--temperature", "-1"], "temperature must be >= 0"),
    (["--load-state", "nope.safetensors", "--ctx-len", 16], "no such state file"),
])
def test_errors_are_one_line_exit_2(graphs, args, message):
    r = run(graphs / "qeff_llama_vllm.onnx", *args)
    assert r.exit_code == 2, r.output
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


def test_missing_model(tmp_path):
    r = run(tmp_path / "absent.onnx", "--prompt-ids", "1")
    assert r.exit_code == 2 and "no such file" in r.stderr


def _folder_with_tokenizer(graphs, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(256)}
    for i, word in enumerate(["hello", "world", "the", "cache"]):
        vocab[word] = 10 + i
        del vocab[f"w{10 + i}"]
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    folder = tmp_path / "model"
    folder.mkdir()
    os.symlink(graphs / "qeff_llama_vllm.onnx", folder / "qeff_llama_vllm.onnx")
    tok.save(str(folder / "tokenizer.json"))
    return folder, tok


def test_prompt_text_with_tokenizer(graphs, tmp_path):
    pytest.importorskip("tokenizers")
    folder, tok = _folder_with_tokenizer(graphs, tmp_path)
    ids = tok.encode("hello world the cache").ids
    assert ids == [10, 11, 12, 13]
    r = run(folder, "--prompt", "hello world the cache", "--max-new-tokens", 5, "--ctx-len", 16, "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout.strip().splitlines()[-1])
    r2 = run(folder, "--prompt-ids", "10,11,12,13", "--max-new-tokens", 5, "--ctx-len", 16, "--json")
    out2 = json.loads(r2.stdout.strip().splitlines()[-1])
    seq = out["sequences"][0]
    assert seq["tokens"] == out2["sequences"][0]["tokens"] and seq["prompt_tokens"] == 4
    assert seq["text"] == tok.decode(seq["tokens"])
    plain = run(folder, "--prompt", "hello world", "--max-new-tokens", 3, "--ctx-len", 16)
    assert plain.exit_code == 0 and plain.stdout.strip() == tok.decode(
        json.loads(run(folder, "--prompt-ids", "10,11", "--max-new-tokens", 3, "--ctx-len", 16, "--json")
                   .stdout.strip().splitlines()[-1])["sequences"][0]["tokens"])


def test_save_and_load_state_from_cli(graphs, tmp_path):
    g = graphs / "qeff_llama_vllm.onnx"
    state = tmp_path / "s.safetensors"
    r = run(g, "--prompt-ids", A, "--max-new-tokens", 0, "--ctx-len", 16, "--save-state", state)
    assert r.exit_code == 0 and state.is_file() and "saved state" in r.stderr
    r = run(g, "--load-state", state, "--max-new-tokens", 8, "--ctx-len", 16)
    assert r.stdout.strip() == " ".join(map(str, graphs.llama_a))
    r = run(graphs / "qeff_qwen2_vllm.onnx", "--load-state", state, "--max-new-tokens", 8, "--ctx-len", 16)
    assert r.exit_code == 2 and "saved from another model" in r.stderr
    r = run(g, "--prompt-ids", A, "--prompt-ids", A, "--save-state", state, "--ctx-len", 16)
    assert r.exit_code == 2 and "saves one sequence" in r.stderr


def test_no_inplace_flag_same_tokens(graphs):
    r = run(graphs / "qeff_llama_vllm.onnx", "--prompt-ids", A, "--max-new-tokens", 8, "--ctx-len", 16,
            "--no-inplace", "--json")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["inplace"] is False and out["sequences"][0]["tokens"] == graphs.llama_a
    assert "separate output buffers" in r.stderr


def test_readme_flow_on_the_bundled_default(own_vllm_graph):
    """``qeff-kv export -o tiny/ --kv-cache-prefix VLLM`` (the session's export of the bundled default) then
    ``qeff-kv generate tiny/ --prompt "Hello"`` (tokenizer and dimensions from the folder)."""
    r = run(own_vllm_graph, "--prompt", "Hello", "--max-new-tokens", 16, "--json")
    assert r.exit_code == 0, r.output
    seq = json.loads(r.stdout.strip().splitlines()[-1])["sequences"][0]
    assert seq["prompt_tokens"] >= 5 and isinstance(seq["text"], str)
    assert 1 <= len(seq["tokens"]) <= 16
    assert seq["finish_reason"] in ("length", "stop")


def test_penalty_and_bias_options_equal_the_session(graphs):
    from qeff_kv.runtime import Session
    from qeff_kv.runtime.decoding.sampling import SamplingParams

    banned = graphs.llama_a[0]
    r = run(graphs / "qeff_llama_vllm.onnx", "--prompt-ids", A, "--max-new-tokens", 8, "--ctx-len", 16,
            "--logit-bias", f"{banned}=-100", "--repetition-penalty", "1.3", "--presence-penalty", "0.4",
            "--frequency-penalty", "0.2", "--temperature", "0.8", "--min-p", "0.05", "--seed", "3", "--ignore-eos",
            "--json")
    assert r.exit_code == 0, r.output
    got = json.loads([l for l in r.stdout.splitlines() if l.strip()][-1])["sequences"][0]["tokens"]
    s = Session(graphs / "qeff_llama_vllm.onnx", ctx_len=16)
    [g] = s.generate([PROMPT_A], max_new_tokens=8, stop_tokens=[], sampling=SamplingParams(
        temperature=0.8, min_p=0.05, seed=3, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2,
        logit_bias=((banned, -100.0),)))
    assert got == g.tokens and got[0] != banned


@pytest.mark.parametrize("value", ["5", "x=1", "5=200", "5=abc"])
def test_bad_logit_bias_is_one_line(graphs, value):
    r = run(graphs / "qeff_llama_vllm.onnx", "--prompt-ids", A, "--ctx-len", 16, "--logit-bias", value)
    assert r.exit_code == 2 and "--logit-bias" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.output
