"""Issue 22, class 7: every public entry point checks its arguments and raises a ``QeffKvError`` subclass naming
the argument (never a bare ``TypeError``); flags are real booleans (``"no"`` is refused, not taken as true)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import _kv_graphs as kg
from qeff_kv.tools import buffers, compile_from_graph, rewrite
from qeff_kv.tools import check as check
from qeff_kv import errors
from qeff_kv.support import validate
from qeff_kv.export import export_model
from qeff_kv.runtime import Session, VisionLanguageModel
from qeff_kv.runtime.generate_job import GenerateRequest, run_generate
from cli_checks import tree
from ring_graphs import PROMPT, ring_graph

OK = dict(ctx_len=64, prefill_seq_len=8)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("api")
    return {"graph": kg.save(kg.build(2), root / "m.onnx"), "ring": ring_graph(root / "ring"), "root": root}


def _cases(f):
    g, r, root = f["graph"], f["ring"], f["root"]
    E, R = errors.ExportError, errors.RuntimeInputError
    return [
        # export_model
        (lambda: export_model(123, root / "o"), E, "model must be a path (str or os.PathLike), got int 123"),
        (lambda: export_model(None, 5), E, "out_dir must be a path (str or os.PathLike), got int 5"),
        (lambda: export_model(None, root / "o", progress=5, **OK), E, "progress must be a callable or None, got int 5"),
        (lambda: export_model(None, root / "o", verify="no", **OK), E, "verify must be True, False or None, got 'no'"),
        (lambda: export_model(None, root / "o", continuous_batching="no", full_batch_size=2, **OK), E,
         "continuous_batching must be True or False, got 'no'"),
        (lambda: export_model(None, root / "o", force=1, **OK), E, "force must be True or False, got 1"),
        (lambda: export_model(None, root / "o", single_graph="no", **OK), E, "single_graph must be True or False, got 'no'"),
        (lambda: export_model(None, root / "o", target="onnxruntime", weights="int4", block_size="32", **OK), E,
         "block_size must be an integer, got str '32'"),
        (lambda: export_model(None, root / "o", image_size=4.0, **OK), E, "image_size must be an integer, got float 4.0"),
        # Session / VisionLanguageModel / generate
        (lambda: Session(r, image_token_id="a"), R, "image_token_id must be an integer, got str 'a'"),
        (lambda: Session(r, image_token_id=-5), R, "image_token_id must be an integer >= 0, got -5"),
        (lambda: Session(123), R, "model must be a path (str or os.PathLike), got int 123"),
        (lambda: Session(r, ctx_len=32, inplace="no"), R, "inplace must be True, False or None, got 'no'"),
        (lambda: Session(r, ctx_len="32"), R, "ctx_len must be an integer, got str '32'"),
        (lambda: Session(r, ctx_len=32, sliding_window=6.0), R, "sliding_window must be an integer, got float 6.0"),
        (lambda: Session(r, ctx_len=32, threads=True), R, "threads must be an integer, got bool True"),
        (lambda: Session(r, ctx_len=32, providers="CPUExecutionProvider"), R,
         "providers must be a list of onnxruntime provider names, got 'CPUExecutionProvider'"),
        (lambda: VisionLanguageModel(5), R, "model must be a path (str or os.PathLike), got int 5"),
        (lambda: Session(r, ctx_len=32).generate([PROMPT], max_new_tokens=1, callback=5), R,
         "callback must be a callable or None, got int 5"),
        (lambda: run_generate(GenerateRequest(model=r, prompt_ids=[[1]], ctx_len=32, chat="no")), R,
         "chat must be True or False, got 'no'"),
        (lambda: run_generate(GenerateRequest(model=r, prompts="hello", ctx_len=32)), R,
         "prompts must be a list of strings, got 'hello'"),
        # graph tools
        (lambda: rewrite.rewrite(5, root / "x.onnx", prefix="A"), errors.RewriteError,
         "src must be a path (str or os.PathLike), got int 5"),
        (lambda: rewrite.rewrite(g, root / "x.onnx", strip="no"), errors.RewriteError,
         "strip must be True or False, got 'no'"),
        (lambda: rewrite.rewrite(g, root / "x.onnx", prefix="A", in_place="no"), errors.RewriteError,
         "in_place must be True or False, got 'no'"),
        (lambda: check.check(5), errors.GraphReadError, "path must be a path (str or os.PathLike), got int 5"),
        (lambda: check.check(g, skip_checker="no"), R, "skip_checker must be True or False, got 'no'"),
        (lambda: buffers.buffers_report(5), R, "path must be a path (str or os.PathLike), got int 5"),
        (lambda: buffers.buffers_report(g, regex=5), R, "regex must be a string, got int 5"),
        (lambda: compile_from_graph.write_compile_config_for_graph(g, 5, prefill_seq_len=8, ctx_len=64), R,
         "out_dir must be a path (str or os.PathLike), got int 5"),
    ]


def test_every_entry_point_refuses_wrong_kinds_naming_the_argument(files):
    before = tree(files["root"])
    for call, kind, message in _cases(files):
        with pytest.raises(errors.QeffKvError) as exc:
            call()
        assert type(exc.value) is kind, (message, type(exc.value))
        assert str(exc.value) == message
    assert tree(files["root"]) == before   # nothing written, nothing changed


@settings(max_examples=60, deadline=None)
@given(value=st.one_of(st.text(max_size=5), st.integers(), st.floats(allow_nan=False), st.none(), st.lists(st.booleans(), max_size=2)))
def test_flags_are_real_booleans(value):
    if isinstance(value, bool):
        return
    with pytest.raises(errors.RuntimeInputError) as exc:
        validate.flag("verify", value)
    assert str(exc.value) == f"verify must be True or False, got {value!r}"
    if value is None:
        assert validate.flag("verify", value, optional=True) is None


@settings(max_examples=60, deadline=None)
@given(value=st.integers(max_value=-1))
def test_negative_token_ids_are_reported_as_given(value):
    with pytest.raises(errors.RuntimeInputError) as exc:
        validate.token_id("image_token_id", value)
    assert str(exc.value) == f"image_token_id must be an integer >= 0, got {value}"
