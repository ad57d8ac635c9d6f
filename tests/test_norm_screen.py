"""The screen of CriticalKV's float32 value norms: its two brackets (bfloat16 norms with an error bound, an upper
bound from the l2 norm) hold, and the screened stage 2 chooses what stage 2 with every float32 norm chooses (the
reference), with and without entries the screen cannot settle."""

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


# a layer's shape and its values' spread in orders of magnitude, for the brackets' hypothesis tests
_LAYERS = dict(
    seed=st.integers(0, 10_000),
    h_kv=st.integers(1, 3),
    g=st.integers(1, 4),
    d=st.sampled_from([4, 16, 64]),
    spread=st.floats(0.0, 12.0),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**_LAYERS, hidden=st.integers(8, 96))
def test_bfloat16_norms_lie_within_the_screen_bound(seed, h_kv, g, d, hidden, spread):
    gen = torch.Generator().manual_seed(seed)
    values, weight = _bf16_layer(gen, 2, h_kv, g, 40, d, hidden, spread)
    exact = projected_value_norm(values, weight)  # float32 products
    rough = projected_value_norm(values, weight, compute_dtype=None)  # bfloat16 products, float32 sums
    rounded = projected_value_norm(values, weight, compute_dtype=None, rounded_sums=True)  # and bfloat16 sums
    low, high = norm_screen.norm_bounds(values, weight)
    for norms in (exact, rough, rounded):
        assert bool((low <= norms).all()) and bool((norms <= high).all())
    torch.testing.assert_close((low + high) / 2, rounded)  # centred on the bracket's own norms
    assert bool(((rounded - rough).abs() <= 2.0**-8 * rough).all())  # the sums' one rounding


@pytest.mark.parametrize("n", [576, 4096, 8192])
def test_a_bfloat16_sum_accumulates_in_float32_and_rounds_once(n):
    # the bracket's bound assumes it (REL): summed in bfloat16 itself, n ones would stop growing at 256
    assert torch.ones(3, n, dtype=torch.bfloat16).sum(-1).tolist() == [n] * 3
    terms = torch.rand(64, n, generator=torch.Generator().manual_seed(n)).bfloat16()
    exact = terms.double().sum(-1)
    assert bool(((terms.sum(-1).double() - exact).abs() <= (2.0**-8 + n * 2.0**-24) * exact).all())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**_LAYERS, hidden=st.integers(2, 96), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]))
def test_l2_bracket_holds_and_is_the_l2_norm_bound(seed, h_kv, g, d, hidden, spread, dtype):
    """Every float32 norm lies below the l2 bracket's upper bound, which is sqrt(hidden) ||V W^g||_2 (in float64,
    from the weight itself rather than its Gram factor) averaged over the group, up to its rounding slack; also with
    hidden < d (a Gram matrix of rank hidden), zero rows and values over 12 orders of magnitude."""
    gen = torch.Generator().manual_seed(seed)
    values, weight = _bf16_layer(gen, 2, h_kv, g, 40, d, hidden, spread)
    values, weight = values.to(dtype), weight.to(dtype)
    exact = projected_value_norm(values, weight)  # (2, h_kv, 40)
    low, high = norm_screen.l2_norm_bounds(values, weight)
    assert bool((low == 0).all()) and bool((exact <= high).all())
    heads = weight.double().view(hidden, h_kv, g, d).permute(1, 2, 3, 0)  # (h_kv, G, d, hidden)
    l2 = torch.einsum("bhtd,hgdn->bhgtn", values.double(), heads).norm(dim=-1)  # (2, h_kv, G, 40)
    reference = math.sqrt(hidden) * l2.mean(2)
    frobenius = heads.flatten(2).norm(dim=-1).mean(1)  # (h_kv,) the group's mean ||W^g||_F
    slack = 4 * (2 * d + 1) * 2.0**-24 * math.sqrt(hidden) * values.double().norm(dim=-1) * frobenius[:, None]
    assert bool((high.double() <= reference * (1 + 1e-4) + slack + 1e-30).all())


@pytest.mark.parametrize(("h_kv", "g", "d", "hidden"), [(1, 1, 128, 4096), (2, 4, 128, 1024), (2, 7, 64, 896)])
def test_a_rows_norm_has_the_same_bits_among_a_few_gathered_rows_as_among_all(h_kv, g, d, hidden):
    """The screens compute the norms of a few gathered rows and compare them with the norms every row would get:
    short products (one row: a matrix-vector product; 4-5 rows at d=128, hidden=4096 on a CPU) sum in another order,
    so ``projected_value_norm`` pads them to 16 rows."""
    gen = torch.Generator().manual_seed(5)
    values = torch.randn(1, h_kv, 300, d, generator=gen)
    weight = torch.randn(hidden, h_kv * g * d, generator=gen) * 0.02
    everything = projected_value_norm(values, weight)  # (1, h_kv, 300)
    heads = weight.view(hidden, h_kv, -1)
    for rows in (1, 2, 4, 5, 7, 15, 16, 17, 64):
        index = torch.randperm(300, generator=gen)[:rows]
        for j in range(h_kv):
            gathered = projected_value_norm(values[0, j, index][None, None], heads[:, j])  # (1, 1, rows)
            assert torch.equal(gathered[0, 0], everything[0, j, index]), (rows, j)


@pytest.mark.parametrize("flush", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_l2_bracket_holds_for_values_down_to_subnormal_numbers(flush, dtype):
    """Values near 1e-25 square to nothing in float32; the bracket scales each row first, and its floor covers the
    norm's own products that fall below float32's normal range (or are flushed to zero)."""
    gen = torch.Generator().manual_seed(6)
    weight = torch.randn(96, 2 * 3 * 16, generator=gen) * 0.05
    torch.set_flush_denormal(flush)  # returns whether the CPU can, not the previous setting (off by default)
    try:
        for magnitude in (1e-42, 1e-38, 1e-30, 1e-25, 1e-20, 1e-12, 1.0, 1e12, 1e18):
            values = (torch.randn(2, 2, 50, 16, generator=gen) * magnitude).to(dtype)
            exact = projected_value_norm(values, weight)
            assert bool((exact <= norm_screen.l2_norm_bounds(values, weight)[1]).all()), magnitude
            weights = torch.rand(2, 2, 50, generator=gen)
            valid = torch.ones(2, 50, dtype=torch.bool)
            keep = torch.zeros(2, 2, 50, dtype=torch.bool)
            need = torch.full((2, 2), 7)
            bounds = norm_screen.l2_norm_bounds(values, weight)
            got = norm_screen.take_top_by_value_norm(weights, bounds, values, weight, keep, valid, need, first=10)
            want = take_top(weights * exact, keep, valid, need)
            assert _chosen_scores(got, weights * exact) == _chosen_scores(want, weights * exact), magnitude
    finally:
        torch.set_flush_denormal(False)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    b=st.integers(1, 3),
    h_kv=st.integers(1, 3),
    g=st.integers(1, 3),
    t=st.integers(1, 48),
    levels=st.sampled_from([0, 3, 1000]),
    loose=st.booleans(),
    kind=st.sampled_from(["bfloat16", "l2"]),
    first=st.integers(0, 60),
)
def test_screened_stage2_chooses_what_float32_norms_choose(seed, b, h_kv, g, t, levels, loose, kind, first):
    """Against ``take_top`` over every float32 norm, with either bracket (the l2 one on float32 values) and any
    first round; ``levels`` quantises the weights (0: all equal, so the norms alone decide; 3: many ties), ``loose``
    widens the bfloat16 bound until nothing is settled (every entry recomputed)."""
    gen = torch.Generator().manual_seed(seed)
    values, weight = _bf16_layer(gen, b, h_kv, g, t, 8, 24, 4.0)
    if kind == "l2":
        values = values.float() * (1 + 0.01 * torch.rand(values.shape, generator=gen))  # float32 values
    weights = torch.rand(b, h_kv, t, generator=gen)
    weights = (weights * levels).floor() / max(levels, 1) + 1e-4 if levels else torch.ones(b, h_kv, t)
    valid = _left_padded(b, t, gen)
    keep = (torch.rand(b, h_kv, t, generator=gen) < 0.2) & valid[:, None, :]
    need = torch.randint(0, t + 2, (b, h_kv), generator=gen)
    exact = weights * projected_value_norm(values, weight)  # (b, h_kv, t)
    want = take_top(exact, keep, valid, need)
    with mock.patch.object(norm_screen, "REL", 1.0 if loose else norm_screen.REL):
        bounds = norm_screen.BRACKETS[kind](values, weight)
        got = norm_screen.take_top_by_value_norm(weights, bounds, values, weight, keep, valid, need, first=first)
    assert torch.equal(got.sum(-1), want.sum(-1))
    assert bool((got >= keep).all())
    assert _chosen_scores(got, exact) == _chosen_scores(want, exact)


def _bf16_view(
    b: int, h_kv: int, g: int, t: int, d: int, hidden: int, seed: int, device: str = "cpu", dtype=torch.bfloat16
) -> LayerView:
    """A layer's view in ``dtype`` (bfloat16 numbers either way)."""
    gen = torch.Generator().manual_seed(seed)
    values, weight = _bf16_layer(gen, b, h_kv, g, t, d, hidden, 3.0, zeros=False)  # no ties: masks compare
    query = torch.randn(b, h_kv * g, t, d, generator=gen).bfloat16()
    keys = torch.randn(b, h_kv, t, d, generator=gen).bfloat16()
    valid = _left_padded(b, t, gen)
    tensors = [x.to(device, dtype) if x.is_floating_point() else x.to(device) for x in (query, keys, values, valid)]
    return LayerView(_Attn(weight.to(dtype)).to(device), *tensors, 1.0 / math.sqrt(d))


@pytest.mark.parametrize("stage2", ["scores", "unpooled"])
@pytest.mark.parametrize("kind", ["bfloat16", "l2"])
def test_critical_selector_screened_equals_unscreened(stage2, kind, monkeypatch):
    """The selector with either bracket (the bfloat16 one forced on, whatever this CPU does in bfloat16; the l2 one
    on float32 values) keeps the very entries it keeps with every float32 norm, on a padded batch with per-head
    budgets."""
    calls = []
    screened = norm_screen.take_top_by_value_norm
    monkeypatch.setattr(critical_module, "screen_kind", lambda values, weight: kind)
    monkeypatch.setattr(critical_module, "take_top_by_value_norm", lambda *a: calls.append(1) or screened(*a))
    b, h_kv, t = 3, 2, 96
    for seed in range(4):
        view = _bf16_view(b, h_kv, 3, t, 16, 40, seed, dtype=torch.bfloat16 if kind == "bfloat16" else torch.float32)
        scores = torch.rand(b, h_kv, t, generator=torch.Generator().manual_seed(seed)) ** 4
        protected = torch.zeros(b, t, dtype=torch.bool)
        protected[:, -8:] = True
        budgets = torch.randint(1, t // 3, (b, h_kv), generator=torch.Generator().manual_seed(50 + seed))
        kwargs = dict(stage2=stage2, window=8, kernel=3)
        got = CriticalSelector(**kwargs).select(scores, budgets, protected, view)
        want = CriticalSelector(screen=False, **kwargs).select(scores, budgets, protected, view)
        assert torch.equal(got, want), seed
    assert len(calls) == 4


def test_each_bracket_runs_where_it_pays_and_none_elsewhere(monkeypatch):
    """bfloat16 values on a CPU that multiplies them natively take the bfloat16 bracket, other values on a CPU the l2
    one, unless float32 products may be rounded (``torch.set_float32_matmul_precision``); ``norm_dtype="model"``,
    per-head norms and norms another method already computed for the view take the unscreened path, and so does
    a budget whose first round would hold more than a third of a head's entries."""
    view = _bf16_view(1, 2, 2, 32, 8, 16, seed=0)
    native = norm_screen.cpu_multiplies_bfloat16()
    assert norm_screen.screen_kind(view.values, view.o_proj_weight) == ("bfloat16" if native else "l2")
    assert norm_screen.screen_kind(view.values.float(), view.o_proj_weight) == "l2"
    assert norm_screen.screen_kind(view.values.double(), view.o_proj_weight) == "l2"
    mkldnn, cuda = torch.backends.mkldnn.matmul, torch.backends.cuda.matmul
    try:
        for setting, value, kind in [(mkldnn, "bf16", None), (mkldnn, "tf32", None), (cuda, "tf32", "l2")]:
            setting.fp32_precision = value  # torch's newer setting (the older getter raises once it is used)
            assert norm_screen.screen_kind(view.values.float(), view.o_proj_weight) == kind, (value, kind)
            setting.fp32_precision = "none"
        torch.set_float32_matmul_precision("medium")  # the older one: bfloat16 products in oneDNN
        assert norm_screen.screen_kind(view.values.float(), view.o_proj_weight) is None
    finally:
        mkldnn.fp32_precision = cuda.fp32_precision = "none"
        torch.set_float32_matmul_precision("highest")
    monkeypatch.setattr(critical_module, "screen_kind", lambda values, weight: "l2")
    assert CriticalSelector()._screen(view) == "l2"
    assert CriticalSelector(screen=False)._screen(view) is None
    assert CriticalSelector(norm_dtype="model")._screen(view) is None
    assert CriticalSelector(value_norm="per_head")._screen(view) is None
    assert norm_screen.first_round("l2", 6, 32) == 9 and norm_screen.first_round("l2", 8, 32) is None
    assert norm_screen.first_round("bfloat16", 30, 32) == 0
    calls = []
    monkeypatch.setattr(critical_module, "take_top_by_value_norm", lambda *a: calls.append(a[-1]))
    protected = torch.zeros(1, 32, dtype=torch.bool)
    scores = torch.rand(1, 2, 32, generator=torch.Generator().manual_seed(1))
    # stage 2's need 6 at budget 12 (a first round of 9 <= 32 / 3: screened, by the stand-in that returns nothing),
    # 7 at budget 13 (a first round of 11: every norm computed)
    got = [CriticalSelector().select(scores, torch.full((1, 2), n), protected, view) for n in (12, 13)]
    assert calls == [9] and got[0] is None
    assert torch.equal(got[1], CriticalSelector(screen=False).select(scores, torch.full((1, 2), 13), protected, view))
    view.remember(("value_norm", torch.float32), lambda: projected_value_norm(view.values, view.o_proj_weight))
    assert CriticalSelector()._screen(view) is None


@pytest.mark.parametrize("kind", ["bfloat16", "l2"])
def test_screen_bounds_are_computed_once_per_view(kind, monkeypatch):
    """A prefill compressed for several budgets (a sweep) computes a bracket once."""
    calls = []
    bounds = norm_screen.BRACKETS[kind]
    monkeypatch.setattr(critical_module, "screen_kind", lambda values, weight: kind)
    monkeypatch.setitem(norm_screen.BRACKETS, kind, lambda *a: calls.append(1) or bounds(*a))
    view = _bf16_view(2, 2, 2, 64, 8, 24, seed=3, dtype=torch.bfloat16 if kind == "bfloat16" else torch.float32)
    scores = torch.rand(2, 2, 64, generator=torch.Generator().manual_seed(4))
    protected = torch.zeros(2, 64, dtype=torch.bool)
    got = [CriticalSelector().select(scores, torch.full((2, 2), n), protected, view) for n in (6, 13, 20)]
    assert len(calls) == 1
    for n, mask in zip((6, 13, 20), got, strict=True):
        assert torch.equal(mask, CriticalSelector(screen=False).select(scores, torch.full((2, 2), n), protected, view))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_computes_every_norm_in_the_fused_kernel_and_chooses_what_the_cpu_chooses():
    """On a GPU with Triton no bracket runs (the fused kernel's float32 norms cost what bfloat16 ones would); stage 2
    keeps what the CPU's float32 norms keep, on long heads where it leaves most entries out."""
    b, h_kv, t = 2, 2, 4096
    for seed in range(3):
        view = _bf16_view(b, h_kv, 4, t, 64, 256, seed)
        gen = torch.Generator().manual_seed(seed)
        scores = torch.rand(b, h_kv, t, generator=gen) ** 8
        protected = torch.zeros(b, t, dtype=torch.bool)
        protected[:, -32:] = True
        budgets = torch.full((b, h_kv), t // 5)
        want = CriticalSelector(screen=False).select(scores, budgets, protected, view)
        on_gpu = _bf16_view(b, h_kv, 4, t, 64, 256, seed, device="cuda")
        assert norm_screen.screen_kind(on_gpu.values, on_gpu.o_proj_weight) is None
        got = CriticalSelector().select(scores.cuda(), budgets.cuda(), protected.cuda(), on_gpu)
        assert torch.equal(got.cpu(), want), seed


def test_weight_row_sums_are_computed_once_per_weight_and_again_when_it_changes():
    """The brackets' |W| row sums and Gram factors are kept per o_proj weight across prefills: the same tensors while
    the weight is unchanged, computed anew after an in-place change or new storage (``module.to``), forgotten with
    the weight."""
    import gc

    def direct(w: torch.Tensor) -> torch.Tensor:
        return w.float().abs().view(8, 2, 3, 4).sum(0).mean(1)  # hidden 8, h_kv 2, groups 3, d 4

    layer = nn.Linear(24, 8, bias=False)
    w = layer.weight
    first = norm_screen._abs_row_sums(w, 2, 4)
    factors = norm_screen._l2_factors(w, 2, 4)
    assert torch.equal(first, direct(w)) and norm_screen._abs_row_sums(w, 2, 4) is first
    assert norm_screen._l2_factors(w, 2, 4) is factors
    with torch.no_grad():
        w.mul_(-2.0)
    changed = norm_screen._abs_row_sums(w, 2, 4)
    assert changed is not first and torch.equal(changed, direct(w))
    assert norm_screen._l2_factors(w, 2, 4) is not factors
    layer.to(torch.float64)  # module.to swaps the parameter's storage
    assert torch.equal(norm_screen._abs_row_sums(layer.weight, 2, 4), direct(layer.weight))
    with torch.inference_mode():
        frozen = torch.randn(8, 24)
    assert torch.equal(norm_screen._abs_row_sums(frozen, 2, 4), direct(frozen))
    held = len(norm_screen._DERIVED)
    del layer, w
    gc.collect()
    assert len(norm_screen._DERIVED) == held - 1
