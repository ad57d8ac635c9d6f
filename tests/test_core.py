"""The one window a method observes, and the core layer's shared helpers."""

from __future__ import annotations

import pytest

import criticalkv
from criticalkv import Method
from criticalkv.errors import MethodOptionError
from criticalkv.scorers import DefensiveScorer, SnapKVScorer, TOVAScorer
from criticalkv.selectors import CriticalSelector, DefensiveSelector


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
