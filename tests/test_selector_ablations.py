"""Ablations of the paper's selector, each an option (defaults unchanged): SnapKV's maximum over the window
queries, un-pooled attention in stage 2, the value norm per query head; and the ``name:key=value`` method specs
that name them."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from criticalkv.analysis.command import parse_pairs
from criticalkv.errors import CriticalKVError, MethodOptionError, UnknownMethodError
from criticalkv.methods import build_method, parse_method_spec, parse_option_value
from criticalkv.scorers import LayerView, SnapKVScorer
from criticalkv.scorers.base import window_attention
from criticalkv.selectors import CriticalSelector, projected_value_norm


class _Attn(nn.Module):
    def __init__(self, h_q: int, d: int, hidden: int) -> None:
        super().__init__()
        self.o_proj = nn.Linear(h_q * d, hidden, bias=False)
        self.layer_idx = 0


def _view(lengths, t, h_kv=2, groups=3, d=6, hidden=10, seed=0) -> LayerView:
    gen = torch.Generator().manual_seed(seed)
    b = len(lengths)
    valid = torch.zeros(b, t, dtype=torch.bool)
    for row, n in enumerate(lengths):
        valid[row, t - n :] = True
    module = _Attn(h_kv * groups, d, hidden)
    with torch.no_grad():
        module.o_proj.weight.copy_(torch.randn(hidden, h_kv * groups * d, generator=gen))
    return LayerView(
        module,
        torch.randn(b, h_kv * groups, t, d, generator=gen) * 2.0,
        torch.randn(b, h_kv, t, d, generator=gen),
        torch.randn(b, h_kv, t, d, generator=gen) * torch.exp(torch.randn(b, h_kv, t, 1, generator=gen)),
        valid,
        1.0 / math.sqrt(d),
    )


def _naive_head_attention(view: LayerView, window: int, kernel: int, reduce: str) -> torch.Tensor:
    """Window attention per query head over the context columns, reduced over the window queries and pooled, by
    explicit per-head softmaxes: (b, h_q, t - w) float64."""
    b, h_kv, t, _ = view.keys.shape
    g, w = view.groups, window
    out = torch.zeros(b, h_kv * g, t - w, dtype=torch.float64)
    for bi in range(b):
        for h in range(h_kv * g):
            rows = []
            for p in range(t - w, t):
                allowed = torch.tensor([view.valid[bi, i] and i <= p for i in range(t)])
                logits = (view.keys[bi, h // g].double() @ view.query[bi, h, p].double()) * view.scaling
                rows.append(torch.softmax(logits.masked_fill(~allowed, -math.inf), 0)[: t - w])
            stacked = torch.stack(rows)  # (w, t - w)
            reduced = stacked.mean(0) if reduce == "mean" else stacked.amax(0)
            out[bi, h] = F.avg_pool1d(reduced[None, None], kernel, stride=1, padding=kernel // 2)[0, 0]
    return out


def _naive_head_norms(view: LayerView) -> torch.Tensor:
    """||V_i W_O^h||_1 per query head h: (b, h_q, t) float64."""
    b, h_kv, t, d = view.keys.shape
    g = view.groups
    weight = view.o_proj_weight.detach().double()
    out = torch.zeros(b, h_kv * g, t, dtype=torch.float64)
    for h in range(h_kv * g):
        w_o = weight[:, h * d : (h + 1) * d]  # (hidden, d)
        out[:, h] = (view.values[:, h // g].double() @ w_o.T).abs().sum(-1)
    return out


def _reference_two_stage(scores, stage2, budgets, protected, valid, alpha=0.5):
    """Protected first (most recent), stage 1 by ``scores``, the rest by ``stage2``, one head at a time."""
    b, h_kv, t = scores.shape
    keep = torch.zeros(b, h_kv, t, dtype=torch.bool)
    for bi in range(b):
        real = [i for i in range(t) if valid[bi, i]]
        prot = [i for i in real if protected[bi, i]]
        for h in range(h_kv):
            budget = min(int(budgets[bi, h]), len(real))
            kept = prot[len(prot) - budget :] if len(prot) > budget else list(prot)
            rest = sorted((i for i in real if i not in kept), key=lambda i: -float(scores[bi, h, i]))
            while len(kept) < min(math.floor(alpha * int(budgets[bi, h])), budget):
                kept.append(rest.pop(0))
            kept += sorted(rest, key=lambda i: -float(stage2[bi, h, i]))[: budget - len(kept)]
            keep[bi, h, kept] = True
    return keep


# --------------------------------------------------------------------------------------------------------------
# SnapKV: maximum over the window queries


@pytest.mark.parametrize(("lengths", "t"), [([30], 30), ([30, 21], 30)], ids=["batch1", "batch2-left-padded"])
def test_snapkv_max_over_window_matches_reference(lengths, t):
    view = _view(lengths, t, seed=1)
    window, kernel = 5, 3
    got = SnapKVScorer(window=window, kernel=kernel, aggregate="max").score(view)[..., : t - window]
    per_head = _naive_head_attention(view, window, kernel, "max")
    want = per_head.view(len(lengths), 2, view.groups, t - window).mean(2)
    real = view.valid[:, None, : t - window].expand_as(want)
    torch.testing.assert_close(got.double()[real], want[real], rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError):
        SnapKVScorer(aggregate="median")


def test_snapkv_default_equals_its_formula_exactly():
    """The default path is SnapKV's formula, bit for bit: window mean, pool, GQA mean, window at the row max."""
    view = _view([40, 33], 40, seed=2)
    w, t = 8, 40
    attn = window_attention(view, w)[..., : t - w].mean(dim=3)
    pooled = F.avg_pool1d(attn.reshape(-1, 1, t - w), 5, stride=1, padding=2).view(2, 2, -1, t - w).mean(dim=2)
    want = torch.cat([pooled, pooled.amax(-1, keepdim=True).expand(2, 2, w)], dim=-1)
    assert torch.equal(SnapKVScorer(window=w).score(view), want)


# --------------------------------------------------------------------------------------------------------------
# CriticalKV's stage 2: un-pooled attention, value norm per query head


@pytest.mark.parametrize("stage2", ["scores", "unpooled"])
@pytest.mark.parametrize("value_norm", ["group_mean", "per_head"])
def test_stage_two_ablations_match_reference(stage2, value_norm):
    lengths, t, window, kernel, eps = [28, 19], 28, 4, 3, 1e-4
    view = _view(lengths, t, seed=3)
    scorer = SnapKVScorer(window=window, kernel=kernel)
    scores, protected = scorer.score(view), scorer.protected(view)
    budgets = torch.tensor([[6, 11], [9, 5]])
    selector = CriticalSelector(stage2=stage2, value_norm=value_norm, window=window, kernel=kernel)
    got = selector.select(scores, budgets, protected, view)

    b, h_kv, g = 2, 2, view.groups
    if stage2 == "scores" and value_norm == "group_mean":
        attention = scores.double()[:, :, None, : t - window]  # the scorer's own scores, the paper
    else:
        pool = kernel if stage2 == "scores" else 1
        attention = _naive_head_attention(view, window, pool, "mean").view(b, h_kv, g, t - window)
    norms = _naive_head_norms(view).view(b, h_kv, g, t)[..., : t - window]
    if value_norm == "group_mean":
        stage2_score = (attention.mean(2) + eps) * norms.mean(2)
    else:
        stage2_score = ((attention + eps) * norms).mean(2)
    stage2_score = torch.cat([stage2_score, stage2_score.new_zeros(b, h_kv, window)], dim=-1)  # protected anyway
    want = _reference_two_stage(scores, stage2_score, budgets, protected, view.valid)
    assert torch.equal(got, want), (got ^ want).nonzero().tolist()


def test_critical_options_are_checked_and_defaults_unchanged():
    assert CriticalSelector() == CriticalSelector(stage2="scores", value_norm="group_mean")
    for bad in (dict(stage2="pooled"), dict(value_norm="max"), dict(kernel=2), dict(window=0), dict(aggregate="x")):
        with pytest.raises(ValueError):
            CriticalSelector(**bad)


@pytest.mark.parametrize(("h_kv", "groups"), [(1, 1), (2, 3), (3, 2)])
def test_per_head_value_norm_matches_loop_and_averages_to_the_group_norm(h_kv, groups):
    view = _view([9, 9], 9, h_kv=h_kv, groups=groups, seed=h_kv + groups)
    per_head = projected_value_norm(view.values, view.o_proj_weight, per_head=True)
    assert per_head.shape == (2, h_kv, groups, 9)
    want = _naive_head_norms(view).view(2, h_kv, groups, 9)
    torch.testing.assert_close(per_head.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(per_head.mean(2), projected_value_norm(view.values, view.o_proj_weight))


# --------------------------------------------------------------------------------------------------------------
# method specs


def test_method_specs_parse_and_build():
    assert parse_method_spec("snapkv") == ("snapkv", {})
    assert parse_method_spec("critical-snapkv:alpha=0.25;eps=0;stage2=unpooled") == (
        "critical-snapkv",
        {"alpha": 0.25, "eps": 0, "stage2": "unpooled"},
    )
    assert [parse_option_value(x) for x in ("3", "1e-4", "true", "False", "max")] == [3, 1e-4, True, False, "max"]
    method = build_method("critical-snapkv:aggregate=max;value_norm=per_head", alpha=0.75)
    assert method.scorer.aggregate == "max" and method.selector.aggregate == "max"  # both pieces, in step
    assert method.selector.value_norm == "per_head" and method.selector.alpha == 0.75
    assert method.name == "critical-snapkv:aggregate=max;value_norm=per_head"
    assert build_method("critical-snapkv:alpha=0.25", alpha=0.25).selector.alpha == 0.25  # the same value again
    with pytest.raises(MethodOptionError):  # another value: the spec would name a method it is not
        build_method("critical-snapkv:alpha=0.25", alpha=0.5)
    for bad in ("critical-snapkv:alpha", "critical-snapkv:=1", "snapkv:alpha=0.25", "nope:alpha=1"):
        with pytest.raises(UnknownMethodError):
            build_method(bad)


def test_pairs_accept_method_specs():
    methods = ["snapkv", "critical-snapkv:alpha=0.25", "critical-snapkv"]
    assert parse_pairs("snapkv:critical-snapkv:alpha=0.25,critical-snapkv:alpha=0.25:critical-snapkv", methods) == [
        ("snapkv", "critical-snapkv:alpha=0.25"),
        ("critical-snapkv:alpha=0.25", "critical-snapkv"),
    ]
    with pytest.raises(CriticalKVError):
        parse_pairs("snapkv:critical-snapkv:alpha=0.5", methods)
