"""The bfloat16 screen of CriticalKV's float32 value norms: its error bound holds, and the screened stage 2 chooses
what stage 2 with every float32 norm chooses (the reference), with and without entries the screen cannot settle."""

from __future__ import annotations

import math
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from criticalkv.scorers import LayerView
from criticalkv.selectors import CriticalSelector, norm_screen, projected_value_norm
from criticalkv.selectors import critical as critical_module
from criticalkv.selectors.base import take_top


class _Attn(nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.o_proj = nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
        with torch.no_grad():
            self.o_proj.weight.copy_(weight)
        self.layer_idx = 0


def _bf16_layer(
    gen: torch.Generator, b: int, h_kv: int, g: int, t: int, d: int, hidden: int, spread: float, zeros: bool = True
):
    """bfloat16 values whose rows span ``spread`` orders of magnitude (every 7th zero with ``zeros``), and a
    bfloat16 output projection."""
    scale = 10.0 ** (spread * (torch.rand(b, h_kv, t, 1, generator=gen) - 0.5))
    values = (torch.randn(b, h_kv, t, d, generator=gen) * scale).bfloat16()
    if zeros:
        values[:, :, ::7] = 0.0  # zero rows: norm 0, ties at weight * 0
    weight = (torch.randn(hidden, h_kv * g * d, generator=gen) * 0.05).bfloat16()
    return values, weight


def _left_padded(b: int, t: int, gen: torch.Generator) -> torch.Tensor:
    lengths = torch.randint(1, t + 1, (b,), generator=gen)
    lengths[0] = t
    return torch.arange(t)[None, :] >= (t - lengths)[:, None]  # (b, t)


def _chosen_scores(keep: torch.Tensor, scores: torch.Tensor) -> list[list[list[float]]]:
    """Each head's chosen scores, sorted: the comparison that ties between equal scores cannot upset."""
    return [[sorted(scores[i, j][keep[i, j]].tolist()) for j in range(keep.shape[1])] for i in range(keep.shape[0])]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    h_kv=st.integers(1, 3),
    g=st.integers(1, 4),
    d=st.sampled_from([4, 16, 64]),
    hidden=st.integers(8, 96),
    spread=st.floats(0.0, 12.0),
)
def test_bfloat16_norms_lie_within_the_screen_bound(seed, h_kv, g, d, hidden, spread):
    gen = torch.Generator().manual_seed(seed)
    values, weight = _bf16_layer(gen, 2, h_kv, g, 40, d, hidden, spread)
    exact = projected_value_norm(values, weight)  # float32 products
    rough = projected_value_norm(values, weight, compute_dtype=None)  # bfloat16 products
    bound_rough, slack = norm_screen.norm_bounds(values, weight)
    assert torch.equal(bound_rough, rough)
    assert bool(((rough - exact).abs() <= slack).all())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    b=st.integers(1, 3),
    h_kv=st.integers(1, 3),
    g=st.integers(1, 3),
    t=st.integers(1, 48),
    levels=st.sampled_from([0, 3, 1000]),
    loose=st.booleans(),
)
def test_screened_stage2_chooses_what_float32_norms_choose(seed, b, h_kv, g, t, levels, loose):
    """Against ``take_top`` over every float32 norm; ``levels`` quantises the weights (0: all equal, so the norms
    alone decide; 3: many ties), ``loose`` widens the bound until nothing is settled (every entry recomputed)."""
    gen = torch.Generator().manual_seed(seed)
    values, weight = _bf16_layer(gen, b, h_kv, g, t, 8, 24, 4.0)
    weights = torch.rand(b, h_kv, t, generator=gen)
    weights = (weights * levels).floor() / max(levels, 1) + 1e-4 if levels else torch.ones(b, h_kv, t)
    valid = _left_padded(b, t, gen)
    keep = (torch.rand(b, h_kv, t, generator=gen) < 0.2) & valid[:, None, :]
    need = torch.randint(0, t + 2, (b, h_kv), generator=gen)
    exact = weights * projected_value_norm(values, weight)  # (b, h_kv, t)
    want = take_top(exact, keep, valid, need)
    with mock.patch.object(norm_screen, "REL", 1.0 if loose else norm_screen.REL):
        bounds = norm_screen.norm_bounds(values, weight)
        got = norm_screen.take_top_by_value_norm(weights, bounds, values, weight, keep, valid, need)
    assert torch.equal(got.sum(-1), want.sum(-1))
    assert bool((got >= keep).all())
    assert _chosen_scores(got, exact) == _chosen_scores(want, exact)


def _bf16_view(b: int, h_kv: int, g: int, t: int, d: int, hidden: int, seed: int, device: str = "cpu") -> LayerView:
    gen = torch.Generator().manual_seed(seed)
    values, weight = _bf16_layer(gen, b, h_kv, g, t, d, hidden, 3.0, zeros=False)  # no ties: masks compare
    query = torch.randn(b, h_kv * g, t, d, generator=gen).bfloat16()
    keys = torch.randn(b, h_kv, t, d, generator=gen).bfloat16()
    valid = _left_padded(b, t, gen)
    tensors = [x.to(device) for x in (query, keys, values, valid)]
    return LayerView(_Attn(weight).to(device), *tensors, 1.0 / math.sqrt(d))


@pytest.mark.parametrize("stage2", ["scores", "unpooled"])
def test_critical_selector_screened_equals_unscreened(stage2, monkeypatch):
    """The selector with the screen (forced on, whatever this CPU does in bfloat16) keeps the very entries it keeps
    with every float32 norm, on a padded batch with per-head budgets."""
    calls = []
    screened = norm_screen.take_top_by_value_norm
    monkeypatch.setattr(critical_module, "screens", lambda values: True)
    monkeypatch.setattr(critical_module, "take_top_by_value_norm", lambda *a: calls.append(1) or screened(*a))
    b, h_kv, t = 3, 2, 96
    for seed in range(4):
        view = _bf16_view(b, h_kv, 3, t, 16, 40, seed)
        scores = torch.rand(b, h_kv, t, generator=torch.Generator().manual_seed(seed)) ** 4
        protected = torch.zeros(b, t, dtype=torch.bool)
        protected[:, -8:] = True
        budgets = torch.randint(1, t, (b, h_kv), generator=torch.Generator().manual_seed(50 + seed))
        kwargs = dict(stage2=stage2, window=8, kernel=3)
        got = CriticalSelector(**kwargs).select(scores, budgets, protected, view)
        want = CriticalSelector(screen=False, **kwargs).select(scores, budgets, protected, view)
        assert torch.equal(got, want), seed
    assert len(calls) == 4


def test_screen_is_skipped_where_it_cannot_pay(monkeypatch):
    """float32 values, ``norm_dtype="model"``, per-head norms and norms another method already computed for the view
    all take the unscreened path."""
    monkeypatch.setattr(critical_module, "screens", norm_screen.screens)
    view = _bf16_view(1, 2, 2, 32, 8, 16, seed=0)
    assert not norm_screen.screens(view.values.float())
    assert norm_screen.screens(view.values) == norm_screen.cpu_multiplies_bfloat16()
    monkeypatch.setattr(critical_module, "screens", lambda values: True)
    assert CriticalSelector()._screens(view)
    assert not CriticalSelector(screen=False)._screens(view)
    assert not CriticalSelector(norm_dtype="model")._screens(view)
    assert not CriticalSelector(value_norm="per_head")._screens(view)
    view.remember(("value_norm", torch.float32), lambda: projected_value_norm(view.values, view.o_proj_weight))
    assert not CriticalSelector()._screens(view)


def test_screen_bounds_are_computed_once_per_view(monkeypatch):
    """A prefill compressed for several budgets (a sweep) computes the bfloat16 norms and their bound once."""
    calls = []
    bounds = norm_screen.norm_bounds
    monkeypatch.setattr(critical_module, "screens", lambda values: True)
    monkeypatch.setattr(critical_module, "norm_bounds", lambda *a: calls.append(1) or bounds(*a))
    view = _bf16_view(2, 2, 2, 64, 8, 24, seed=3)
    scores = torch.rand(2, 2, 64, generator=torch.Generator().manual_seed(4))
    protected = torch.zeros(2, 64, dtype=torch.bool)
    got = [CriticalSelector().select(scores, torch.full((2, 2), n), protected, view) for n in (6, 13, 40)]
    assert len(calls) == 1
    for n, mask in zip((6, 13, 40), got, strict=True):
        assert torch.equal(mask, CriticalSelector(screen=False).select(scores, torch.full((2, 2), n), protected, view))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_screen_on_cuda_chooses_what_float32_norms_choose():
    """On a GPU the screen runs by itself (bfloat16 values), with the wider bound for cuBLAS's reduced-precision
    sums; it keeps what every float32 norm keeps, on long heads where stage 2 leaves most entries out."""
    b, h_kv, t = 2, 2, 4096
    for seed in range(3):
        view = _bf16_view(b, h_kv, 4, t, 64, 256, seed, device="cuda")
        assert norm_screen.screens(view.values)
        gen = torch.Generator().manual_seed(seed)
        scores = (torch.rand(b, h_kv, t, generator=gen) ** 8).cuda()
        protected = torch.zeros(b, t, dtype=torch.bool, device="cuda")
        protected[:, -32:] = True
        budgets = torch.full((b, h_kv), t // 5, device="cuda")
        got = CriticalSelector().select(scores, budgets, protected, view)
        assert "value_norm_bounds" in view.memo
        want = CriticalSelector(screen=False).select(scores, budgets, protected, view)
        assert torch.equal(got, want), seed


def test_weight_row_sums_are_computed_once_per_weight_and_again_when_it_changes():
    """The bound's |W| row sums are kept per o_proj weight across prefills: the same tensor while the weight is
    unchanged, computed anew after an in-place change or new storage (``module.to``), forgotten with the weight."""
    import gc

    def direct(w: torch.Tensor) -> torch.Tensor:
        return w.float().abs().view(8, 2, 3, 4).sum(0).mean(1)  # hidden 8, h_kv 2, groups 3, d 4

    layer = nn.Linear(24, 8, bias=False)
    w = layer.weight
    first = norm_screen._abs_row_sums(w, 2, 4)
    assert torch.equal(first, direct(w)) and norm_screen._abs_row_sums(w, 2, 4) is first
    with torch.no_grad():
        w.mul_(-2.0)
    changed = norm_screen._abs_row_sums(w, 2, 4)
    assert changed is not first and torch.equal(changed, direct(w))
    layer.to(torch.float64)  # module.to swaps the parameter's storage
    assert torch.equal(norm_screen._abs_row_sums(layer.weight, 2, 4), direct(layer.weight))
    with torch.inference_mode():
        frozen = torch.randn(8, 24)
    assert torch.equal(norm_screen._abs_row_sums(frozen, 2, 4), direct(frozen))
    held = len(norm_screen._ROW_SUMS)
    del layer, w
    gc.collect()
    assert len(norm_screen._ROW_SUMS) == held - 1
