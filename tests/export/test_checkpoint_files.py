"""Checkpoints are read as transformers reads them (issue 52, items 1, 2 and 6).

* Which file holds a tensor: one rule for every reader (``checkpoint_store.tensor_files``): the index decides, a
  stray file beside an indexed folder is never read, a tensor in two files no index decides between is refused in
  one line naming both.
* Index entries: a plain file name of the folder or a one-line refusal (``..``, absolute paths, ``/proc``,
  ``/dev/zero``); only regular files are opened; symlinked shards (the Hugging Face cache's layout) still work.
* Safetensors headers: validated as safetensors validates them before any tensor is read.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

from suite import requires_torch
from qeff_kv.errors import CheckpointError, ExportError
from qeff_kv.export.weights.budget import safetensors_parameters
from qeff_kv.export.weights.checkpoint_store import CheckpointStore, read_header, tensor_files

A = np.arange(12, dtype=np.float32).reshape(3, 4)
B = np.arange(6, dtype=np.int64)


def raw_file(path: Path, header: dict, data: bytes, length: int | None = None) -> Path:
    """A safetensors file written byte by byte (any header, valid or not)."""
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text) if length is None else length) + text + data)
    return path


def valid_header() -> tuple[dict, bytes]:
    return ({"a": {"dtype": "F32", "shape": [3, 4], "data_offsets": [0, 48]},
             "b": {"dtype": "I64", "shape": [6], "data_offsets": [48, 96]}}, A.tobytes() + B.tobytes())


def stored(store: CheckpointStore, key: str) -> bytes:
    return b"".join(store.stored_bytes(key))


def one_line(exc_info, *needles) -> str:
    msg = str(exc_info.value)
    assert "\n" not in msg and isinstance(exc_info.value, CheckpointError), msg
    for n in needles:
        assert n in msg, (n, msg)
    return msg


def write_index(folder: Path, weight_map: dict, name: str = "model.safetensors.index.json") -> None:
    (folder / name).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


# ------------------------------------------------------------------------------------- headers (item 6)
def _drop_offsets(h):
    del h["b"]["data_offsets"]


def _overlap(h):
    h["b"]["data_offsets"] = [40, 88]


def _gap(h):
    h["a"]["data_offsets"], h["b"]["data_offsets"] = [0, 48], [56, 104]


def _wrong_size(h):
    h["a"]["shape"] = [3, 5]


def _bad_dtype(h):
    h["b"]["dtype"] = "Q4"


def _metadata(h):
    h["__metadata__"] = {"format": 1}


HEADERS = [(_drop_offsets, "'b'", "data_offsets"), (_overlap, "'b'", "overlaps tensor 'a'"),
           (_gap, "'b'", "leaves 8 bytes unused"), (_wrong_size, "'a'", "F32 x [3, 5] is 60"),
           (_bad_dtype, "'b'", "not a safetensors dtype"), (_metadata, "__metadata__", "strings")]


@pytest.mark.parametrize("mutate,tensor,what", HEADERS, ids=[m.__name__ for m, _t, _w in HEADERS])
def test_a_header_safetensors_refuses_is_refused_in_one_line(tmp_path, mutate, tensor, what):
    header, data = valid_header()
    mutate(header)
    raw_file(tmp_path / "model.safetensors", header, data + (b"\0" * 8 if mutate is _gap else b""))
    with pytest.raises(CheckpointError) as exc:
        CheckpointStore(tmp_path)
    one_line(exc, "model.safetensors", tensor, what)


@pytest.mark.parametrize("data,length,what", [(b"", None, "cover 96 bytes but the data section holds 0"),
                                               (b"\0" * 104, None, "bytes no tensor names"),
                                               (b"", 10**12, "header length"), (b"", 1, "header length")])
def test_a_file_whose_header_does_not_fit_its_data_is_refused(tmp_path, data, length, what):
    header, _data = valid_header()
    raw_file(tmp_path / "model.safetensors", header, data, length)
    with pytest.raises(CheckpointError) as exc:
        read_header(tmp_path / "model.safetensors")
    one_line(exc, "model.safetensors", what)


def test_a_header_key_given_twice_is_refused(tmp_path):
    text = b'{"a": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}, "a": {"dtype": "F32", "shape": [0], ' \
           b'"data_offsets": [0, 0]}}'
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text)
    with pytest.raises(CheckpointError) as exc:
        read_header(tmp_path / "model.safetensors")
    one_line(exc, "'a' appears twice")


# ------------------------------------------------------------------------------------ which file (item 1)
def test_a_tensor_in_two_files_without_an_index_is_refused_naming_both(tmp_path):
    save_file({"a": np.zeros_like(A)}, str(tmp_path / "a-stale.safetensors"))
    save_file({"a": A, "b": B}, str(tmp_path / "model.safetensors"))
    for read in (CheckpointStore, tensor_files, safetensors_parameters):
        with pytest.raises(CheckpointError) as exc:
            read(tmp_path)
        one_line(exc, "tensor 'a'", "'a-stale.safetensors'", "'model.safetensors'")


def test_the_index_decides_and_a_stray_file_is_never_read(tmp_path):
    save_file({"a": A}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"b": B}, str(tmp_path / "model-00002-of-00002.safetensors"))
    write_index(tmp_path, {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"})
    for stray in ("a-old.safetensors", "zz-old.safetensors"):   # sorts first, sorts last
        save_file({"a": np.zeros_like(A), "c": B}, str(tmp_path / stray))
    store = CheckpointStore(tmp_path)
    assert store.keys() == {"a", "b"}
    assert stored(store, "a") == A.tobytes() and stored(store, "b") == B.tobytes()
    assert safetensors_parameters(tmp_path) == 18


def test_a_tensor_in_two_indexed_files_is_refused(tmp_path):
    """transformers loads every indexed file whole, the last by name winning: not always the weight_map's pick."""
    save_file({"a": np.zeros_like(A)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"a": A, "b": B}, str(tmp_path / "model-00002-of-00002.safetensors"))
    write_index(tmp_path, {"a": "model-00002-of-00002.safetensors", "b": "model-00001-of-00002.safetensors"})
    with pytest.raises(CheckpointError) as exc:
        tensor_files(tmp_path)
    one_line(exc, "tensor 'a'", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
             "both named by the index")


def test_an_index_entry_its_file_does_not_hold_is_refused(tmp_path):
    save_file({"a": A}, str(tmp_path / "one.safetensors"))
    save_file({"b": B}, str(tmp_path / "two.safetensors"))
    write_index(tmp_path, {"a": "two.safetensors", "b": "two.safetensors"})
    with pytest.raises(CheckpointError) as exc:
        tensor_files(tmp_path)
    one_line(exc, "tensor 'a'", "'two.safetensors'", "does not hold it")


# ---------------------------------------------------------------------------------- index entries (item 2)
@pytest.fixture
def outside(tmp_path):
    """A valid safetensors file outside the model folder (``tmp_path/model``)."""
    save_file({"b": B}, str(tmp_path / "x.safetensors"))
    (tmp_path / "model").mkdir()
    save_file({"a": A}, str(tmp_path / "model" / "model.safetensors"))
    return tmp_path / "x.safetensors"


@pytest.mark.parametrize("entry", ["../x.safetensors", "OUTSIDE", "/proc/self/environ", "/dev/zero",
                                   "sub/x.safetensors", "..", "x.bin", "sub\\x.safetensors", ""])
def test_an_index_entry_that_is_not_a_plain_file_name_is_refused(outside, entry):
    folder = outside.parent / "model"
    (folder / "sub").mkdir()
    save_file({"b": B}, str(folder / "sub" / "x.safetensors"))
    entry = str(outside) if entry == "OUTSIDE" else entry
    write_index(folder, {"a": "model.safetensors", "b": entry})
    for read in (CheckpointStore, safetensors_parameters):
        with pytest.raises(CheckpointError) as exc:
            read(folder)
        one_line(exc, "model.safetensors.index.json", f"names {entry!r}", "not a plain .safetensors file name")


@pytest.mark.parametrize("entry", ["/proc/self/environ", "../pytorch_model.bin"])
def test_a_hostile_pytorch_index_is_refused_too(outside, entry):
    folder = outside.parent / "model"
    write_index(folder, {"a": entry}, "pytorch_model.bin.index.json")
    with pytest.raises(CheckpointError) as exc:
        tensor_files(folder)
    one_line(exc, "pytorch_model.bin.index.json", repr(entry))


def test_a_shard_that_is_not_a_regular_file_is_never_opened(outside):
    folder = outside.parent / "model"
    os.symlink("/dev/zero", folder / "model-00002.safetensors")
    for index in (False, True):
        if index:
            write_index(folder, {"a": "model.safetensors", "b": "model-00002.safetensors"})
        with pytest.raises(CheckpointError) as exc:
            tensor_files(folder)
        one_line(exc, "model-00002.safetensors", "not a regular file")


def test_symlinked_shards_of_the_hugging_face_cache_are_read(tmp_path):
    """snapshots/<rev>/<file> -> ../../blobs/<hash>: the links leave the folder, their targets are regular files."""
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "abc123"
    blobs.mkdir()
    snap.mkdir(parents=True)
    save_file({"a": A}, str(blobs / "1111"))
    save_file({"b": B}, str(blobs / "2222"))
    os.symlink("../../blobs/1111", snap / "model-00001-of-00002.safetensors")
    os.symlink("../../blobs/2222", snap / "model-00002-of-00002.safetensors")
    write_index(snap, {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"})
    store = CheckpointStore(snap)
    assert stored(store, "a") == A.tobytes() and stored(store, "b") == B.tobytes()


def test_errors_are_export_errors():
    assert issubclass(CheckpointError, ExportError)


# ------------------------------------------------------------------ the exporter and transformers agree (item 1)
PROMPT = [5, 17, 42, 99, 13, 7, 101, 64, 3, 77, 21]
CTX, CHUNK, NEW = 32, 4, 8


def _stale_zero_copy(folder: Path, key: str, stray: str) -> None:
    """``folder`` indexed (every tensor in ``model.safetensors``), a stale all-zero copy of ``key`` in ``stray``."""
    from safetensors import safe_open
    from safetensors.torch import save_file as save_torch

    with safe_open(str(folder / "model.safetensors"), framework="pt") as fh:
        keys = list(fh.keys())
        save_torch({key: fh.get_tensor(key).zero_()}, str(folder / stray))
    write_index(folder, {k: "model.safetensors" for k in keys})


@requires_torch
def test_a_stale_zero_copy_in_a_stray_file_never_reaches_the_graph(tmp_path):
    """A pre-quantized checkpoint (its own reader, and the reference's weights) beside a stray file holding an
    all-zero ``model.norm.weight`` that sorts last: the reader took it before (and verification passed, reading
    the same copy); now the index decides, as transformers: its greedy tokens on the dequantized weights."""
    from hf_models import PlainLoop, hf_greedy
    from prequant_checkpoints import make_checkpoint

    from qeff_kv.export import export_model

    ck = make_checkpoint("awq", tmp_path / "ck", group=32, seed=1)
    _stale_zero_copy(ck.folder, "model.norm.weight", "zz-stale.safetensors")
    res = export_model(ck.folder, tmp_path / "ex", ctx_len=CTX, prefill_seq_len=CHUNK, target="onnxruntime")
    assert res.manifest["verification"]["status"] == "passed"
    assert PlainLoop(res.onnx_path, CTX).greedy(PROMPT, NEW, CHUNK) == hf_greedy(ck.reference, PROMPT, NEW)


@requires_torch
def test_the_stored_tensors_are_transformers_own_load(tmp_path):
    """The streamed graph and its reference both read :class:`CheckpointStore`: its tensors, under the one
    name->file rule, equal transformers' own load of the folder (sharded, a stale copy in a stray file)."""
    import torch
    import transformers
    from hf_models import make_model_dir
    from safetensors.torch import save_file as save_torch

    src = make_model_dir("llama", tmp_path / "src", seed=3)
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    folder = tmp_path / "sharded"
    model.save_pretrained(folder, max_shard_size="40KB")
    assert (folder / "model.safetensors.index.json").is_file()
    save_torch({"model.embed_tokens.weight": torch.zeros_like(model.model.embed_tokens.weight)},
               str(folder / "model-00000-stale.safetensors"))   # sorts first
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    store = CheckpointStore(folder)
    assert store.keys() == set(loaded)
    for key in sorted(store.keys()):
        assert np.array_equal(store.array(key, torch.float32), loaded[key].numpy()), key


@requires_torch
@pytest.mark.parametrize("case", ["duplicate", "proc-environ", "no-offsets"])
def test_cli_export_refuses_a_hostile_checkpoint_in_one_line(tmp_path, case):
    from cli_checks import cli, one_error, tree
    from hf_models import make_model_dir

    folder = make_model_dir("llama", tmp_path, seed=0)
    needles = ["model.safetensors"]
    if case == "duplicate":   # no index: the stale copy sorted first and was exported (and verified) before
        save_file({"model.norm.weight": np.zeros(64, np.float32)}, str(folder / "a-stale.safetensors"))
        needles += ["'model.norm.weight'", "'a-stale.safetensors'"]
    elif case == "proc-environ":   # the whole path handed it to torch.load
        write_index(folder, {"model.norm.weight": "/proc/self/environ"})
        needles += ["'/proc/self/environ'", "not a plain .safetensors file name"]
    else:
        data = (folder / "model.safetensors").read_bytes()
        length = int.from_bytes(data[:8], "little")
        header = json.loads(data[8:8 + length])
        del header["model.norm.weight"]["data_offsets"]
        raw_file(folder / "model.safetensors", header, data[8 + length:])
        needles += ["'model.norm.weight'", "data_offsets"]
    before = tree(tmp_path)
    res = cli("export", folder, "-o", tmp_path / "out", "--ctx-len", CTX, "--prefill-seq-len", CHUNK)
    one_error(res, *needles)
    assert tree(tmp_path) == before


# ------------------------------------------------------------- property: any header, any index (items 2 and 6)
TENSORS = {"a": A, "b": B, "c": np.arange(4, dtype=np.float16).reshape(2, 2)}
ENTRIES = ["model.safetensors", "../x.safetensors", "OUTSIDE", "/proc/self/environ", "/dev/zero", "sub/x.safetensors",
           "missing.safetensors", "x.bin", "./model.safetensors", "model.safetensors\0"]
_name = st.sampled_from(sorted(TENSORS))
_small = st.integers(-24, 24)
MUTATION = st.one_of(
    st.tuples(st.just("drop"), _name, st.sampled_from(["dtype", "shape", "data_offsets"])),
    st.tuples(st.just("offsets"), _name, _small, _small),
    st.tuples(st.just("shape"), _name, st.lists(st.integers(-1, 6), max_size=3)),
    st.tuples(st.just("dtype"), _name, st.sampled_from(["F32", "F16", "I64", "U8", "BF16", "Q4", 7])),
    st.tuples(st.just("entry"), _name, st.sampled_from([None, 3, "x", [0, 8], {}])),
    st.tuples(st.just("metadata"), st.sampled_from([{"format": "pt"}, {"format": 1}, ["pt"], "pt"])),
    st.tuples(st.just("bytes"), _small),
    st.tuples(st.just("length"), _small),
    st.tuples(st.just("flip"), st.integers(0, 400), st.integers(0, 255)))
INDEX = st.one_of(st.none(), st.dictionaries(_name, st.sampled_from(ENTRIES), min_size=1, max_size=3))


def _mutated_file(path: Path, mutations) -> None:
    """``TENSORS`` saved by safetensors, then its header and bytes mutated."""
    save_file(TENSORS, str(path), metadata={"format": "pt"})
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header, data = json.loads(raw[8:8 + length]), raw[8 + length:]
    delta, flips = 0, []
    for m in mutations:
        if m[0] in ("drop", "offsets", "shape", "dtype") and not isinstance(header[m[1]], dict):
            continue
        if m[0] == "drop":
            header[m[1]].pop(m[2], None)
        elif m[0] == "offsets" and isinstance(header[m[1]].get("data_offsets"), list):
            b, e = header[m[1]]["data_offsets"]
            header[m[1]]["data_offsets"] = [b + m[2], e + m[3]]
        elif m[0] in ("shape", "dtype"):
            header[m[1]][m[0]] = m[2]
        elif m[0] == "entry":
            header[m[1]] = m[2]
        elif m[0] == "metadata":
            header["__metadata__"] = m[1]
        elif m[0] == "bytes":
            data = data[:max(0, len(data) + m[1])] if m[1] < 0 else data + b"\x01" * m[1]
        elif m[0] == "length":
            delta = m[1]
        elif m[0] == "flip":
            flips.append(m[1:])
    text = bytearray(json.dumps(header).encode())
    for at, value in flips:
        text[at % len(text)] = value
    path.write_bytes(struct.pack("<Q", max(0, len(text) + delta)) + bytes(text) + data)


def _safetensors_reads(path: Path) -> dict | None:
    """What safetensors itself reads of the file (``None``: it refuses it)."""
    from safetensors.numpy import load_file

    try:
        return {k: v.tobytes() for k, v in load_file(str(path)).items()}
    except Exception:   # noqa: BLE001 - any refusal of safetensors' own reader
        return None


@settings(max_examples=150, deadline=None)
@given(mutations=st.lists(MUTATION, max_size=3), index=INDEX)
def test_any_header_or_index_gives_the_right_tensors_or_one_typed_line(mutations, index):
    import builtins
    import io
    import tempfile
    from unittest import mock

    with tempfile.TemporaryDirectory(prefix="ckpt-prop-") as tmp:
        root = Path(tmp).resolve()
        folder = root / "model"
        (folder / "sub").mkdir(parents=True)
        save_file({"b": B}, str(root / "x.safetensors"))
        save_file({"b": B}, str(folder / "sub" / "x.safetensors"))
        _mutated_file(folder / "model.safetensors", mutations)
        if index is not None:
            write_index(folder, {k: str(root / "x.safetensors") if v == "OUTSIDE" else v for k, v in index.items()})
        touched, real_open, real_stat = [], builtins.open, os.stat

        def opening(file, *a, **kw):
            touched.append(file)
            return real_open(file, *a, **kw)

        def stating(file, *a, **kw):
            touched.append(file)
            return real_stat(file, *a, **kw)

        with mock.patch.object(builtins, "open", opening), mock.patch.object(io, "open", opening), \
                mock.patch.object(os, "stat", stating):
            try:
                store = CheckpointStore(folder)
                got = {k: b"".join(store.stored_bytes(k)) for k in store.keys()}
            except ExportError as exc:   # CheckpointError, or a dtype the store does not convert
                assert "\n" not in str(exc) and str(exc), str(exc)
                got = None
        outside = [f for f in touched if isinstance(f, (str, Path)) and folder != Path(os.path.realpath(f))
                   and folder not in Path(os.path.realpath(f)).parents]
        assert outside == [], outside
        theirs = _safetensors_reads(folder / "model.safetensors")
        if got is not None:   # accepted: exactly what safetensors reads, the tensors the index names
            assert theirs is not None and all(got[k] == theirs[k] for k in got)
            assert index is None or set(index) <= set(got)
        elif index is None and not any(m[0] == "dtype" for m in mutations):
            assert theirs is None, "refused a file safetensors reads"
