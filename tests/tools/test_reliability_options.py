"""Issue 31, item 11: ``compile-config --speculative-tokens`` beyond the graph's K, or a K+1 wider than the
context, is refused in one line instead of written."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from qeff_kv.tools.compile_config import resolve_speculative, specializations
from qeff_kv.errors import RuntimeInputError


def _layout(k):
    return SimpleNamespace(speculative=True, speculative_tokens=k)


def test_speculative_tokens_beyond_the_graphs_k_are_refused():
    assert resolve_speculative(_layout(4)) == 4
    assert resolve_speculative(_layout(4), 3) == 3          # fewer drafts than exported for: fine
    with pytest.raises(RuntimeInputError, match=r"^--speculative-tokens 5 is larger than the K=4 the graph was "
                                                r"exported for \(its decode verifies at most K drafts\)$"):
        resolve_speculative(_layout(4), 5)
    assert resolve_speculative(_layout(None), 9) == 9       # a graph that records no K: the user's word


def test_a_decode_step_wider_than_the_context_is_refused():
    spec = specializations(8, 16, speculative_tokens=15)
    assert spec["specializations"][1]["seq_len"] == "16"
    with pytest.raises(RuntimeInputError, match=r"^speculative_tokens 16: a decode step of K\+1 = 17 positions does "
                                                r"not fit ctx_len 16$"):
        specializations(8, 16, speculative_tokens=16)
