"""Which model a state file belongs to: the checkpoint identity recorded at export (issue 11, item 6).

A state moves between the portable, onnxruntime and fused exports of one checkpoint (their weight layouts
differ, so the sampled fingerprint cannot tell them apart from another model), is refused from another
checkpoint and from another KV contract, and graphs without an identity (a peer's bare .onnx) keep the sampled
fingerprint. The rule is in docs/state-files.md."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import onnx_ir as ir
import pytest

from qeff_kv.errors import StateFileError
from qeff_kv.runtime import Session, read_state
from qeff_kv.runtime.model_files import CHECKPOINT_METADATA_KEY
from qeff_kv.runtime.memory.state_file import KVState, _checksum

from suite import OWN_CTX_LEN, OWN_PREFILL, requires_torch

pytestmark = requires_torch

#: Longer than one prefill chunk (8), so the portable prefill runs two chunks.
PROMPT = [5, 17, 42, 99, 130, 7, 201, 64, 3, 77, 21]
P = ",".join(map(str, PROMPT))


def cli(*args) -> dict:
    proc = subprocess.run([sys.executable, "-m", "qeff_kv_cli.main", "generate", *args, "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def cli_error(*args) -> str:
    proc = subprocess.run([sys.executable, "-m", "qeff_kv_cli.main", "generate", *args],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    return proc.stderr.strip()


@pytest.fixture(scope="module")
def exports(own_graphs):
    """One checkpoint (the bundled default, seed 0) on three targets, all with prefix VLLM."""
    return {
        "portable": own_graphs.export("qeff_llama_vllm.onnx"),
        "fused": own_graphs.export("own_llama_fused_vllm.onnx"),
        "ort_cb": own_graphs.export("own_llama_ort_cb_vllm.onnx"),
    }


@pytest.fixture(scope="module")
def other_export(own_graphs):
    """Another checkpoint of the same architecture and KV contract: the bundled config, seed 1, fused."""
    import torch
    import transformers

    from qeff_kv.export import export_model
    from qeff_kv.export.sources import bundled_model_dir

    cfg = transformers.AutoConfig.from_pretrained(bundled_model_dir())
    torch.manual_seed(1)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    src = own_graphs.root / "hf" / "bundled-llama-seed1"
    model.save_pretrained(src, safe_serialization=True)
    return export_model(src, own_graphs.root / "exports" / "seed1_fused_vllm", ctx_len=OWN_CTX_LEN,
                        prefill_seq_len=OWN_PREFILL, kv_cache_prefix="VLLM", target="onnxruntime-fused",
                        verify=False)


@pytest.fixture(scope="module")
def portable_state(exports, tmp_path_factory):
    """A prefill-only state of PROMPT saved by the CLI from the portable export (another process)."""
    path = tmp_path_factory.mktemp("identity") / "portable.safetensors"
    cli(str(exports["portable"].out_dir), "--prompt-ids", P, "--max-new-tokens", "0", "--save-state", str(path))
    return path


def strip_identity(onnx_path, dest):
    """The graph as another exporter hands it over: no checkpoint metadata (and no manifest unless copied)."""
    model = ir.load(onnx_path)
    model.metadata_props.pop(CHECKPOINT_METADATA_KEY)
    dest.parent.mkdir(parents=True, exist_ok=True)
    ir.save(model, dest)
    return dest


def short(identity: str) -> str:
    digest, _, dtype = identity.partition(":")
    return f"{digest[:12]}:{dtype}"


# ------------------------------------------------------------------------------------------ recorded
def test_one_checkpoint_one_identity_on_every_target(exports, other_export):
    ids = {k: e.manifest["checkpoint"]["identity"] for k, e in exports.items()}
    assert len(set(ids.values())) == 1
    ident = ids["portable"]
    assert ident.endswith(":float32") and len(ident.split(":")[0]) == 64
    for e in exports.values():  # the bare .onnx carries it too
        assert ir.load(e.onnx_path).metadata_props[CHECKPOINT_METADATA_KEY] == ident
    assert other_export.manifest["checkpoint"]["identity"] != ident
    portable, fused = Session(exports["portable"].out_dir), Session(exports["fused"].out_dir)
    assert portable.checkpoint == fused.checkpoint == ident
    # why the checkpoint is needed: the fused passes change the weight layout the sampled fingerprint reads
    assert portable.model_fingerprint != fused.model_fingerprint
    assert portable.kv_fingerprint == fused.kv_fingerprint


def test_weights_hash_counts_tied_tensors_once():
    import torch

    from qeff_kv.export.checkpoint import weights_sha256

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.embed = torch.nn.Embedding(8, 4)
            self.head = torch.nn.Linear(4, 8, bias=False)
            self.head.weight = self.embed.weight

    m = Tied()
    digest, count, nbytes = weights_sha256(m)
    assert count == 1 and nbytes == 8 * 4 * 4
    assert weights_sha256(Tied())[0] == digest  # deterministic
    with torch.no_grad():
        m.embed.weight[3, 1] += 1e-6
    assert weights_sha256(m)[0] != digest


# ------------------------------------------------------------------------------------------ hand-off
def test_prefill_portable_decode_fused_two_processes(exports, portable_state):
    meta = read_state(portable_state).metadata
    assert meta["model_identity"] == "checkpoint"
    assert meta["checkpoint"] == exports["portable"].manifest["checkpoint"]["identity"]
    fused = str(exports["fused"].out_dir)
    whole = cli(fused, "--prompt-ids", P, "--max-new-tokens", "8", "--ignore-eos")
    rest = cli(fused, "--load-state", str(portable_state), "--max-new-tokens", "8", "--ignore-eos")
    assert rest["sequences"][0]["tokens"] == whole["sequences"][0]["tokens"]
    assert len(whole["sequences"][0]["tokens"]) == 8


def test_portable_state_loads_into_onnxruntime_export(exports, portable_state):
    ort = Session(exports["ort_cb"].out_dir, max_sequences=2)
    [whole] = ort.generate([PROMPT], max_new_tokens=8, stop_tokens=[])
    ort.remove_sequence(whole.sequence)
    seq = ort.load_state(portable_state)
    [rest] = ort.generate([seq], max_new_tokens=8, stop_tokens=[])
    assert rest.tokens == whole.tokens


def test_state_of_another_checkpoint_is_refused(exports, other_export, portable_state, tmp_path):
    ours = exports["portable"].manifest["checkpoint"]["identity"]
    theirs = other_export.manifest["checkpoint"]["identity"]
    err = cli_error(str(other_export.out_dir), "--load-state", str(portable_state), "--max-new-tokens", "1")
    assert err == (f"error: {portable_state}: saved from another model (same KV contract, checkpoint "
                   f"{short(ours)}; this graph's checkpoint is {short(theirs)})")
    # and the other way round, in process
    s = Session(other_export.out_dir)
    [g] = s.generate([PROMPT], max_new_tokens=0)
    path = s.save_state(g.sequence, tmp_path / "other.safetensors")
    fused = Session(exports["fused"].out_dir)
    with pytest.raises(StateFileError) as info:
        fused.load_state(path)
    assert str(info.value) == (f"{path}: saved from another model (same KV contract, checkpoint {short(theirs)}; "
                               f"this graph's checkpoint is {short(ours)})")
    assert fused.cache.num_sequences == 0


def test_other_kv_dtype_is_another_kv_contract(own_graphs, portable_state):
    """An export computing in float16 holds float16 KV: refused as another KV contract (dtype is part of it)."""
    from qeff_kv.export import export_model

    half = export_model(None, own_graphs.root / "exports" / "fp16_vllm", ctx_len=OWN_CTX_LEN,
                        prefill_seq_len=OWN_PREFILL, kv_cache_prefix="VLLM", dtype="float16", verify=False)
    assert half.manifest["checkpoint"]["identity"].endswith(":float16")
    s = Session(half.out_dir)
    with pytest.raises(StateFileError, match=r"saved from a graph with another KV contract"):
        s.load_state(portable_state)


# ------------------------------------------------------------------------------------------ fallback
def test_graph_without_identity_falls_back_to_sampled(exports, portable_state, tmp_path):
    bare_portable = strip_identity(exports["portable"].onnx_path, tmp_path / "bare" / "portable.onnx")
    bare_fused = strip_identity(exports["fused"].onnx_path, tmp_path / "bare2" / "fused.onnx")
    kw = dict(ctx_len=OWN_CTX_LEN, prefill_seq_len=OWN_PREFILL)
    bare = Session(bare_portable, **kw)
    assert bare.checkpoint is None
    [whole] = bare.generate([PROMPT], max_new_tokens=6, stop_tokens=[])
    bare.remove_sequence(whole.sequence)
    # checkpoint-carrying file -> graph without one: same sampled weights, accepted
    [rest] = bare.generate([bare.load_state(portable_state)], max_new_tokens=6, stop_tokens=[])
    assert rest.tokens == whole.tokens
    bare.remove_sequence(rest.sequence)
    # sampled-only file (saved from the bare graph) -> the export folder, which has an identity: accepted
    [g] = bare.generate([PROMPT], max_new_tokens=0)
    sampled = bare.save_state(g.sequence, tmp_path / "sampled.safetensors")
    meta = read_state(sampled).metadata
    assert meta["model_identity"] == "sampled" and meta["checkpoint"] == ""
    folder = Session(exports["portable"].out_dir)
    [rest2] = folder.generate([folder.load_state(sampled)], max_new_tokens=6, stop_tokens=[])
    assert rest2.tokens == whole.tokens
    # ... across weight layouts the sampled comparison cannot vouch; the fiber fingerprint (each weight's contraction
    # fibers, whatever the layout: packed QKV, fused norms) does, both ways
    assert meta["weights_fibers"] and read_state(portable_state).metadata["weights_fibers"] == meta["weights_fibers"]
    assert Session(bare_fused, **kw).load_state(portable_state).length == len(PROMPT)
    assert Session(exports["fused"].out_dir).load_state(sampled).length == len(PROMPT)


def test_manifest_identity_when_the_graph_lacks_it(exports, portable_state, tmp_path):
    """An export folder whose graph lost its metadata (rewritten by another tool): the manifest's identity."""
    folder = tmp_path / "fused"
    shutil.copytree(exports["fused"].out_dir, folder)
    onnx_path = folder / exports["fused"].onnx_path.name
    strip_identity(onnx_path, onnx_path)
    s = Session(folder)
    assert s.checkpoint == exports["fused"].manifest["checkpoint"]["identity"]
    s.load_state(portable_state)


def test_files_without_identity_keys_use_sampled(exports, portable_state, tmp_path):
    """A version-1 file written before ``model_identity`` existed: compared by the sampled fingerprint."""
    state = read_state(portable_state)
    meta = {k: v for k, v in state.metadata.items()   # weights_fibers came later still
            if k not in ("model_identity", "checkpoint", "checksum", "weights_fibers")}
    meta["checksum"] = _checksum(meta, state.tensors)
    old = KVState({k: np.array(v) for k, v in state.tensors.items()}, meta)
    Session(exports["portable"].out_dir).import_state(old)  # same graph: sampled fingerprints agree
    with pytest.raises(StateFileError, match=r"different weights or structure; this graph names a checkpoint"):
        Session(exports["fused"].out_dir).import_state(old)
    bad = dict(meta, model_identity="checkpoint", checkpoint="not-an-identity")
    bad["checksum"] = _checksum(bad, state.tensors)
    with pytest.raises(StateFileError, match=r"malformed state metadata \(model_identity 'checkpoint'\)"):
        Session(exports["portable"].out_dir).import_state(KVState(old.tensors, bad))
