"""Issue 22, class 6: numbers in disguise. Integers on the command line and in input files are ASCII digits and
integer dtypes, or a one-line refusal; nothing is written at the destination."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import _kv_graphs as kg
from qeff_kv.support import validate
from qeff_kv.contract.ccl import parse_ccl
from qeff_kv.errors import ExportError, RuntimeInputError
from qeff_kv.runtime.generate_job import parse_ids
from cli_checks import cli, one_error, tree

#: digits of other scripts (Arabic-Indic, Devanagari, fullwidth...): int() reads them, qeff-kv does not
_NON_ASCII_DIGITS = st.text(alphabet=st.characters(categories=["Nd"]), min_size=1, max_size=6).filter(
    lambda s: not s.isascii())
#: texts int() accepts that are not plain ASCII digits
_DISGUISED = st.one_of(_NON_ASCII_DIGITS, st.sampled_from(["1_000", "+5", " 7", "8 ", "0x10", "１６"]))
_QUICK = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    return kg.save(kg.build(2), tmp_path_factory.mktemp("numbers") / "model.onnx")


@_QUICK
@given(text=_DISGUISED)
def test_library_parsers_take_ascii_digits_only(text):
    with pytest.raises(RuntimeInputError) as exc:
        validate.ascii_int("n", text)
    assert str(exc.value) == f"n: {text!r} is not an integer (ASCII digits 0-9)"
    if re.fullmatch(r"[0-9]+", text.strip()):
        return   # blanks around a comma-separated value are separators, not part of it
    with pytest.raises(RuntimeInputError) as exc:
        parse_ccl(f"{text},32", 64)
    assert str(exc.value) == f"--ccl values must be positive integers, got {text.strip()!r}"
    if " " not in text:
        with pytest.raises(RuntimeInputError) as exc:
            parse_ids(f"1,{text}")
        assert str(exc.value) == f"--prompt-ids '1,{text}': {text.strip()!r} is not an integer (ASCII digits 0-9)"


@given(n=st.integers(min_value=-(2**70), max_value=2**70))
def test_ascii_integers_still_parse(n):
    assert validate.ascii_int("n", str(n)) == n


@_QUICK
@given(text=_NON_ASCII_DIGITS)
def test_cli_integer_options_refuse_non_ascii_digits(graph, tmp_path, text):
    before = tree(tmp_path)
    one_error(cli("buffers", graph, "--ctx-len", text), "--ctx-len", "is not an integer (ASCII digits 0-9)")
    one_error(cli("compile-config", graph, "-o", tmp_path / "cfg", "--prefill-seq-len", "8", "--ctx-len", text),
              "--ctx-len", "is not an integer")
    one_error(cli("generate", graph, "--prompt-ids", "1", "--max-new-tokens", text), "--max-new-tokens")
    one_error(cli("generate", graph, "--prompt-ids", "1", "--temperature", text), "--temperature",
              "is not a decimal number")
    assert tree(tmp_path) == before


def test_ccl_with_arabic_indic_digits_is_refused_by_export_and_compile_config(tmp_path):
    msg = one_error(cli("export", "-o", tmp_path / "out", "--ctx-len", "64", "--prefill-seq-len", "8",
                        "--ccl", "١٦,32"))
    assert msg == "error: --ccl values must be positive integers, got '١٦'"
    with pytest.raises(ExportError, match=r"^--ccl values must be positive integers, got '١٦'$"):
        from qeff_kv.export import export_model

        export_model(None, tmp_path / "out", ctx_len=64, prefill_seq_len=8, ccl="١٦,32")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("ids,message", [
    (np.array([[1.0, 2.5, 3.0]]), "input_ids must be an integer array, got dtype float64"),
    (np.array([["1", "2"]]), "input_ids must be an integer array, got dtype <U1"),
    (np.array([[True, False]]), "input_ids must be an integer array, got dtype bool"),
    (np.array([[1, -3]]), "input_ids holds negative token id -3"),
])
def test_image_inputs_token_ids_are_integers(graph, tmp_path, ids, message):
    npz = tmp_path / "in.npz"
    np.savez(npz, input_ids=ids, pixel_values=np.zeros((1, 3, 4, 4), np.float32))
    before = tree(tmp_path)
    line = one_error(cli("generate", graph, "--image-inputs", npz))
    assert line == f"error: --image-inputs {npz}: {message}"
    assert tree(tmp_path) == before


@_QUICK
@given(ids=st.lists(st.floats(allow_nan=False, allow_infinity=False, width=32), min_size=1, max_size=8))
def test_float_token_ids_in_an_npz_are_never_cut(graph, tmp_path, ids):
    npz = tmp_path / "in.npz"
    np.savez(npz, input_ids=np.array([ids], np.float32), pixel_values=np.zeros((1, 3, 4, 4), np.float32))
    line = one_error(cli("generate", graph, "--image-inputs", npz))
    assert line == f"error: --image-inputs {npz}: input_ids must be an integer array, got dtype float32"
