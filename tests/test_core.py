"""The core layer's shared helpers, the one window a method observes, and the contracts of its pieces."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import criticalkv
from criticalkv import Method
from criticalkv.allocators import Allocator, UniformAllocator
from criticalkv.core.positions import positions_from_mask
from criticalkv.errors import MethodOptionError
from criticalkv.methods import method_spec
from criticalkv.scorers import DefensiveScorer, Scorer, SnapKVScorer, TOVAScorer
from criticalkv.selectors import CriticalSelector, DefensiveSelector, Selector, TopKSelector


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


@pytest.mark.parametrize(
    ("name", "options", "spec"),
    [
        ("critical-snapkv", {}, "critical-snapkv"),
        ("critical-snapkv", {"window": 8, "alpha": 0.25}, "critical-snapkv:alpha=0.25;window=8"),
        ("snapkv:window=8", {"kernel": 3}, "snapkv:kernel=3;window=8"),
        ("layer-reconstruct", {"softmax": "chunk"}, "layer-reconstruct:softmax=chunk"),
        ("critical-adakv", {"screen": False}, "critical-adakv:screen=false"),
        ("layer-surrogate", {}, "layer-surrogate"),  # its maps, attached per model, are no option
        ("critical-surrogate", {"sinks": 2}, "critical-surrogate:sinks=2"),
    ],
)
def test_a_methods_spec_builds_it_again_with_its_keyword_options(name, options, spec) -> None:
    method = criticalkv.build_method(name, **options)
    assert method_spec(method) == spec
    assert repr(criticalkv.build_method(spec).pieces) == repr(method.pieces)


def test_a_method_no_spec_can_say_has_none() -> None:
    assert method_spec(Method(SnapKVScorer(window=16), selector=CriticalSelector(window=16))) is None  # no preset
    mixed = criticalkv.build_method("critical-snapkv")
    mixed = Method(mixed.scorer, mixed.allocator, CriticalSelector(alpha=0.3), name="critical-snapkv")
    assert method_spec(mixed) == "critical-snapkv:alpha=0.3"
    apart = Method(SnapKVScorer(kernel=3), selector=CriticalSelector(), name="critical-snapkv")  # kernel 3 and 5
    assert method_spec(apart) is None  # "kernel=3" would set both pieces' kernel


class _Recent(Scorer):
    """A scorer of the user's own that states only its contract: recency, nothing protected."""

    def score(self, view):
        return torch.arange(view.keys.shape[2], dtype=torch.float32).expand(view.keys.shape[:3])

    def protected(self, view):
        return torch.zeros_like(view.valid)


def test_a_piece_deriving_from_its_contract_inherits_every_default() -> None:
    """The optional capabilities are members of the contracts, with defaults the runtime reads directly."""
    scorer, allocator, selector = Method(_Recent()).pieces
    assert scorer.window is None and not scorer.non_negative and not scorer.after_prefill
    assert scorer.supports_sliding_windows
    assert (allocator.cross_layer, allocator.streaming) == (False, False)
    assert not selector.needs_non_negative_scores and selector.window is None
    scores = torch.rand(1, 2, 5)
    assert selector.rank(scores, torch.tensor([3]), torch.zeros(1, 5, dtype=torch.bool), None) is scores
    for piece in (scorer, allocator, selector):
        assert piece.check_config(None) is None and piece.check_model(None) is None
    assert isinstance(UniformAllocator(), Allocator) and isinstance(TopKSelector(), Selector)


def test_a_piece_outside_its_contract_is_refused_with_the_way_in() -> None:
    class Bare:  # score and protected, but none of the optional members
        def score(self, view):
            return view.keys.new_zeros(view.keys.shape[:3])

        def protected(self, view):
            return torch.zeros_like(view.valid)

    with pytest.raises(MethodOptionError, match=r"derive it from criticalkv\.scorers\.Scorer"):
        Method(Bare())
    with pytest.raises(MethodOptionError, match=r"as the selector .* criticalkv\.selectors\.Selector"):
        Method(SnapKVScorer(), selector=Bare())
