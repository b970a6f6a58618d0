"""``rewrite --to`` (issue 49): the conversion alone or with a prefix change, through the API and the CLI (exit 0
done, 2 refused, one line), ``check`` passing on what it wrote."""

from __future__ import annotations

import pytest

import dialect_loops
from cli_checks import cli, one_error
from growing_graph import growing_graph
from qeff_kv.contract import naming
from qeff_kv.errors import DialectError, RewriteError
from qeff_kv.graph import graphio
from qeff_kv.tools.check import check
from qeff_kv.tools.rewrite import rewrite

CAP = 16
PROMPT = [7, 1, 30, 12]


@pytest.fixture(scope="module")
def static_graph(tmp_path_factory):
    return dialect_loops.static_cache_graph(tmp_path_factory.mktemp("static") / "static.onnx", capacity=CAP, seed=3)


def test_to_retained_alone_keeps_tokens(static_graph, tmp_path):
    res = rewrite(static_graph, tmp_path / "r.onnx", to=naming.RETAINED_STATE)
    assert (res.old_dialect, res.dialect) == (naming.STATIC_CACHE, naming.RETAINED_STATE)
    assert ("key_cache.0", "past_key.0") in res.renamed and res.prefix is None
    assert "converted the KV cache from static-cache to retained-state" in res.summary()
    assert check(tmp_path / "r.onnx", expected_prefix=None).ok
    assert (dialect_loops.greedy_loop(tmp_path / "r.onnx", PROMPT, 8, capacity=CAP)
            == dialect_loops.greedy_loop(static_graph, PROMPT, 8, capacity=CAP))


def test_to_with_prefix_and_kept_prefix(static_graph, tmp_path):
    rewrite(static_graph, tmp_path / "r.onnx", to=naming.RETAINED_STATE, prefix="ABC")
    assert graphio.layout_of(graphio.load(tmp_path / "r.onnx")).prefixes == ["ABC"]
    rewrite(tmp_path / "r.onnx", tmp_path / "pp.onnx", to="shared-past-present")
    layout = graphio.layout_of(graphio.load(tmp_path / "pp.onnx"))
    assert (layout.dialect, layout.prefixes, layout.update) == (naming.PAST_PRESENT, ["ABC"], "shared-buffer")
    assert "present.1.value_ABC" in layout.kv_names
    rewrite(tmp_path / "pp.onnx", tmp_path / "back.onnx", to=naming.RETAINED_STATE)
    names = lambda p: [v.name for v in graphio.load(p).graph.inputs]  # noqa: E731
    assert names(tmp_path / "back.onnx") == names(tmp_path / "r.onnx")
    assert check(tmp_path / "back.onnx", expected_prefix="ABC").ok


def test_refusals(static_graph, tmp_path):
    with pytest.raises(DialectError, match="grows by concatenation"):
        rewrite(growing_graph(tmp_path / "g.onnx"), tmp_path / "out.onnx", to=naming.RETAINED_STATE)
    with pytest.raises(DialectError, match="unknown KV dialect"):
        rewrite(static_graph, tmp_path / "out.onnx", to="paged")
    with pytest.raises(RewriteError, match="nothing to do"):
        rewrite(static_graph, tmp_path / "out.onnx")
    assert not (tmp_path / "out.onnx").exists()


def test_cli_exit_codes(static_graph, tmp_path):
    res = cli("rewrite", static_graph, "-o", tmp_path / "r.onnx", "--to", "retained-state")
    assert res.exit_code == 0, res.output
    assert cli("check", tmp_path / "r.onnx").exit_code == 0
    one_error(cli("rewrite", growing_graph(tmp_path / "g.onnx"), "-o", tmp_path / "x.onnx", "--to",
                  "retained-state"), "grows by concatenation")
    one_error(cli("rewrite", tmp_path / "r.onnx", "-o", tmp_path / "x.onnx", "--to", "static-cache"), "not a qeff-kv export")
    assert not (tmp_path / "x.onnx").exists()
