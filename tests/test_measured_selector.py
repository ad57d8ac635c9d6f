"""The measured-perturbation selector: its objective against a per-(row, head, query) loop, its first-order ranking
against autograd, its swap search never worse than its start (hypothesis), against brute force on tiny heads, and the
presets that use it."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from criticalkv.analysis.exhaustive import exhaustive_check
from criticalkv.budget import Budget
from criticalkv.methods import PRESETS, build_method
from criticalkv.scorers import LayerView, SnapKVScorer
from criticalkv.selectors import CriticalSelector, PerturbationSelector, TopKSelector
from criticalkv.selectors.measured import WindowPerturbation, relative_weights

# --------------------------------------------------------------------------------------------------------------
# helpers


class _Attn(nn.Module):
    def __init__(self, h_q: int, d: int, hidden: int) -> None:
        super().__init__()
        self.o_proj = nn.Linear(h_q * d, hidden, bias=False)
        self.layer_idx = 0


def _view(lengths, t, h_kv=2, groups=2, d=8, hidden=12, seed=0, sharpness=3.0) -> LayerView:
    """Left-padded random view; sharp attention and value rows of varied norms, as in trained models."""
    gen = torch.Generator().manual_seed(seed)
    b = len(lengths)
    valid = torch.zeros(b, t, dtype=torch.bool)
    for row, n in enumerate(lengths):
        valid[row, t - n :] = True
    module = _Attn(h_kv * groups, d, hidden)
    with torch.no_grad():
        module.o_proj.weight.copy_(torch.randn(hidden, h_kv * groups * d, generator=gen) / math.sqrt(d))
    values = torch.randn(b, h_kv, t, d, generator=gen) * torch.exp(torch.randn(b, h_kv, t, 1, generator=gen))
    return LayerView(
        module,
        torch.randn(b, h_kv * groups, t, d, generator=gen) * sharpness,
        torch.randn(b, h_kv, t, d, generator=gen),
        values,
        valid,
        1.0 / math.sqrt(d),
    )


def _reference_loss(view: LayerView, keep: torch.Tensor, window: int) -> torch.Tensor:
    """L per (row, KV head), float64, one (row, query head, window query) at a time: (b, h_kv)."""
    return _reference_head_losses(view, keep, window).sum(-1)


def _reference_head_losses(view: LayerView, keep: torch.Tensor, window: int) -> torch.Tensor:
    """L_g per (row, KV head, query head of its group), float64, one window query at a time: (b, h_kv, G)."""
    b, h_kv, t, d = view.keys.shape
    g = view.groups
    w = min(window, t)
    weight = view.o_proj_weight.detach().double()
    out = torch.zeros(b, h_kv, g, dtype=torch.float64)
    for bi in range(b):
        for k in range(h_kv):
            keys, values = view.keys[bi, k].double(), view.values[bi, k].double()
            for j in range(g):
                h = k * g + j  # query head h reads KV head h // G
                w_o = weight[:, h * d : (h + 1) * d].T  # (d, hidden)
                for p in range(t - w, t):
                    if not view.valid[bi, p]:
                        continue
                    seen = [i for i in range(p + 1) if view.valid[bi, i]]
                    logits = (keys[seen] @ view.query[bi, h, p].double()) * view.scaling
                    a = torch.softmax(logits, dim=0)
                    full = a @ values[seen]
                    kept = torch.tensor([bool(keep[bi, k, i]) for i in seen])
                    mass = a[kept].sum()
                    compressed = (a[kept] @ values[seen][kept]) / mass if mass > 0 else torch.zeros(d).double()
                    out[bi, k, j] += ((full - compressed) @ w_o).abs().sum()
    return out


def _reference_relative_loss(view: LayerView, keep: torch.Tensor, start: torch.Tensor, window: int, floor: float):
    """The "relative" objective, float64: sum_g L_g(keep) / max(L_g(start), floor * mean_g L_g(start)): (b, h_kv)."""
    begin = _reference_head_losses(view, start, window)
    scale = torch.maximum(begin, floor * begin.mean(-1, keepdim=True))
    weights = torch.where(scale > 0, 1.0 / scale.clamp_min(1e-300), 1.0)
    return (_reference_head_losses(view, keep, window) * weights).sum(-1)


def _random_keep(view: LayerView, fraction: float, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    b, h_kv, t, _ = view.keys.shape
    return (torch.rand(b, h_kv, t, generator=gen) < fraction) & view.valid[:, None, :]


def _select(view: LayerView, budget: int, selector, window: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    scorer = SnapKVScorer(window=window, kernel=3)
    scores, protected = scorer.score(view), scorer.protected(view)
    budgets = torch.full((view.keys.shape[0], view.keys.shape[1]), budget)
    return selector.select(scores, budgets, protected, view), protected


# --------------------------------------------------------------------------------------------------------------
# the objective and its first-order ranking


@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize(("lengths", "t"), [([18], 18), ([20, 14, 9], 20)], ids=["batch1", "batch3-left-padded"])
@pytest.mark.parametrize("window", [1, 5])
def test_objective_matches_loop_reference(groups, lengths, t, window):
    view = _view(lengths, t, groups=groups, seed=groups * 10 + window)
    objective = WindowPerturbation.of_view(view, window)
    for seed, fraction in enumerate((0.2, 0.6, 1.0)):
        keep = _random_keep(view, fraction, seed)
        keep[:, :, t - 1] = True  # every row keeps its last token, so no window query is left without entries
        got = objective.loss(keep)
        want = _reference_loss(view, keep, window)
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
    assert float(objective.loss(view.valid[:, None, :].expand(-1, 2, -1)).abs().max()) < 1e-4  # nothing evicted


def test_relative_objective_matches_loop_reference():
    """With head weights relative to a starting set, L is each query head's loss over its start's (floored)."""
    view = _view([18, 13], 18, groups=3, seed=21)
    window, floor = 5, 0.3
    start, keep = _random_keep(view, 0.5, 0), _random_keep(view, 0.3, 1)
    start[:, :, -1] = keep[:, :, -1] = True
    objective = WindowPerturbation.of_view(view, window)
    torch.testing.assert_close(
        objective.head_losses(objective.kept_sums(keep)).double(),
        _reference_head_losses(view, keep, window),
        rtol=1e-4,
        atol=1e-4,
    )
    objective.head_weights = relative_weights(objective.head_losses(objective.kept_sums(start)), floor)
    want = _reference_relative_loss(view, keep, start, window, floor)
    torch.testing.assert_close(objective.loss(keep).double(), want, rtol=1e-4, atol=1e-4)
    begin = _reference_relative_loss(view, start, start, window, floor)  # each head's term at most 1: at most G
    torch.testing.assert_close(objective.loss(start).double(), begin, rtol=1e-4, atol=1e-4)
    assert bool((begin <= 3.0 + 1e-9).all()) and bool((begin < 3.0 - 1e-3).any())  # some head sits on its floor


def test_relative_weights_floor_and_zero_groups():
    per_head = torch.tensor([[[4.0, 1.0, 0.1], [0.0, 0.0, 0.0]]])  # (b=1, h_kv=2, G=3)
    got = relative_weights(per_head, 0.3)  # floor: 0.3 * mean(5.1 / 3) = 0.51
    torch.testing.assert_close(got, torch.tensor([[[0.25, 1.0, 1 / 0.51], [1.0, 1.0, 1.0]]]))


def _reference_l2_loss(objective: WindowPerturbation, keep: torch.Tensor) -> torch.Tensor:
    """The "l2" search loss, float64, one (row, KV head, query head, window query) at a time: (b, h_kv)."""
    attention, values = objective.attention.double(), objective.values_and_one[..., :-1].double()
    w_heads = objective.w_heads.double()
    b, h_kv, g, w, _ = attention.shape
    out = torch.zeros(b, h_kv, dtype=torch.float64)
    for bi, k, j, q in itertools.product(range(b), range(h_kv), range(g), range(w)):
        a = attention[bi, k, j, q]
        kept = keep[bi, k]
        mass = a[kept].sum()
        compressed = (a[kept] @ values[bi, k][kept]) / mass if mass > 0 else torch.zeros(values.shape[-1]).double()
        out[bi, k] += torch.linalg.vector_norm((a @ values[bi, k] - compressed) @ w_heads[k, j])
    return out


def test_l2_search_loss_matches_loop_reference():
    view = _view([18, 11], 18, groups=3, seed=13)
    objective = WindowPerturbation.of_view(view, 5, search="l2")
    for seed, fraction in enumerate((0.2, 0.6)):
        keep = _random_keep(view, fraction, seed)
        keep[:, :, -1] = True
        got = objective.search_loss(objective.kept_sums(keep))
        torch.testing.assert_close(got.double(), _reference_l2_loss(objective, keep), rtol=1e-4, atol=1e-4)
        # the "l1" search loss is L itself
        l1 = WindowPerturbation.of_view(view, 5)
        torch.testing.assert_close(l1.search_loss(l1.kept_sums(keep)), l1.loss(keep))


@pytest.mark.parametrize("weighted", [False, True], ids=["summed", "head-weights"])
@pytest.mark.parametrize("search", ["l1", "l2"])
def test_gain_is_the_first_order_decrease(search, weighted):
    """gain_i = -dS/d(alpha_i) for the search loss S, where alpha_i scales entry i's contribution A_i [V_i, 1] to the
    kept sums."""
    view = _view([16, 12], 16, groups=2, seed=4)
    objective = WindowPerturbation.of_view(view, 4, search=search)
    if weighted:
        objective.head_weights = torch.rand(2, 2, 2, generator=torch.Generator().manual_seed(5)) + 0.1
    keep = _random_keep(view, 0.5, 1)
    keep[:, :, -4:] = True
    sums = objective.kept_sums(keep)
    alpha = torch.zeros(keep.shape, requires_grad=True)
    # sums + sum_i alpha_i A_gqi [V_i, 1]
    moved = sums + torch.matmul(
        (objective.attention * alpha[:, :, None, None, :]).flatten(2, 3), objective.values_and_one
    ).view_as(sums)
    objective.search_loss(moved).sum().backward()
    gain = objective.gain(sums, objective.attention, objective.values_and_one)
    torch.testing.assert_close(gain, -alpha.grad, rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------------------------------------------
# the swap search


@settings(max_examples=40, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(min_value=1, max_value=24), min_size=1, max_size=3),
    h_kv=st.integers(1, 2),
    groups=st.integers(1, 3),
    window=st.integers(1, 6),
    fraction=st.floats(0.05, 1.0),
    start=st.sampled_from(["topk", "critical", "critical-unpooled"]),
    pool=st.integers(1, 8),
    rounds=st.integers(0, 6),
    candidates=st.integers(1, 16),
    max_weight=st.sampled_from([0.03, 0.3, 1.0]),
    anchor=st.sampled_from([0.0, 0.5]),
    search=st.sampled_from(["l1", "l2"]),
    candidates_by=st.sampled_from(["gain", "score"]),
    objective=st.sampled_from(["relative", "sum"]),
    floor=st.sampled_from([0.05, 0.3, 2.0]),
    seed=st.integers(0, 10_000),
)
def test_never_worse_than_its_start(
    lengths,
    h_kv,
    groups,
    window,
    fraction,
    start,
    pool,
    rounds,
    candidates,
    max_weight,
    anchor,
    search,
    candidates_by,
    objective,
    floor,
    seed,
):
    t = max(lengths)
    view = _view(lengths, t, h_kv=h_kv, groups=groups, d=4, hidden=6, seed=seed)
    scorer = SnapKVScorer(window=window, kernel=3)
    scores, protected = scorer.score(view), scorer.protected(view)
    gen = torch.Generator().manual_seed(seed)
    budgets = (torch.rand(len(lengths), h_kv, generator=gen) * fraction * t).long().clamp(min=1)
    selector = PerturbationSelector(
        window=window,
        start=start.removesuffix("-unpooled"),
        stage2="unpooled" if start.endswith("-unpooled") else "scores",
        pool=pool,
        rounds=rounds,
        candidates=candidates,
        max_weight=max_weight,
        anchor=anchor,
        search=search,
        candidates_by=candidates_by,
        objective=objective,
        floor=floor,
    )
    begin = selector.starting_selector().select(scores, budgets, protected, view)
    keep = selector.select(scores, budgets, protected, view)
    assert keep.dtype == torch.bool and keep.shape == begin.shape
    assert torch.equal(keep.sum(-1), begin.sum(-1))  # the budget of every head is unchanged
    assert not bool((keep & ~view.valid[:, None, :]).any())  # never a padding position
    assert torch.equal(keep & protected[:, None, :], begin & protected[:, None, :])  # protected entries untouched
    assert torch.equal(keep, selector.select(scores, budgets, protected, view))  # deterministic
    got, want = _reference_loss(view, keep, window), _reference_loss(view, begin, window)
    scale = _reference_loss(view, torch.zeros_like(keep), window)  # sum of ||o W||_1, the size of the outputs
    assert bool((got <= want + 1e-5 * scale + 1e-9).all()), (got, want)
    if objective == "relative":  # and never worse on the objective it searched
        got = _reference_relative_loss(view, keep, begin, window, floor)
        assert bool((got <= _reference_relative_loss(view, begin, begin, window, floor) + 1e-4).all()), got


def test_swaps_lower_the_objective_and_keep_the_anchor():
    view = _view([40, 31], 40, h_kv=2, groups=3, seed=7, sharpness=1.0)
    window = 6
    selector = PerturbationSelector(window=window, max_weight=1.0, anchor=0.5)
    keep, protected = _select(view, 14, selector, window)
    start, _ = _select(view, 14, TopKSelector(), window)
    objective = WindowPerturbation.of_view(view, window)
    after, before = objective.loss(keep), objective.loss(start)
    assert bool((after <= before).all()) and float(after.sum()) < 0.9 * float(before.sum())
    scorer = SnapKVScorer(window=window, kernel=3)
    anchored, _ = _select(view, 7, TopKSelector(), window)  # floor(0.5 * 14): the top of the scorer's ranking
    assert bool((keep | ~anchored).all())
    assert torch.equal(keep & protected[:, None, :], start & protected[:, None, :])
    assert scorer.protected(view).equal(protected)


def test_an_anchored_entry_the_critical_start_left_out_may_be_swapped_in(monkeypatch):
    """start="critical" with alpha below anchor: the anchor's best-scored entries that stage 2 dropped are not
    frozen out of the search (they were: excluded and never swappable); those the start kept stay frozen in."""
    view = _view([40], 40, h_kv=2, groups=2, seed=3, sharpness=1.0)
    seen = {}

    def improve(self, keep, free, *args):
        seen["keep"], seen["free"] = keep, free
        return keep

    monkeypatch.setattr(WindowPerturbation, "improve", improve)
    selector = PerturbationSelector(window=4, start="critical", alpha=0.1, anchor=1.0)
    _select(view, 14, selector, window=4)
    anchored, protected = _select(view, 14, TopKSelector(), window=4)  # anchor 1.0: the scorer's whole top 14
    left_out = anchored & ~seen["keep"] & ~protected[:, None, :]
    assert bool(left_out.any())  # CriticalKV's stage 2 chose other entries than the scores' top
    assert bool((seen["free"] | ~left_out).all())
    assert not bool((seen["free"] & anchored & seen["keep"]).any())


@pytest.mark.parametrize(
    "options", [dict(search="l1"), dict(candidates_by="score"), dict(search="l1", candidates_by="score")]
)
def test_search_variants_lower_the_objective(options):
    """The other searches (the default's is "l2") also lower L well below the start on a head with room to improve,
    never above it."""
    view = _view([40, 31], 40, h_kv=2, groups=3, seed=7, sharpness=1.0)
    window = 6
    keep, _ = _select(view, 14, PerturbationSelector(window=window, max_weight=1.0, **options), window)
    start, _ = _select(view, 14, TopKSelector(), window)
    objective = WindowPerturbation.of_view(view, window)
    after, before = objective.loss(keep), objective.loss(start)
    assert bool((after <= before).all()) and float(after.sum()) < 0.95 * float(before.sum())


def test_padded_row_selects_as_alone():
    """A left-padded row gets exactly the kept set it gets alone."""
    alone = _view([22], 22, seed=9)
    padded = _view([22, 30], 30, seed=9)
    for name in ("query", "keys", "values"):  # row 0 of the batch: the lone row behind 8 padding positions
        tensor = getattr(padded, name).clone()
        tensor[0, :, 8:] = getattr(alone, name)[0]
        setattr(padded, name, tensor)
    padded.module = alone.module
    selector = PerturbationSelector(window=4, max_weight=1.0)
    got, _ = _select(padded, 9, selector)
    want, _ = _select(alone, 9, selector)
    assert torch.equal(got[0, :, 8:], want[0]) and not bool(got[0, :, :8].any())


def test_kept_whole_rows_and_tiny_budgets_do_not_fail():
    view = _view([12, 3], 12, seed=2)
    selector = PerturbationSelector(window=4, max_weight=1.0)
    for budget in (1, 2, 12, 20):
        keep, _ = _select(view, budget, selector)
        start, _ = _select(view, budget, TopKSelector())
        assert torch.equal(keep.sum(-1), start.sum(-1))


def test_options_are_checked():
    for bad in (
        dict(start="random"),
        dict(window=0),
        dict(pool=0),
        dict(candidates=0),
        dict(rounds=-1),
        dict(max_weight=0.0),
        dict(anchor=1.5),
        dict(alpha=2.0),
        dict(norm_dtype="half"),
        dict(stage2="pooled"),
        dict(aggregate="median"),
        dict(search="l3"),
        dict(candidates_by="random"),
        dict(objective="mean"),
        dict(floor=0.0),
    ):
        with pytest.raises(ValueError):
            PerturbationSelector(**bad)
    assert isinstance(PerturbationSelector().starting_selector(), TopKSelector)
    assert PerturbationSelector(start="critical", alpha=0.25).starting_selector() == CriticalSelector(alpha=0.25)
    start = PerturbationSelector(start="critical", stage2="unpooled", window=8, aggregate="max").starting_selector()
    assert start == CriticalSelector(stage2="unpooled", window=8, aggregate="max")


# --------------------------------------------------------------------------------------------------------------
# brute force on tiny heads


def test_brute_force_optimum_bounds_the_search():
    """On random tiny heads (the analysis' exhaustive check): never below the optimum, never above top-k (its
    start), and on average much closer to the optimum than top-k and CriticalKV."""
    result = exhaustive_check(trials=40, entries=10, budget=4, seed=3)
    ratios = result["ratios"]
    assert all(row["measured"] >= 1 - 1e-4 for row in ratios)
    assert all(row["measured"] <= row["topk"] * (1 + 1e-4) for row in ratios)
    s = result["selectors"]
    assert s["measured"]["mean_ratio"] < s["topk"]["mean_ratio"] - 0.05
    assert s["measured"]["mean_ratio"] < s["critical"]["mean_ratio"]
    assert s["measured"]["fraction_optimal"] > s["topk"]["fraction_optimal"]


def test_search_against_brute_force_with_a_protected_window():
    """Causal window queries, a protected window, GQA: every kept set of the free entries is enumerated."""
    t, window, budget = 13, 3, 7
    for seed in range(6):
        view = _view([t], t, h_kv=1, groups=2, d=4, hidden=6, seed=seed, sharpness=1.5)
        objective = WindowPerturbation.of_view(view, window)
        best = math.inf
        for chosen in itertools.combinations(range(t - window), budget - window):
            keep = torch.zeros(1, 1, t, dtype=torch.bool)
            keep[0, 0, list(chosen)] = True
            keep[0, 0, t - window :] = True
            best = min(best, float(objective.loss(keep)))
        selector = PerturbationSelector(window=window, pool=8, candidates=16, rounds=16, max_weight=1.0, anchor=0.0)
        got = float(objective.loss(_select(view, budget, selector, window)[0]))
        start = float(objective.loss(_select(view, budget, TopKSelector(), window)[0]))
        assert best - 1e-4 <= got <= start + 1e-4


# --------------------------------------------------------------------------------------------------------------
# presets


@pytest.mark.parametrize("name", ["measured-snapkv", "measured-adakv"])
def test_presets_decide_and_take_options(name):
    assert name in PRESETS
    view = _view([48, 40], 48, h_kv=2, groups=2, seed=5)
    decision = build_method(name).decide(view, Budget(0.25))
    budgets = decision.budgets
    assert torch.equal(decision.keep.sum(-1), budgets)
    method = build_method(f"{name}:window=8;start=critical;alpha=0.25")
    assert method.scorer.window == 8 and method.selector.window == 8
    assert method.selector.start == "critical" and method.selector.alpha == 0.25
    assert method.name == f"{name}:window=8;start=critical;alpha=0.25"
