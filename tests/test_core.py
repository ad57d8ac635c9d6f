"""The core layer's shared helpers, and the one window a method observes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import criticalkv
from criticalkv import Method
from criticalkv.core.positions import positions_from_mask
from criticalkv.errors import MethodOptionError
from criticalkv.scorers import DefensiveScorer, SnapKVScorer, TOVAScorer
from criticalkv.selectors import CriticalSelector, DefensiveSelector


@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 6)), min_size=1, max_size=4))
def test_positions_count_the_real_tokens_of_each_left_padded_row(rows) -> None:
    width = max(pad + real for pad, real in rows)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for r, (_pad, real) in enumerate(rows):
        mask[r, width - real :] = 1
    positions = positions_from_mask(mask)
    for r, (_pad, real) in enumerate(rows):
        assert positions[r, width - real :].tolist() == list(range(real))  # the real tokens: 0, 1, ...
        assert positions[r, : width - real].eq(0).all()  # padding at 0


def test_a_method_with_two_windows_is_refused() -> None:
    """The window is one number per method: pieces that state different ones were accepted silently, each then
    reading its own number of queries."""
    with pytest.raises(MethodOptionError, match="the scorer's 16, the selector's 4"):
        Method(DefensiveScorer(window=16), selector=DefensiveSelector(window=4))
    with pytest.raises(MethodOptionError, match="one window"):
        Method(SnapKVScorer(window=16), selector=CriticalSelector())  # the selector's default, 32


def test_the_method_states_its_window() -> None:
    assert Method(SnapKVScorer(window=16), selector=CriticalSelector(window=16)).window == 16
    assert Method(TOVAScorer(), selector=CriticalSelector(window=8)).window == 8  # TOVA reads no window
    assert Method(TOVAScorer()).window is None
    assert criticalkv.build_method("critical-snapkv", window=64).window == 64
    assert criticalkv.build_method("critical-snapkv", window=64).query_rows == 64
