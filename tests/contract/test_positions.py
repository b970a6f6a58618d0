"""Multimodal RoPE bookkeeping without a model: ``qeff_kv.contract.mrope`` (rows and per-image marks) and
``qeff_kv.runtime.multimodal.positions`` (position_ids, marks through rewinds and state files). Property tests: the per-image
marks agree with the rows ``prompt_positions`` computes, whatever the text and images around them."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from qeff_kv.contract import mrope
from qeff_kv.errors import StateFileError
from qeff_kv.runtime.multimodal import positions

IMAGE = 99


@st.composite
def prompts(draw):
    """(tokens, grids, merge): text runs and images of random grids (merge 1 or 2)."""
    merge = draw(st.sampled_from([1, 2]))
    tokens, grids = [], []
    for _ in range(draw(st.integers(0, 3))):
        tokens += draw(st.lists(st.integers(0, 50), min_size=1, max_size=6))
        grid = [draw(st.integers(1, 2)), merge * draw(st.integers(1, 3)), merge * draw(st.integers(1, 3))]
        grids.append(grid)
        tokens += [IMAGE] * (grid[0] * (grid[1] // merge) * (grid[2] // merge))
    tokens += draw(st.lists(st.integers(0, 50), min_size=1, max_size=6))
    return tokens, grids, merge


@settings(max_examples=200, deadline=None)
@given(prompts())
def test_marks_agree_with_the_rows(case):
    tokens, grids, merge = case
    rows, delta = mrope.prompt_positions(tokens, IMAGE, grids, merge)
    marks = mrope.image_marks(tokens, IMAGE, grids, merge)
    assert len(marks) == len(grids)
    for start, end, d in marks:
        assert all(t == IMAGE for t in tokens[start:end])
        assert tokens[end] != IMAGE          # the prompt ends with text (the strategy's last run)
        assert (rows[:, end] == end + d).all()   # the text after each image sits at index + delta
    assert (marks[-1][2] if marks else 0) == delta
    # text tokens: all three rows equal; an image's rows start at the text position before it + 1
    for i, t in enumerate(tokens):
        if t != IMAGE:
            assert rows[0, i] == rows[1, i] == rows[2, i]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 30), st.integers(1, 8), st.integers(-20, 5)), max_size=4),
       st.integers(0, 80))
def test_rewind_keeps_the_marks_before_and_refuses_a_cut(spans, n):
    marks, at = [], 0
    for gap, length, d in spans:
        marks.append(positions.RopeMark(at + gap, at + gap + length, d))
        at += gap + length
    why = positions.rewind_refusal(marks, n)
    inside = [m for m in marks if m.start < n < m.end]
    assert (why is not None) == bool(inside)
    if why is None:
        kept = positions.rewind(marks, n)
        assert kept == [m for m in marks if m.end <= n]
        assert positions.delta(kept) == (kept[-1].delta if kept else 0)


def test_write_fills_text_and_rope_rows():
    pos = np.zeros(positions.shape(True, 2, 4), np.int64)
    positions.clear(pos)
    positions.write(pos, 1, 10, 3, delta=-4)
    assert pos[:, 1].tolist() == [[10, 11, 12, -1], [6, 7, 8, 0], [6, 7, 8, 0], [6, 7, 8, 0]]
    rope = np.array([[3, 3, 3], [3, 4, 5], [7, 8, 9]])
    positions.write(pos, 0, 0, 3, rope=rope)
    assert pos[0, 0].tolist() == [0, 1, 2, -1] and pos[1:, 0, :3].tolist() == rope.tolist()
    flat = np.zeros(positions.shape(False, 1, 3), np.int64)
    positions.clear(flat)
    positions.write(flat, 0, 5, 2, delta=9)   # no RoPE rows: the delta does not apply
    assert flat.tolist() == [[5, 6, -1]]


def test_state_marks_round_trip_and_refusals():
    marks = [positions.RopeMark(3, 7, -2), positions.RopeMark(10, 14, -4)]
    meta = positions.state_metadata(marks)
    assert positions.read_state_marks(meta, 20, "s") == marks
    assert positions.state_metadata([]) == {} and positions.read_state_marks({}, 5, "s") == []
    with pytest.raises(StateFileError, match=r"^s: malformed state metadata \(rope_marks\)$"):
        positions.read_state_marks({"rope_marks": "[[1, 2]]"}, 20, "s")
    with pytest.raises(StateFileError, match=r"^s: malformed state metadata \(rope_marks outside the valid length 12\)$"):
        positions.read_state_marks(meta, 12, "s")
