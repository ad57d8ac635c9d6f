"""DefensiveKV: the scorer and the selector's ranking against slow per-row loops, the two window-mass slices, the
cross-layer allocators (reference and bounded) and ``CompressedLayer.shrink``."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig

import criticalkv
from criticalkv.allocators import BoundedCrossLayerAllocator, CrossLayerAllocator
from criticalkv.budget import Budget
from criticalkv.cache import CompressedLayer
from criticalkv.errors import CacheStateError, CriticalKVError
from criticalkv.methods import build_method
from criticalkv.runtime.method import Method
from criticalkv.runtime.session import ContextSession
from criticalkv.runtime.shared_prefill import SharedPrefill
from criticalkv.scorers import DefensiveScorer, LayerView, Scorer, SnapKVScorer
from criticalkv.scorers.base import last_positions
from criticalkv.scorers.defensive import window_statistics
from criticalkv.selectors import DefensiveSelector, Selector, TopKSelector
from criticalkv.selectors.base import keep_protected
from criticalkv.selectors.defensive import take_ordered

# --------------------------------------------------------------------------------------------------------------
# helpers


class _Attn(nn.Module):
    def __init__(self, h_q: int, d: int, hidden: int, layer_idx: int = 0, layers: int = 1) -> None:
        super().__init__()
        self.o_proj = nn.Linear(h_q * d, hidden, bias=False)
        self.layer_idx = layer_idx
        self.config = LlamaConfig(num_hidden_layers=layers)


def _valid(lengths: list[int], t: int) -> torch.Tensor:
    valid = torch.zeros(len(lengths), t, dtype=torch.bool)
    for row, n in enumerate(lengths):
        valid[row, t - n :] = True
    return valid


def _view(lengths, t=40, h_kv=2, g=2, d=8, hidden=12, seed=0, layer_idx=0, layers=1) -> LayerView:
    gen = torch.Generator().manual_seed(seed)
    module = _Attn(h_kv * g, d, hidden, layer_idx, layers).requires_grad_(False)
    with torch.no_grad():
        module.o_proj.weight.copy_(torch.randn(hidden, h_kv * g * d, generator=gen))
    b = len(lengths)
    query = 2 * torch.randn(b, h_kv * g, t, d, generator=gen)
    keys = torch.randn(b, h_kv, t, d, generator=gen)
    values = torch.randn(b, h_kv, t, d, generator=gen)
    return LayerView(module, query, keys, values, _valid(lengths, t), 1.0 / math.sqrt(d))


def _row_attention(view: LayerView, row: int, w: int) -> torch.Tensor:
    """Softmax of the last w real queries over the row's real keys, causal, in float64: (h_q, w, n_real)."""
    real = view.valid[row].nonzero().flatten()
    q = view.query[row][:, real[-w:]].double()  # (h_q, w, d)
    k = view.keys[row][:, real].double().repeat_interleave(view.groups, dim=0)  # (h_q, n, d)
    n = len(real)
    out = torch.zeros(q.shape[0], w, n, dtype=torch.float64)
    for head in range(q.shape[0]):
        for i in range(w):
            pos = n - w + i
            logits = [float(q[head, i] @ k[head, j]) * view.scaling for j in range(pos + 1)]
            top = max(logits)
            exps = [math.exp(x - top) for x in logits]
            for j in range(pos + 1):
                out[head, i, j] = exps[j] / sum(exps)
    return out


def _slow_defensive(view: LayerView, window: int, kernel: int) -> list[torch.Tensor]:
    """Per row, the defensive scores of its real context positions: (h_kv, n_real - w), float64."""
    out = []
    for row in range(view.valid.shape[0]):
        attention = _row_attention(view, row, window)
        h_q, w, n = attention.shape
        ctx = n - w
        peak = torch.zeros(view.keys.shape[1], ctx, dtype=torch.float64)
        for head in range(h_q):
            for i in range(w):
                a = attention[head, i, :ctx]
                pooled = torch.tensor(
                    [
                        sum(a[k] for k in range(j - kernel // 2, j + kernel // 2 + 1) if 0 <= k < ctx) / kernel
                        for j in range(ctx)
                    ],
                    dtype=torch.float64,
                )
                pooled = pooled * (a.sum() / pooled.sum())
                kv = head // view.groups
                peak[kv] = torch.maximum(peak[kv], pooled)
        out.append(torch.maximum(peak, peak.mean(-1, keepdim=True)))
    return out


def _slow_norms(view: LayerView) -> torch.Tensor:
    """mean over the GQA group of ||V_i W_O^g||_1: (b, h_kv, t), float64."""
    b, h_kv, t, d = view.values.shape
    weight = view.o_proj_weight.double()
    out = torch.zeros(b, h_kv, t, dtype=torch.float64)
    for row in range(b):
        for kv in range(h_kv):
            for g in range(view.groups):
                head = kv * view.groups + g
                w_o = weight[:, head * d : (head + 1) * d]  # (hidden, d)
                out[row, kv] += (view.values[row, kv].double() @ w_o.T).abs().sum(-1) / view.groups
    return out


# --------------------------------------------------------------------------------------------------------------
# scorer


@pytest.mark.parametrize("window,kernel", [(8, 5), (6, 3), (5, 1)])
def test_defensive_scores_match_slow_reference(window, kernel):
    view = _view([40, 31], seed=1)
    scores = DefensiveScorer(window=window, kernel=kernel).score(view)
    for row, expected in enumerate(_slow_defensive(view, window, kernel)):
        real = view.valid[row].nonzero().flatten()
        got = scores[row][:, real[: len(real) - window]]
        torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-6)
        assert (scores[row][:, real[-window:]] >= got.max(-1, keepdim=True).values).all()  # window: row maximum


def _last_row_alone(padded: LayerView, pad: int) -> LayerView:
    """The last row of a left-padded view as a batch of one, its ``pad`` padding positions cut off."""
    return LayerView(
        padded.module,
        padded.query[-1:, :, pad:],
        padded.keys[-1:, :, pad:],
        padded.values[-1:, :, pad:],
        padded.valid[-1:, pad:],
        padded.scaling,
    )


def test_padding_does_not_change_a_row():
    padded = _view([40, 29], seed=2)
    alone = _last_row_alone(padded, 11)
    torch.testing.assert_close(
        DefensiveScorer(window=8).score(padded)[1, :, 11:], DefensiveScorer(window=8).score(alone)[0]
    )


def test_window_masses_match_slow_sums():
    view = _view([40, 33], seed=3)
    w = 8
    stats = window_statistics(view, w)
    for row in range(2):
        attention = _row_attention(view, row, w)
        n = attention.shape[-1]
        intended = attention[..., n - w :].sum(-1).mean()
        reference = attention[..., n - 2 * w : n - w].sum(-1).mean()
        assert stats.window_mass("intended")[row].item() == pytest.approx(intended.item(), rel=1e-5)
        assert stats.window_mass("reference")[row].item() == pytest.approx(reference.item(), rel=1e-5)
        mean = attention[..., : n - w].view(view.keys.shape[1], view.groups, w, -1).mean(dim=(1, 2))
        real = view.valid[row].nonzero().flatten()
        torch.testing.assert_close(stats.mean_attention[row][:, real[: n - w]].double(), mean, rtol=1e-4, atol=1e-7)
        assert (stats.mean_attention[row][:, real[n - w :]] == 0).all()


# --------------------------------------------------------------------------------------------------------------
# selector


def _slow_rank(scores, row_budgets, protected, view, window, mass, mass_slice):
    """DefensiveKV's ranking, head by head, from the definitions in docs/method.md."""
    norms = _slow_norms(view)
    stats = window_statistics(view, window)
    out = torch.zeros_like(scores, dtype=torch.float64)
    for row in range(scores.shape[0]):
        cand = (view.valid[row] & ~protected[row]).nonzero().flatten().tolist()
        weighted = {
            (h, i): float(scores[row, h, i]) * float(norms[row, h, i] / norms[row, :, i].sum())
            for h in range(scores.shape[1])
            for i in cand
        }
        top = float(torch.nextafter(torch.tensor(max(weighted.values())), torch.tensor(math.inf)))
        target = mass - float(stats.window_mass(mass_slice)[row])
        cap = int(row_budgets[row]) - int((protected[row] & view.valid[row]).sum())
        for h in range(scores.shape[1]):
            mean = {i: float(stats.mean_attention[row, h, i]) for i in cand}
            total = sum(mean.values())
            order = sorted(cand, key=lambda i: -mean[i])
            chosen, running = set(), 0.0
            for i in order:
                running += mean[i] / total
                if running >= target or len(chosen) >= cap:
                    break
                chosen.add(i)
            for i in range(scores.shape[2]):
                if protected[row, i] or i in chosen:
                    out[row, h, i] = top
                elif i in cand:
                    out[row, h, i] = weighted[(h, i)]
    return out


@pytest.mark.parametrize("mass_slice", ["intended", "reference"])
@pytest.mark.parametrize("mass", [0.9, 0.5])
def test_rank_matches_slow_reference(mass_slice, mass):
    view = _view([40, 34], seed=4)
    window = 6
    scores = DefensiveScorer(window=window).score(view)
    protected = last_positions(view, window)
    row_budgets = torch.tensor([16, 12])
    selector = DefensiveSelector(window=window, mass=mass, mass_slice=mass_slice)
    ranked = selector.rank(scores, row_budgets, protected, view)
    expected = _slow_rank(scores, row_budgets, protected, view, window, mass, mass_slice)
    real = view.valid[:, None, :].expand_as(ranked)
    torch.testing.assert_close(ranked[real].double(), expected[real], rtol=1e-4, atol=1e-7)


def _stage1_counts(view, selector, row_budgets, window):
    scores = DefensiveScorer(window=window).score(view)
    protected = last_positions(view, window)
    ranked = selector.rank(scores, row_budgets, protected, view)
    top = ranked.masked_fill(~view.valid[:, None, :], 0).amax(dim=(1, 2))[:, None, None]
    return ((ranked == top) & ~protected[:, None, :]).sum(-1)


def test_mass_slices_differ_when_the_window_attends_to_itself():
    """Window queries aligned with the window's own keys put most of their mass there: the intended window mass
    is large, so stage 1 needs little; the reference slice (the context just before the window) sees almost none."""
    window = 6
    view = _view([48], t=48, seed=5)
    direction = torch.ones(8) / math.sqrt(8)
    view.query[:, :, -window:] = 6 * direction
    view.keys[:, :, -window:] = 6 * direction
    stats = window_statistics(view, window)
    assert stats.window_mass("intended")[0] > 0.5 > stats.window_mass("reference")[0]
    budgets = torch.tensor([30])
    intended = _stage1_counts(view, DefensiveSelector(window=window), budgets, window)
    reference = _stage1_counts(view, DefensiveSelector(window=window, mass_slice="reference"), budgets, window)
    assert (intended < reference).all()


def test_mass_slices_agree_when_the_two_slices_carry_equal_mass():
    """Uniform attention (zero queries) over a context whose last 2w columns sit inside it: the two slices differ
    only in which w columns are summed, and each window query gives every visible key the same weight."""
    window = 4
    view = _view([40], t=40, seed=6)
    view.query.zero_()
    stats = window_statistics(view, window)
    # query i (0-based in the window) sees 36 + i + 1 keys: i + 1 of them are window keys, 4 are the slice before
    expected_intended = sum((i + 1) / (37 + i) for i in range(window)) / window
    expected_reference = sum(window / (37 + i) for i in range(window)) / window
    assert stats.window_mass("intended")[0].item() == pytest.approx(expected_intended, rel=1e-5)
    assert stats.window_mass("reference")[0].item() == pytest.approx(expected_reference, rel=1e-5)


def test_defensive_keeps_every_stage1_entry_and_a_row_as_alone():
    """Stage 1 and the window must outrank the layer's largest weighted entry: tied with it, AdaKV's pooled contest
    has one more top-valued candidate than places when stage 1 reaches its cap in every head, drops a stage-1
    entry, and which head loses it follows torch.topk's order among ties, so a padded row differs from itself
    alone."""
    window, budget = 8, Budget(0.2)
    padded = _view([60, 47], t=60, seed=24)
    alone = _last_row_alone(padded, 13)
    method = build_method("defensive", window=window)
    decision = method.decide(padded, budget)
    protected = last_positions(padded, window)
    candidates = padded.valid & ~protected
    row_budgets = budget.entries_for(padded.lengths)
    stats = window_statistics(padded, window)
    stage1 = method.selector._stage1(row_budgets, protected, candidates, padded.valid, stats)
    assert (stage1.sum(-1) == (row_budgets - window)[:, None]).all()  # the cap binds in every head
    assert not (stage1 & ~decision.keep).any()
    assert torch.equal(build_method("defensive", window=window).decide(alone, budget).keep[0], decision.keep[1, :, 13:])


def test_select_breaks_ties_by_position():
    view = _view([12], t=12)
    scores = torch.tensor([[[1.0, 3, 3, 3, 2, 3, 0, 0, 0, 0, 0, 0]]]).expand(1, 2, 12).clone()
    protected = torch.zeros(1, 12, dtype=torch.bool)
    protected[0, -1] = True
    keep = DefensiveSelector().select(scores, torch.tensor([[3, 4]]), protected, view)
    assert keep[0, 0].nonzero().flatten().tolist() == [1, 2, 11]
    assert keep[0, 1].nonzero().flatten().tolist() == [1, 2, 3, 11]


def test_presets_compose():
    method = build_method("layer-defensive-bounded", window=16, mass_slice="reference", safeguard=0.2, kernel=3)
    assert (method.scorer.window, method.selector.window, method.scorer.kernel) == (16, 16, 3)
    assert method.selector.mass_slice == "reference" and method.allocator.safeguard == 0.2
    assert build_method("layer-defensive").deferred and not build_method("layer-defensive-bounded").deferred
    assert not build_method("defensive").deferred
    with pytest.raises(ValueError):
        DefensiveSelector(mass_slice="window")


# --------------------------------------------------------------------------------------------------------------
# cross-layer allocators on given scores


class _Given(Scorer):
    """A scorer returning scores stored in the view (tests drive allocators with chosen scores)."""

    window = 1

    def __init__(self, protect: int) -> None:
        self.protect = protect

    def score(self, view: LayerView) -> torch.Tensor:
        return view.memo["given"]

    def protected(self, view: LayerView) -> torch.Tensor:
        return last_positions(view, self.protect)


class _OrderedTopK(Selector):
    """Top-k with ties broken by position: the selection a bounded allocator reproduces exactly under ties."""

    def select(self, scores, budgets, protected, view):
        keep = keep_protected(protected, budgets)
        return take_ordered(scores, keep, view.valid, budgets - keep.sum(-1))


def _layers(lengths, t, h, layers, seed, ties):
    gen = torch.Generator().manual_seed(seed)
    views = []
    for index in range(layers):
        view = _view(lengths, t=t, h_kv=h, g=1, d=4, hidden=4, seed=seed + index, layer_idx=index, layers=layers)
        scores = torch.rand(len(lengths), h, t, generator=gen)
        if ties:
            scores = (scores * 4).floor() / 4  # few levels: many ties inside and across layers
        view.memo["given"] = scores
        views.append(view)
    return views


def _run_bounded(method, views, budget):
    """What the runtime does with a streaming allocator: decide layer by layer, apply shrink orders."""
    state: dict = {}
    keeps, held = [], []
    for view in views:
        decision = method.decide(view, budget, state)
        for index, order in decision.shrink.items():
            shrunk = torch.zeros_like(keeps[index])
            shrunk[keeps[index]] = order
            assert not (shrunk & ~keeps[index]).any()
            keeps[index] = shrunk
        keeps.append(decision.keep)
        held.append(sum(int(k.sum()) for k in keeps))
    return keeps, held


@settings(max_examples=40, suppress_health_check=[HealthCheck.too_slow])
@given(
    layers=st.integers(1, 5),
    h=st.integers(1, 3),
    lengths=st.lists(st.integers(10, 30), min_size=1, max_size=3),
    fraction=st.sampled_from([0.1, 0.25, 0.5, 0.9]),
    protect=st.integers(0, 5),
    safeguard=st.sampled_from([0.0, 0.3]),
    ties=st.booleans(),
    seed=st.integers(0, 10_000),
)
def test_bounded_equals_reference(layers, h, lengths, fraction, protect, safeguard, ties, seed):
    t = max(lengths)
    budget = Budget(fraction)
    row_budgets = budget.entries_for(torch.tensor(lengths))
    views = _layers(lengths, t, h, layers, seed, ties)
    selector = _OrderedTopK() if ties else TopKSelector()
    reference = Method(_Given(protect), CrossLayerAllocator(safeguard), selector).decide_layers(views, budget)
    if reference[0].keep is None:  # every row kept whole
        return
    kept = torch.stack([d.budgets for d in reference])  # (L, b, h)
    total = layers * h * row_budgets
    whole = (row_budgets >= torch.tensor(lengths)) | (min(protect, t) >= torch.tensor(lengths))
    assert torch.equal(kept.sum(dim=(0, 2))[~whole], total[~whole])  # budgets sum to the global total
    assert (kept >= 1).all() and (kept <= torch.tensor(lengths)[None, :, None]).all()
    p = torch.minimum(torch.tensor(protect), row_budgets)
    assert (kept >= p[None, :, None]).all()  # every head keeps its protected positions (up to the budget)
    for d in reference:
        assert torch.equal(d.keep.sum(-1), d.budgets)
    bounded = Method(_Given(protect), BoundedCrossLayerAllocator(safeguard), selector)
    keeps, held = _run_bounded(bounded, views, budget)
    for keep, d in zip(keeps, reference, strict=True):
        assert torch.equal(keep, d.keep)  # the same entries, ties included
    final = sum(int(d.keep.sum()) for d in reference)
    assert max(held) <= final  # never more than the final budget held by compressed layers


def test_cross_layer_moves_budget_between_layers():
    views = _layers([40], 40, 2, 3, seed=0, ties=False)
    views[0].memo["given"] = views[0].memo["given"] * 10  # layer 0 scores dominate
    budget = Budget(0.25)
    decisions = Method(_Given(2), CrossLayerAllocator(), TopKSelector()).decide_layers(views, budget)
    per_layer = [int(d.budgets.sum()) for d in decisions]
    # 60 entries: every head reserves its 2 protected ones (12 in all), layer 0 wins the whole pool of 48
    assert per_layer == [2 * 2 + 48, 2 * 2, 2 * 2]


@pytest.mark.parametrize("allocator", [CrossLayerAllocator(), BoundedCrossLayerAllocator()])
def test_budget_one_keeps_everything(allocator):
    views = _layers([30, 20], 30, 2, 3, seed=1, ties=False)
    method = Method(_Given(4), allocator, DefensiveSelector(window=_Given.window))
    state: dict = {}
    for view in views:
        decision = method.decide(view, Budget(1.0), state)
        assert decision.keep is None and not decision.shrink
        assert torch.equal(decision.budgets, view.lengths[:, None].expand(-1, 2))


def test_bounded_refuses_a_layer_without_its_prefill():
    views = _layers([30], 30, 2, 3, seed=2, ties=False)
    method = Method(_Given(4), BoundedCrossLayerAllocator(), TopKSelector())
    with pytest.raises(CriticalKVError):
        method.decide(views[0], Budget(0.2))  # no per-prefill state
    with pytest.raises(CriticalKVError):
        method.decide(views[1], Budget(0.2), {})  # layer 1 before layer 0


# --------------------------------------------------------------------------------------------------------------
# CompressedLayer.shrink


def test_shrink_keeps_the_flagged_entries_in_order():
    gen = torch.Generator().manual_seed(0)
    b, h, t, d = 2, 3, 10, 4
    keys, values = torch.randn(b, h, t, d, generator=gen), torch.randn(b, h, t, d, generator=gen)
    keep = torch.rand(b, h, t, generator=gen) < 0.6
    later = keep & (torch.rand(b, h, t, generator=gen) < 0.5)
    direct, shrunk = CompressedLayer(), CompressedLayer()
    for layer in (direct, shrunk):
        layer.update(keys, values)
    direct.compress(later)
    shrunk.compress(keep)
    shrunk.update(torch.ones(b, h, 2, d), torch.ones(b, h, 2, d))  # a tail: untouched by shrink
    shrunk.shrink(later[keep])
    assert torch.equal(shrunk.lengths, later.sum(-1))
    assert torch.equal(shrunk.context_keys, direct.context_keys)
    assert torch.equal(shrunk.context_values, direct.context_values)
    assert shrunk.tail == 2 and shrunk.entries() == int(later.sum()) + b * h * 2
    with pytest.raises(CacheStateError):
        shrunk.shrink(torch.ones(3, dtype=torch.bool))
    fresh = CompressedLayer()
    fresh.update(keys, values)
    with pytest.raises(CacheStateError):
        fresh.shrink(torch.ones(b * h * t, dtype=torch.bool))


# --------------------------------------------------------------------------------------------------------------
# through the runtime, on a small random Llama


def _model(layers=4):
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=1024,
        head_dim=16,
        num_hidden_layers=layers,
    )
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def _generate(model, method, ids, mask, budget=0.3):
    with criticalkv.compress(model, method, budget) as compressor:
        compressor.record_keep = True
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    return out, compressor.records


@pytest.mark.parametrize(
    "reference,bounded",
    [
        ("layer-defensive", "layer-defensive-bounded"),
        ("layer-defensive:mass_slice=reference", "layer-defensive-bounded:mass_slice=reference"),
        (
            Method(SnapKVScorer(), CrossLayerAllocator(safeguard=0.2), TopKSelector()),
            Method(SnapKVScorer(), BoundedCrossLayerAllocator(safeguard=0.2), TopKSelector()),
        ),
    ],
)
def test_runtime_bounded_equals_reference(reference, bounded):
    model = _model()
    ids = torch.randint(0, 256, (2, 200), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, :30] = 0
    out_ref, rec_ref = _generate(model, build_method(reference) if isinstance(reference, str) else reference, ids, mask)
    out_bnd, rec_bnd = _generate(model, build_method(bounded) if isinstance(bounded, str) else bounded, ids, mask)
    assert torch.equal(out_ref, out_bnd)
    total = 4 * 2 * (int(0.3 * 170) + int(0.3 * 200))
    assert sum(int(r.kept.sum()) for r in rec_bnd) == total
    for a, b in zip(rec_ref, rec_bnd, strict=True):
        assert a.layer == b.layer and torch.equal(a.kept, b.kept) and torch.equal(a.keep, b.keep)
        assert torch.equal(b.keep.sum(-1), b.kept)  # records follow the shrinks


def test_bounded_holds_one_dense_layer_and_at_most_the_final_budget():
    model = _model(layers=5)
    ids = torch.randint(0, 256, (1, 160), generator=torch.Generator().manual_seed(4))
    seen: list[tuple[int, int]] = []

    def observe(module, args, kwargs, output):  # after each layer's attention
        layers = [layer for layer in kwargs["cache"].layers if layer.is_initialized]
        dense = sum(not layer.is_compressed for layer in layers)
        compressed = sum(int(layer.lengths.sum()) for layer in layers if layer.is_compressed)
        seen.append((dense, compressed))

    hooks = [layer.self_attn.register_forward_hook(observe, with_kwargs=True) for layer in model.model.layers]
    observed = {}
    for name in ("layer-defensive", "layer-defensive-bounded"):
        ContextSession(model, build_method(name, window=8), 0.2).prefill(ids)  # window < budget: a pool to share
        observed[name], seen = seen, []
    for hook in hooks:
        hook.remove()
    final = 5 * 2 * int(0.2 * 160)
    assert [dense for dense, _ in observed["layer-defensive"]] == [1, 2, 3, 4, 5]  # the reference waits dense
    assert all(dense == 0 for dense, _ in observed["layer-defensive-bounded"])  # compressed on arrival
    held = [compressed for _, compressed in observed["layer-defensive-bounded"]]
    assert max(held) <= final and held[-1] == final
    assert held[0] == 2 * 8 + 5 * 2 * (32 - 8)  # layer 0: its windows and the whole model's pool, until others compete


def test_deferred_bounded_equals_per_layer_bounded():
    """A deferred method (``defer=True``, or a scorer that waits for the end of the prefill) with the streaming
    allocator decides every layer at the end; it refused with "use it through criticalkv.compress"."""
    model = _model()
    ids = torch.randint(0, 256, (2, 150), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    mask[1, :20] = 0
    method = build_method("layer-defensive-bounded", window=8)
    out, records = _generate(model, method, ids, mask)
    out_deferred, records_deferred = _generate(model, dataclasses.replace(method, defer=True), ids, mask)
    assert torch.equal(out, out_deferred)
    for a, b in zip(records, records_deferred, strict=True):
        assert a.layer == b.layer and torch.equal(a.kept, b.kept) and torch.equal(a.keep, b.keep)


def test_shared_prefill_bounded_target_equals_its_own_run():
    model = _model()
    ids = torch.randint(0, 256, (2, 120), generator=torch.Generator().manual_seed(5))
    question = torch.randint(0, 256, (2, 4), generator=torch.Generator().manual_seed(6))
    pairs = [
        ("bounded", "layer-defensive-bounded", 0.25),
        ("reference", "layer-defensive", 0.25),
        ("d", "defensive", 0.25),
    ]
    shared = SharedPrefill(model, pairs)
    sessions = shared.prefill(ids)
    answers = {label: sessions[label].ask(question, max_new_tokens=4).tokens for label, _, _ in pairs}
    assert torch.equal(answers["bounded"], answers["reference"])
    assert sessions["bounded"].kv_entries() == sessions["reference"].kv_entries() == 4 * 2 * 2 * 30
    by_label = {t.label: t for t in shared.targets}
    for a, b in zip(by_label["bounded"].records, by_label["reference"].records, strict=True):
        assert torch.equal(a.kept, b.kept)  # records show the final, shrunk counts
    own = ContextSession(model, "layer-defensive-bounded", 0.25)
    own.prefill(ids)
    assert torch.equal(own.ask(question, max_new_tokens=4).tokens, answers["bounded"])
