"""One budget for every loop (issue 48): the room a request has in the context and the budget it takes are computed
by :mod:`qeff_kv.runtime.decoding.stopping` alone (``context_room``, ``token_budget``), for the library's loops
(``Session.generate``/``stream``, ``SpeculativeDecoder``) and the server's; and one name for the quantity,
``max_tokens``, with ``max_new_tokens`` a deprecated alias for one release."""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

import pytest

from qeff_kv.runtime import Session
from qeff_kv.runtime.decoding import decode_loop, speculative, stopping
from qeff_kv.serve.engine import active
from ring_graphs import PROMPT, ring_graph

PKG = Path(__file__).resolve().parents[2] / "qeff_kv"
#: where room and budget arithmetic against the context length may be written
HOME = {"runtime/decoding/stopping.py"}
#: names that say an expression is about a request's new tokens
BUDGET_NAMES = {"max_tokens", "max_new_tokens", "budget", "need", "room", "left", "new_tokens"}


def _is_ctx(node: ast.AST) -> bool:
    """The context length: ``ctx_len`` (a name or an attribute, ``session.ctx_len``) or a name like ``ctx``."""
    if isinstance(node, ast.Name):
        return node.id in ("ctx", "ctx_len") or node.id.endswith("_ctx_len")
    return isinstance(node, ast.Attribute) and node.attr == "ctx_len"


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | \
        {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}


def own_room_arithmetic(source: str) -> list[str]:
    """Each place ``source`` computes a room or a budget against the context length itself: ``ctx_len - x`` or
    ``x +/- ctx_len`` with ``x`` not a constant (``ctx_len - 1``, the last slot, is a position, not a room), or a
    comparison of the context length with an expression of a request's new tokens (``need > ctx_len``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):
            ctx, other = ((node.left, node.right) if _is_ctx(node.left) else
                          (node.right, node.left) if _is_ctx(node.right) else (None, None))
            if ctx is not None and not isinstance(other, ast.Constant):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_is_ctx(s) for s in sides) and any(_names(s) & BUDGET_NAMES for s in sides if not _is_ctx(s)):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_loop_computes_its_own_room():
    """An AST scan of the runtime and the server: room and budget arithmetic against the context length lives in
    stopping.py only."""
    flagged = {}
    for path in sorted([*(PKG / "runtime").rglob("*.py"), *(PKG / "serve").rglob("*.py")]):
        rel = str(path.relative_to(PKG))
        if rel in HOME:
            continue
        if found := own_room_arithmetic(path.read_text()):
            flagged[rel] = found
    assert flagged == {}


def test_the_scan_sees_the_formulas_the_loops_had():
    """What the library's loops computed before (decode_loop's budget, the speculative decoder's refusal and its
    drafter's cap) is flagged; positions and whole-prompt checks are not."""
    assert own_room_arithmetic("budget = max(0, max_new_tokens - (need - self.session.ctx_len))")
    assert own_room_arithmetic("k = min(k, s.ctx_len - len(context) + 1)")
    assert own_room_arithmetic("if need > s.ctx_len:\n    pass")
    assert own_room_arithmetic("room = min(s.ctx_len - r.seq.length for r in rows)")
    assert not own_room_arithmetic("width = min(self.session.prefill_seq_len, self.session.ctx_len - 1)")
    assert not own_room_arithmetic("if len(prompt) > ctx_len:\n    pass")
    assert not own_room_arithmetic("room = context_room(ctx_len, fed)")


def test_every_loop_uses_the_shared_functions():
    for module in (decode_loop, speculative):
        assert module.context_room is stopping.context_room, module.__name__
    assert decode_loop.token_budget is active.token_budget is stopping.token_budget
    assert active.context_room is stopping.context_room


def test_the_library_loop_takes_its_room_from_context_room(tmp_path, monkeypatch):
    """Behaviour: the budget of ``Session.generate`` follows ``context_room`` (a room two tokens shorter gives two
    tokens fewer, ending as ``"capacity"``), and what it fits is what the shared rule says."""
    s = Session(ring_graph(tmp_path), ctx_len=32)
    fed = len(PROMPT)
    room = stopping.context_room(s.ctx_len, fed)
    [g] = s.generate([PROMPT], max_tokens=room, stop_tokens=[])
    assert (len(g.tokens), g.finish_reason) == (room, "length")
    s.remove_sequence(g.sequence)
    with pytest.raises(Exception, match="need 33 positions; the capacity is ctx_len=32"):
        s.generate([PROMPT], max_tokens=room + 1, stop_tokens=[])
    calls = []
    monkeypatch.setattr(decode_loop, "context_room", lambda ctx, fed: calls.append((ctx, fed)) or
                        stopping.context_room(ctx, fed) - 2)
    [g] = s.generate([PROMPT], max_tokens=room, stop_tokens=[], on_capacity="stop")
    assert calls == [(s.ctx_len, fed)]
    assert (len(g.tokens), g.finish_reason) == (room - 2, "capacity")


def test_max_new_tokens_is_a_deprecated_alias_of_max_tokens(tmp_path):
    s = Session(ring_graph(tmp_path), ctx_len=32)
    [new] = s.generate([PROMPT], max_tokens=3, stop_tokens=[])
    s.remove_sequence(new.sequence)
    with pytest.warns(DeprecationWarning, match="max_new_tokens is deprecated: use max_tokens"):
        [old] = s.generate([PROMPT], max_new_tokens=3, stop_tokens=[])
    assert old.tokens == new.tokens and old.finish_reason == new.finish_reason
    s.remove_sequence(old.sequence)
    with pytest.warns(DeprecationWarning):
        events = list(s.stream([PROMPT], max_new_tokens=2, stop_tokens=[]))
    assert [e.token for e in events] == new.tokens[:2]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s.remove_sequence(events[0].sequence)
        s.generate([PROMPT], max_tokens=1, stop_tokens=[])   # the new name warns nothing


def test_the_cli_takes_max_tokens_and_its_hidden_deprecated_alias(tmp_path):
    from click.testing import CliRunner

    from qeff_kv_cli.generate_cmd import generate_cmd

    graph, ids = str(ring_graph(tmp_path)), ",".join(map(str, PROMPT))
    run = CliRunner().invoke
    new = run(generate_cmd, [graph, "--ctx-len", "32", "--prompt-ids", ids, "--max-tokens", "3", "--json"])
    old = run(generate_cmd, [graph, "--ctx-len", "32", "--prompt-ids", ids, "--max-new-tokens", "3", "--json"])
    assert new.exit_code == old.exit_code == 0, (new.output, old.output)
    assert '"tokens"' in new.stdout and new.stdout.split('"timings"')[0] == old.stdout.split('"timings"')[0]
    both = run(generate_cmd, [graph, "--prompt-ids", ids, "--max-tokens", "3", "--max-new-tokens", "3"])
    assert both.exit_code == 2 and "not both" in both.output
    assert "--max-new-tokens" not in run(generate_cmd, ["--help"]).output


def test_the_generate_request_takes_max_tokens_and_its_deprecated_alias():
    from qeff_kv.runtime.generate_job import GenerateRequest

    assert GenerateRequest("m").max_tokens == 64 and GenerateRequest("m", max_tokens=3).max_tokens == 3
    with pytest.warns(DeprecationWarning, match="max_new_tokens is deprecated"):
        assert GenerateRequest("m", max_new_tokens=5).max_tokens == 5
