"""Selectors: CriticalKV's two-stage selection against a brute-force reference of method.md section 2, the
projected value norm against an explicit per-head loop, and properties every selector must satisfy."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from criticalkv.budget import Budget
from criticalkv.errors import CriticalKVError, NegativeScoreError
from criticalkv.runtime.method import Method
from criticalkv.scorers import (
    DefensiveScorer,
    KeyNormScorer,
    LayerView,
    ReconstructionScorer,
    Scorer,
    SnapKVScorer,
    StreamingScorer,
    TOVAScorer,
)
from criticalkv.scorers.base import declares_non_negative
from criticalkv.selectors import (
    CriticalSelector,
    DefensiveSelector,
    PerturbationSelector,
    TopKSelector,
    projected_value_norm,
)
from criticalkv.selectors import value_norm as value_norm_module

# --------------------------------------------------------------------------------------------------------------
# helpers


class _Attn(nn.Module):
    """The least a selector needs of an attention module: an output projection."""

    def __init__(self, h_q: int, d: int, hidden: int, bias: bool = False) -> None:
        super().__init__()
        self.o_proj = nn.Linear(h_q * d, hidden, bias=bias)
        self.layer_idx = 0


def _left_padded_valid(lengths: list[int], t: int) -> torch.Tensor:
    valid = torch.zeros(len(lengths), t, dtype=torch.bool)
    for row, n in enumerate(lengths):
        if n:
            valid[row, t - n :] = True
    return valid


def _make_view(b, h_kv, g, t, d, hidden, lengths, seed=0) -> LayerView:
    gen = torch.Generator().manual_seed(seed)
    module = _Attn(h_kv * g, d, hidden)
    with torch.no_grad():
        module.o_proj.weight.copy_(torch.randn(hidden, h_kv * g * d, generator=gen))
    query = torch.randn(b, h_kv * g, t, d, generator=gen)
    keys = torch.randn(b, h_kv, t, d, generator=gen)
    values = torch.randn(b, h_kv, t, d, generator=gen)
    return LayerView(module, query, keys, values, _left_padded_valid(lengths, t), 1.0 / math.sqrt(d))


def _distinct_scores(b, h, t, seed) -> torch.Tensor:
    """Non-negative scores, all distinct within a head (a random permutation of well separated levels)."""
    gen = torch.Generator().manual_seed(seed)
    out = torch.empty(b, h, t)
    for i in range(b):
        for j in range(h):
            out[i, j] = (torch.randperm(t, generator=gen).float() + 1.0) / t * 0.5
    return out


def _reference_value_norm(values: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """N[b, h, i] = mean over the group's query heads g of sum_o |sum_k V[b,h,i,k] W[o, g*d + k]| (loops)."""
    b, h_kv, t, d = values.shape
    _hidden, in_features = weight.shape
    g_size = in_features // (h_kv * d)
    w = weight.detach().double()
    out = torch.zeros(b, h_kv, t, dtype=torch.float64)
    for bi in range(b):
        for h in range(h_kv):
            for i in range(t):
                v = values[bi, h, i].detach().double()
                total = 0.0
                for j in range(g_size):
                    q_head = h * g_size + j  # repeat_kv: query head q reads KV head q // G
                    w_slice = w[:, q_head * d : (q_head + 1) * d]  # (hidden, d)
                    total += float((w_slice @ v).abs().sum())
                out[bi, h, i] = total / g_size
    return out


def _reference_select(scores, budgets, protected, valid, values, weight, *, critical, alpha=0.5, eps=1e-4):
    """method.md section 2, one (batch, head) at a time, in plain Python."""
    b, h_kv, t = scores.shape
    norms = _reference_value_norm(values, weight) if critical else None
    keep = torch.zeros(b, h_kv, t, dtype=torch.bool)
    for bi in range(b):
        real = [i for i in range(t) if valid[bi, i]]
        prot = [i for i in real if protected[bi, i]]
        for h in range(h_kv):
            budget = min(int(budgets[bi, h]), len(real))
            kept = prot[len(prot) - budget :] if len(prot) > budget else list(prot)  # most recent protected
            rest = sorted((i for i in real if i not in kept), key=lambda i: -float(scores[bi, h, i]))
            if critical:
                stage1 = math.floor(alpha * int(budgets[bi, h]))
                while len(kept) < min(stage1, budget):
                    kept.append(rest.pop(0))
                rescored = sorted(rest, key=lambda i: -(float(scores[bi, h, i]) + eps) * float(norms[bi, h, i]))
                kept += rescored[: budget - len(kept)]
            else:
                kept += rest[: budget - len(kept)]
            assert len(kept) == budget
            keep[bi, h, kept] = True
    return keep


def _window_protected(valid: torch.Tensor, w: int) -> torch.Tensor:
    prot = torch.zeros_like(valid)
    prot[:, valid.shape[1] - w :] = True
    return prot & valid


# --------------------------------------------------------------------------------------------------------------
# brute-force comparison


@pytest.mark.parametrize("groups", [1, 2, 3])
@pytest.mark.parametrize(
    ("lengths", "t"),
    [([20], 20), ([24, 17, 9], 24), ([30, 30, 12], 30)],
    ids=["batch1", "batch3-left-padded", "batch3-mixed"],
)
@pytest.mark.parametrize("window", [0, 3])
def test_critical_selector_matches_brute_force(groups, lengths, t, window):
    h_kv, d, hidden = 2, 4, 12
    b = len(lengths)
    for seed in range(3):
        view = _make_view(b, h_kv, groups, t, d, hidden, lengths, seed=seed)
        scores = _distinct_scores(b, h_kv, t, seed=100 + seed)
        protected = _window_protected(view.valid, window)
        gen = torch.Generator().manual_seed(7 + seed)
        budgets = torch.randint(1, t + 3, (b, h_kv), generator=gen)  # per-head budgets, some above the length
        budgets[0, 0] = 1  # tiny budget: the protected entries do not fit
        got = CriticalSelector().select(scores, budgets, protected, view)
        want = _reference_select(scores, budgets, protected, view.valid, view.values, view.o_proj_weight, critical=True)
        assert torch.equal(got, want), (seed, (got ^ want).nonzero().tolist())


@pytest.mark.parametrize("alpha", [0.0, 0.25, 0.75, 1.0])
def test_critical_selector_alpha_matches_brute_force(alpha):
    lengths, t, groups = [26, 19, 26], 26, 2
    view = _make_view(3, 3, groups, t, 4, 10, lengths, seed=11)
    scores = _distinct_scores(3, 3, t, seed=12)
    protected = _window_protected(view.valid, 2)
    budgets = torch.tensor([[5, 9, 13], [4, 8, 2], [20, 7, 11]])
    got = CriticalSelector(alpha=alpha).select(scores, budgets, protected, view)
    want = _reference_select(
        scores, budgets, protected, view.valid, view.values, view.o_proj_weight, critical=True, alpha=alpha
    )
    assert torch.equal(got, want)


def test_critical_stage_two_rescores_by_value_norm():
    """A token with low attention but a huge projected value must win stage 2; top-k would drop it."""
    t, d, hidden = 10, 4, 8
    view = _make_view(1, 1, 1, t, d, hidden, [t], seed=3)
    scores = torch.linspace(1.0, 0.1, t).view(1, 1, t).clone()  # position 0 best ... 9 worst
    values = torch.full((1, 1, t, d), 0.01)
    values[0, 0, 9] = 100.0  # the worst-scored entry carries a very large value
    view.values = values
    budgets = torch.tensor([[4]])
    protected = torch.zeros(1, t, dtype=torch.bool)
    crit = CriticalSelector().select(scores, budgets, protected, view)
    topk = TopKSelector().select(scores, budgets, protected, view)
    assert topk[0, 0].nonzero().flatten().tolist() == [0, 1, 2, 3]
    assert crit[0, 0].nonzero().flatten().tolist() == [0, 1, 2, 9]  # stage 1: 0, 1; stage 2 picks 9 first


def test_topk_selector_matches_brute_force():
    lengths, t = [22, 13, 5], 22
    view = _make_view(3, 2, 2, t, 4, 8, lengths, seed=5)
    scores = _distinct_scores(3, 2, t, seed=6)
    protected = _window_protected(view.valid, 4)
    budgets = torch.tensor([[2, 7], [13, 6], [3, 30]])
    got = TopKSelector().select(scores, budgets, protected, view)
    want = _reference_select(scores, budgets, protected, view.valid, view.values, view.o_proj_weight, critical=False)
    assert torch.equal(got, want)


# --------------------------------------------------------------------------------------------------------------
# projected value norm


@pytest.mark.parametrize(("h_kv", "groups"), [(1, 1), (2, 1), (2, 2), (2, 3), (1, 4), (3, 2)])
@pytest.mark.parametrize("b", [1, 3])
def test_projected_value_norm_matches_loop(b, h_kv, groups):
    torch.manual_seed(b * 100 + h_kv * 10 + groups)
    d, hidden, t = 6, 20, 9
    values = torch.randn(b, h_kv, t, d)
    weight = torch.randn(hidden, h_kv * groups * d)
    got = projected_value_norm(values, weight)
    assert got.shape == (b, h_kv, t)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), _reference_value_norm(values, weight), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("per_head_products", [True, False])  # a CPU's products, or one for all heads as on a GPU
def test_projected_value_norm_chunked_equals_unchunked(per_head_products, monkeypatch):
    torch.manual_seed(0)
    values = torch.randn(2, 2, 37, 4)
    weight = torch.randn(16, 2 * 3 * 4)
    whole = projected_value_norm(values, weight)
    monkeypatch.setattr(value_norm_module, "_PER_HEAD_PRODUCTS_ON_CPU", per_head_products)
    monkeypatch.setattr(value_norm_module, "_CHUNK_ELEMENTS", 16 * 5)  # 16 rows (the fewest) per chunk: 16, 16, 5
    monkeypatch.setattr(value_norm_module, "_CHUNK_ELEMENTS_CUDA", 2 * 2 * 16 * 5)  # 5 rows per chunk
    chunked = projected_value_norm(values, weight)
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(whole.double(), _reference_value_norm(values, weight), rtol=1e-5, atol=1e-6)
    per_head = projected_value_norm(values, weight, per_head=True)  # (b, h_kv, G, t): the group's mean is `whole`
    assert per_head.shape == (2, 2, 3, 37)
    torch.testing.assert_close(per_head.mean(2), whole, rtol=1e-6, atol=1e-6)


def test_projected_value_norm_low_precision_inputs_computed_in_float32():
    torch.manual_seed(1)
    values = torch.randn(1, 2, 5, 8).to(torch.bfloat16)
    weight = torch.randn(24, 2 * 2 * 8).to(torch.bfloat16)
    got = projected_value_norm(values, weight)
    assert got.dtype == torch.float32
    torch.testing.assert_close(
        got.double(), _reference_value_norm(values.float(), weight.float()), rtol=1e-5, atol=1e-5
    )


def test_projected_value_norm_in_the_values_dtype():
    """``compute_dtype=None`` multiplies in the values' dtype (kvpress's choice) and still sums in float32."""
    torch.manual_seed(3)
    values = torch.randn(2, 2, 9, 8)
    weight = torch.randn(24, 2 * 2 * 8)
    reference = _reference_value_norm(values, weight)
    torch.testing.assert_close(projected_value_norm(values, weight, None).double(), reference, rtol=1e-5, atol=1e-6)
    low = projected_value_norm(values.bfloat16(), weight.bfloat16(), None)
    assert low.dtype == torch.float32
    exact_low = _reference_value_norm(values.bfloat16().float(), weight.bfloat16().float())
    torch.testing.assert_close(low.double(), exact_low, rtol=2e-2, atol=1e-2)
    assert CriticalSelector(norm_dtype="model").norm_dtype == "model"
    with pytest.raises(ValueError):
        CriticalSelector(norm_dtype="float16")


def test_projected_value_norm_rejects_mismatched_projection():
    with pytest.raises(ValueError):
        projected_value_norm(torch.randn(1, 2, 3, 4), torch.randn(10, 12))  # 12 is not a multiple of 2 * 4


def test_projected_value_norm_qwen2_config_without_head_dim():
    """Qwen2 configs have no ``head_dim``: d = hidden / heads, read from the real attention module's o_proj."""
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention

    from criticalkv.models import head_dim

    cfg = Qwen2Config(hidden_size=48, num_attention_heads=6, num_key_value_heads=2, intermediate_size=64)
    assert getattr(cfg, "head_dim", None) in (None, 8)
    d = head_dim(cfg)
    assert d == 8
    torch.manual_seed(2)
    attn = Qwen2Attention(cfg, layer_idx=0)
    assert attn.o_proj.weight.shape == (48, 6 * d)
    values = torch.randn(2, 2, 7, d)
    got = projected_value_norm(values, attn.o_proj.weight.detach())
    torch.testing.assert_close(
        got.double(), _reference_value_norm(values, attn.o_proj.weight.detach()), rtol=1e-5, atol=1e-6
    )


def test_o_proj_bias_does_not_enter_the_norm():
    view = _make_view(1, 2, 2, 6, 4, 8, [6], seed=9)
    biased = _Attn(4, 4, 8, bias=True)
    with torch.no_grad():
        biased.o_proj.weight.copy_(view.module.o_proj.weight)
        biased.o_proj.bias.fill_(1000.0)
    scores = _distinct_scores(1, 2, 6, seed=1)
    protected = torch.zeros(1, 6, dtype=torch.bool)
    budgets = torch.tensor([[3, 4]])
    a = CriticalSelector().select(scores, budgets, protected, view)
    view.module = biased
    b = CriticalSelector().select(scores, budgets, protected, view)
    assert torch.equal(a, b)


# --------------------------------------------------------------------------------------------------------------
# negative scores


@dataclasses.dataclass
class _GivenScores(Scorer):
    """A scorer handing out fixed scores and protected positions, not declared non-negative."""

    scores: torch.Tensor
    kept: torch.Tensor

    def score(self, view: LayerView) -> torch.Tensor:
        return self.scores.clone()

    def protected(self, view: LayerView) -> torch.Tensor:
        return self.kept


def test_negative_scores_raise_where_a_selector_multiplies_them():
    """A Method checks the sign of an undeclared scorer's scores for the selectors that multiply them by value norms
    (naming both pieces), and not for those that only rank them."""
    view = _make_view(1, 2, 2, 8, 4, 8, [8], seed=0)
    scores = _distinct_scores(1, 2, 8, seed=0)
    scores[0, 1, 3] = -0.01
    scorer = _GivenScores(scores, torch.zeros(1, 8, dtype=torch.bool))
    for selector in (CriticalSelector(), DefensiveSelector(window=2), PerturbationSelector(window=2, start="critical")):
        with pytest.raises(NegativeScoreError, match=f"{type(selector).__name__}.*_GivenScores"):
            Method(scorer, selector=selector).decide(view, Budget(0.5))
    for selector in (TopKSelector(), PerturbationSelector(window=2, start="topk")):
        assert Method(scorer, selector=selector).decide(view, Budget(0.5)).keep.sum(-1).tolist() == [[4, 4]]
    scores[0, 1, 3] = float("nan")  # NaN compares false with 0: it passed a "< 0" check
    with pytest.raises(NegativeScoreError, match="negative or NaN"):
        Method(scorer, selector=CriticalSelector()).decide(view, Budget(0.5))


def test_scores_of_the_wrong_shape_name_the_scorer():
    view = _make_view(1, 2, 2, 8, 4, 8, [8], seed=0)
    scorer = _GivenScores(_distinct_scores(1, 2, 8, seed=0)[:, :, :7], torch.zeros(1, 8, dtype=torch.bool))
    with pytest.raises(CriticalKVError, match=r"_GivenScores gave scores of shape \(1, 2, 7\); .* = \(1, 2, 8\)"):
        Method(scorer, selector=TopKSelector()).decide(view, Budget(0.5))


def test_negative_scores_on_padding_or_protected_positions_are_ignored():
    view = _make_view(1, 1, 1, 8, 4, 8, [6], seed=0)  # positions 0, 1 are padding
    scores = _distinct_scores(1, 1, 8, seed=0)
    scores[0, 0, 0] = -5.0  # padding
    scores[0, 0, 7] = -5.0  # protected
    protected = torch.zeros(1, 8, dtype=torch.bool)
    protected[0, 7] = True
    keep = Method(_GivenScores(scores, protected), selector=CriticalSelector()).decide(view, Budget(3)).keep
    assert int(keep.sum()) == 3 and bool(keep[0, 0, 7]) and not bool(keep[0, 0, :2].any())


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    b=st.integers(1, 3),
    h_kv=st.integers(1, 3),
    g=st.integers(1, 3),
    t=st.integers(1, 40),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_scorers_declared_non_negative_are(b, h_kv, g, t, seed, data):
    """The scorers that spare the sign check (``non_negative``) score every real position >= 0, padded or not, with
    windows longer or shorter than the rows, any pooling and aggregate; the key norm's scores are negative and it
    says nothing. (The reconstruction scorer's: tests/test_reconstruct.py, attention weights in [0, 1].)"""
    lengths = [data.draw(st.integers(1, t)) for _ in range(b)]
    view = _make_view(b, h_kv, g, t, 4, 8, lengths, seed=seed)
    window, kernel = data.draw(st.integers(1, 8)), data.draw(st.sampled_from([1, 3, 5, 9]))
    aggregate = data.draw(st.sampled_from(["mean", "max"]))
    scorers = (
        SnapKVScorer(window=window, kernel=kernel, aggregate=aggregate),
        TOVAScorer(),
        StreamingScorer(sinks=data.draw(st.integers(0, 6))),
        DefensiveScorer(window=window, kernel=kernel),
    )
    for scorer in scorers:
        assert scorer.non_negative
        scores = scorer.score(view)
        # what the sign check would see (a row no longer than the window, kept whole, may score NaN: not negative)
        assert not bool((scores.masked_fill(~view.valid[:, None, :], 0.0) < 0).any()), type(scorer).__name__
    assert not getattr(KeyNormScorer(), "non_negative", False)


def test_a_subclass_computing_scores_anew_is_not_trusted_until_it_says_so():
    """``declares_non_negative``: a subclass that overrides ``score`` below the class that declared the scores
    non-negative (a shifted SnapKV) has them checked, and raises when they are negative; one that overrides only
    ``protected``, or says so itself, is trusted."""

    class Shifted(SnapKVScorer):
        def score(self, view: LayerView) -> torch.Tensor:
            return super().score(view) - 0.05

    class ShiftedUp(Shifted):
        non_negative = True

        def score(self, view: LayerView) -> torch.Tensor:
            return super().score(view) + 0.05

    class NoWindow(SnapKVScorer):
        def protected(self, view: LayerView) -> torch.Tensor:
            return torch.zeros_like(view.valid)

    class Retracted(SnapKVScorer):
        non_negative = False

    assert declares_non_negative(SnapKVScorer()) and declares_non_negative(ReconstructionScorer())
    assert declares_non_negative(NoWindow()) and declares_non_negative(ShiftedUp())
    assert not declares_non_negative(Shifted()) and not declares_non_negative(Retracted())
    assert not declares_non_negative(KeyNormScorer())
    view = _make_view(1, 2, 2, 16, 4, 8, [16], seed=1)
    with pytest.raises(NegativeScoreError, match="Shifted"):
        Method(Shifted(window=4), selector=CriticalSelector(window=4)).decide(view, Budget(0.5))


def test_scores_given_to_decide_layers_are_checked_whatever_the_scorer_declares():
    """Scores handed to ``decide_layers`` did not come from the scorer: their sign is checked."""
    view = _make_view(1, 2, 2, 16, 4, 8, [16], seed=2)
    method = Method(SnapKVScorer(window=4), selector=CriticalSelector(window=4))
    negated = [-SnapKVScorer(window=4).score(view)]
    with pytest.raises(NegativeScoreError):
        method.decide_layers([view], Budget(0.5), scores=negated)
    assert method.decide_layers([view], Budget(0.5), scores=[-negated[0]])[0].keep.sum(-1).tolist() == [[8, 8]]


def test_key_norm_scores_through_critical_method_raise():
    view = _make_view(2, 2, 2, 16, 4, 8, [16, 12], seed=4)
    assert bool((KeyNormScorer().score(view) < 0).all())
    method = Method(KeyNormScorer(), selector=CriticalSelector())
    with pytest.raises(NegativeScoreError):
        method.decide(view, Budget(0.5))
    # the same scorer with the top-k selector is fine (that is the knorm preset)
    decision = Method(KeyNormScorer(), selector=TopKSelector()).decide(view, Budget(0.5))
    assert decision.keep.sum(-1).tolist() == [[8, 8], [6, 6]]


def test_critical_selector_validates_parameters():
    for bad in (dict(alpha=-0.1), dict(alpha=1.5), dict(eps=-1.0), dict(eps=float("nan")), dict(eps=float("inf"))):
        with pytest.raises(ValueError):
            CriticalSelector(**bad)


# --------------------------------------------------------------------------------------------------------------
# properties (hypothesis)


@st.composite
def _selection_problems(draw):
    b = draw(st.integers(1, 3))
    h_kv = draw(st.integers(1, 3))
    groups = draw(st.integers(1, 3))
    t = draw(st.integers(1, 24))
    lengths = [draw(st.integers(0 if row else 1, t)) for row in range(b)]
    budgets = [[draw(st.integers(1, t + 3)) for _ in range(h_kv)] for _ in range(b)]
    protect_kind = draw(st.sampled_from(["none", "window", "random"]))
    window = draw(st.integers(0, t))
    seed = draw(st.integers(0, 2**16))
    alpha = draw(st.sampled_from([0.0, 0.3, 0.5, 1.0]))
    return b, h_kv, groups, t, lengths, torch.tensor(budgets), protect_kind, window, seed, alpha


def _protected_for(kind, window, valid, seed):
    if kind == "none":
        return torch.zeros_like(valid)
    if kind == "window":
        return _window_protected(valid, window)
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(valid.shape, generator=gen) < 0.3) & valid


@pytest.mark.parametrize("selector_name", ["topk", "critical"])
@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@given(problem=_selection_problems(), ties=st.booleans())
def test_selector_properties(selector_name, problem, ties):
    b, h_kv, groups, t, lengths, budgets, kind, window, seed, alpha = problem
    view = _make_view(b, h_kv, groups, t, 4, 8, lengths, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    scores = torch.rand(b, h_kv, t, generator=gen)
    if ties:  # ties and exact zeros must not change the count
        scores = (scores * 3).floor() / 3
    protected = _protected_for(kind, window, view.valid, seed)
    selector = TopKSelector() if selector_name == "topk" else CriticalSelector(alpha=alpha)
    keep = selector.select(scores, budgets, protected, view)

    assert keep.shape == (b, h_kv, t) and keep.dtype == torch.bool
    n_valid = view.valid.sum(-1)  # (b,)
    want = torch.minimum(budgets, n_valid[:, None])
    assert torch.equal(keep.sum(-1), want)  # exactly the budget (or every real entry)
    assert not bool((keep & ~view.valid[:, None, :]).any())  # never padding
    n_protected = protected.sum(-1)
    fits = (n_protected[:, None] <= budgets)[..., None] & protected[:, None, :]
    assert bool(keep[fits].all())  # protected always kept when they fit
    if kind == "window":  # when they do not fit, the most recent protected entries are kept
        for bi in range(b):
            prot = protected[bi].nonzero().flatten().tolist()
            for h in range(h_kv):
                k = min(int(budgets[bi, h]), len(prot))
                assert bool(keep[bi, h, prot[len(prot) - k :]].all())
    everything = budgets >= n_valid[:, None]
    assert torch.equal(keep[everything], view.valid[:, None, :].expand_as(keep)[everything])


@settings(max_examples=40)
@given(
    t=st.integers(2, 20),
    b=st.integers(1, 3),
    h_kv=st.integers(1, 3),
    groups=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_critical_equals_brute_force_property(t, b, h_kv, groups, seed):
    gen = torch.Generator().manual_seed(seed)
    lengths = [t] + [int(torch.randint(1, t + 1, (1,), generator=gen)) for _ in range(b - 1)]
    view = _make_view(b, h_kv, groups, t, 3, 5, lengths, seed=seed)
    scores = _distinct_scores(b, h_kv, t, seed=seed)
    protected = _window_protected(view.valid, int(torch.randint(0, 4, (1,), generator=gen)))
    budgets = torch.randint(1, t + 2, (b, h_kv), generator=gen)
    got = CriticalSelector().select(scores, budgets, protected, view)
    want = _reference_select(scores, budgets, protected, view.valid, view.values, view.o_proj_weight, critical=True)
    assert torch.equal(got, want)


# --------------------------------------------------------------------------------------------------------------
# through Method.decide


@pytest.mark.parametrize(
    ("scorer", "selector"),
    [(SnapKVScorer(window=4), CriticalSelector(window=4)), (TOVAScorer(), CriticalSelector())],
    ids=["snapkv", "tova"],
)
def test_method_decide_critical_respects_budget_and_padding(scorer, selector):
    view = _make_view(3, 2, 2, 30, 8, 16, [30, 21, 9], seed=21)
    decision = Method(scorer, selector=selector).decide(view, Budget(0.4))
    assert decision.keep is not None
    assert decision.keep.sum(-1).tolist() == [[12, 12], [8, 8], [3, 3]]
    assert torch.equal(decision.budgets, decision.keep.sum(-1))
    assert not bool((decision.keep & ~view.valid[:, None, :]).any())
    assert decision.kept_whole.tolist() == [False, False, False]


def test_selectors_share_what_the_budgets_alone_decide_across_layers_of_a_forward():
    """Layers of one forward handed the same budgets tensor (a uniform allocator's) derive the protected entries and
    the top-k widths once; another tensor of equal values is computed anew, and every layer still selects exactly
    as a view of its own would."""
    shared: dict = {}
    views = [_make_view(2, 2, 2, 24, 4, 16, [24, 17], seed=s) for s in range(3)]
    for view in views:
        view.prefill = shared
    budgets = views[0].share_with_forward(torch.tensor([[9, 9], [7, 7]]))
    protected = torch.zeros(2, 24, dtype=torch.bool)
    protected[:, -4:] = True
    views[0].share_with_forward(protected)
    calls = []
    compute = lambda: calls.append(1) or len(calls)  # noqa: E731
    assert [v.remember_for_tensors("k", (budgets, protected), compute) for v in views] == [1, 1, 1]
    # a tensor of one layer (equal values, another object): computed every time, and nothing kept for it
    entries = len(shared)
    assert [v.remember_for_tensors("k", (budgets.clone(), protected), compute) for v in views] == [2, 3, 4]
    assert len(shared) == entries
    for selector in (TopKSelector(), CriticalSelector(alpha=0.5)):
        for seed, view in enumerate(views):
            scores = torch.rand(2, 2, 24, generator=torch.Generator().manual_seed(seed))  # each layer its own
            alone = dataclasses.replace(view, prefill={}, memo={})
            got = selector.select(scores, budgets, protected, view)
            assert torch.equal(got, selector.select(scores, budgets, protected, alone))
            assert torch.equal(got.sum(-1), budgets)


def test_candidates_scored_minus_infinity_still_fill_the_budget_and_never_padding():
    """A scorer may give real positions -inf: top-k must still take them before padding or entries kept already
    (CriticalKV refuses such scores: they are negative)."""
    view = _make_view(2, 2, 1, 16, 4, 8, [16, 11])
    scores = torch.rand(2, 2, 16)
    scores[1, 1, 5:12] = float("-inf")  # row 1 (padding at 0-4), head 1: most of its real positions
    protected = torch.zeros(2, 16, dtype=torch.bool)
    protected[:, -4:] = True
    budgets = torch.tensor([[8, 8], [8, 8]])
    keep = TopKSelector().select(scores, budgets, protected, view)
    assert torch.equal(keep.sum(-1), budgets)
    assert not (keep & ~view.valid[:, None, :]).any()
