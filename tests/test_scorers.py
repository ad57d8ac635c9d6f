"""Scorers against naive references: SnapKV, StreamingLLM, TOVA, key norm."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from transformers import Gemma2Config, GptOssConfig
from transformers.models.gemma2 import modeling_gemma2 as gemma2_modeling
from transformers.models.gpt_oss import modeling_gpt_oss as gpt_oss_modeling

from criticalkv.budget import Budget
from criticalkv.runtime.method import Method
from criticalkv.scorers import KeyNormScorer, LayerView, SnapKVScorer, StreamingScorer, TOVAScorer
from criticalkv.scorers.base import CPU_KEY_CHUNK, pool_along_keys, window_attention
from criticalkv.selectors import CriticalSelector, TopKSelector


class _Attn(nn.Module):
    def __init__(self, h_q: int, d: int, hidden: int) -> None:
        super().__init__()
        self.o_proj = nn.Linear(h_q * d, hidden, bias=False)
        self.layer_idx = 0


def _view(lengths, t, h_kv=2, groups=2, d=8, seed=0, scale=1.0) -> LayerView:
    gen = torch.Generator().manual_seed(seed)
    b = len(lengths)
    valid = torch.zeros(b, t, dtype=torch.bool)
    for row, n in enumerate(lengths):
        valid[row, t - n :] = True
    return LayerView(
        _Attn(h_kv * groups, d, 16),
        torch.randn(b, h_kv * groups, t, d, generator=gen) * scale,
        torch.randn(b, h_kv, t, d, generator=gen) * scale,
        torch.randn(b, h_kv, t, d, generator=gen),
        valid,
        1.0 / math.sqrt(d),
    )


def _naive_attention(view: LayerView) -> torch.Tensor:
    """Full causal softmax of every query over every key, keys repeated to the query heads: (b, h_q, t, t)."""
    g = view.groups
    keys = view.keys.float().repeat_interleave(g, dim=1)  # (b, h_q, t, d)
    logits = view.query.float() @ keys.transpose(-1, -2) * view.scaling
    t = logits.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    allowed = causal[None, None] & view.valid[:, None, None, :]
    return torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)


def _naive_snapkv(view: LayerView, window: int, kernel: int = 5) -> torch.Tensor:
    """Scores of the non-window positions (b, h_kv, t - w)."""
    b, h_kv, t, _ = view.keys.shape
    w = min(window, t)
    attn = _naive_attention(view)[:, :, t - w :, : t - w]  # window rows, window columns dropped
    per_query_head = attn.mean(dim=2)  # (b, h_q, t - w)
    pooled = torch.stack(
        [
            F.avg_pool1d(per_query_head[:, h : h + 1], kernel, stride=1, padding=kernel // 2)[:, 0]
            for h in range(per_query_head.shape[1])
        ],
        dim=1,
    )  # count_include_pad=True, the torch default
    return pooled.view(b, h_kv, view.groups, t - w).mean(dim=2)


@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize(("lengths", "t"), [([40], 40), ([40, 33, 20], 40)], ids=["batch1", "batch3-left-padded"])
@pytest.mark.parametrize("window", [1, 8, 16])
def test_snapkv_matches_naive_reference(groups, lengths, t, window):
    view = _view(lengths, t, groups=groups, seed=groups + window, scale=2.0)
    scorer = SnapKVScorer(window=window)
    scores = scorer.score(view)
    assert scores.shape == (len(lengths), 2, t) and scores.dtype == torch.float32
    want = _naive_snapkv(view, window)
    real = view.valid[:, None, : t - window].expand_as(want)
    torch.testing.assert_close(scores[..., : t - window][real], want[real], rtol=1e-5, atol=1e-7)
    # window positions rank at least as high as any other score and are protected
    assert bool((scores[..., t - window :] >= scores[..., : t - window].amax(-1, keepdim=True)).all())
    protected = scorer.protected(view)
    want_protected = torch.zeros_like(view.valid)
    want_protected[:, t - window :] = True
    assert torch.equal(protected, want_protected & view.valid)


def test_window_attention_over_many_keys_is_one_product_and_softmax_to_the_bit():
    """On a CPU the window's logits come 512 keys at a time and the softmax is written over them: the same values
    as one product of every key and a fresh softmax, and the naive causal attention's window rows to rounding."""
    t, w, g = 2 * CPU_KEY_CHUNK + 77, 8, 3  # two whole key blocks and a part
    view = _view([t, t - 63], t, groups=g, d=16, seed=5, scale=2.0)
    b, h_kv, _, d = view.keys.shape
    got = window_attention(view, w)  # (b, h_kv, G, w, t)
    q = view.query[:, :, -w:].float().reshape(b, h_kv, g * w, d) * view.scaling
    logits = (q @ view.keys.float().transpose(-1, -2)).view(b, h_kv, g, w, t)
    logits[..., t - w :] = logits[..., t - w :].masked_fill(torch.ones(w, w, dtype=torch.bool).triu(1), -math.inf)
    logits = logits.masked_fill(~view.valid[:, None, None, None, :], -math.inf)
    assert torch.equal(got, torch.softmax(logits, dim=-1))
    naive = _naive_attention(view)[:, :, t - w :].reshape(b, h_kv, g, w, t)
    torch.testing.assert_close(got, naive, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_window_attention_is_the_familys_own_with_soft_cap_or_sinks(family):
    """Gemma 2 soft-caps its logits, gpt-oss adds a learned sink to each softmax: the window's attention equals the
    weights of the family's own eager attention (transformers') over the window's rows, padding included."""
    config_class, modeling = {
        "gemma2": (Gemma2Config, gemma2_modeling),
        "gpt_oss": (GptOssConfig, gpt_oss_modeling),
    }[family]
    config = config_class(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, attn_logit_softcapping=2.0
    )
    config._attn_implementation = "eager"
    module = modeling.__dict__[f"{config_class.__name__[:-6]}Attention"](config, layer_idx=1)
    if family == "gpt_oss":
        with torch.no_grad():
            module.sinks.copy_(torch.tensor([15.0, 20.0, 25.0, 18.0]))  # per query head, near the largest logits
    t, w = 30, 8
    view = _view([t, t - 9], t, h_kv=2, groups=2, d=16, seed=7, scale=3.0)  # logits of several units: the cap bites
    view.module = module
    causal = torch.ones(t, t, dtype=torch.bool).tril()[None, None] & view.valid[:, None, None, :]
    additive = torch.zeros(causal.shape).masked_fill(~causal, torch.finfo(torch.float32).min)
    _, weights = modeling.eager_attention_forward(
        module, view.query, view.keys, view.values, additive, scaling=view.scaling, dropout=0.0, softcap=2.0
    )  # (b, h_q, t, t); gpt-oss reads its sinks from the module and takes no soft cap
    want = weights[:, :, t - w :].reshape(2, 2, 2, w, t)
    got = window_attention(view, w)
    real = view.valid[:, None, None, None, :].expand_as(got)
    torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-7)
    assert bool((got[~real] == 0).all())
    plain = window_attention(_view([t, t - 9], t, h_kv=2, groups=2, d=16, seed=7, scale=3.0), w)
    assert (got - plain).abs().max() > 1e-2  # the soft cap or the sinks change the weights


def test_snapkv_kernel_option():
    view = _view([30, 25], 30, seed=3)
    for kernel in (1, 3, 7):
        scores = SnapKVScorer(window=6, kernel=kernel).score(view)
        want = _naive_snapkv(view, 6, kernel)
        torch.testing.assert_close(scores[1, :, 5:24], want[1, :, 5:], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(scores[0, :, :24], want[0], rtol=1e-5, atol=1e-7)
    for bad in (dict(window=0), dict(kernel=0), dict(kernel=4)):
        with pytest.raises(ValueError):
            SnapKVScorer(**bad)


def test_snapkv_padding_does_not_change_a_row():
    """A left-padded row scores its real positions exactly as the same row alone does."""
    padded = _view([40, 25], 40, seed=8, scale=2.0)
    alone = LayerView(
        padded.module,
        padded.query[1:, :, 15:],
        padded.keys[1:, :, 15:],
        padded.values[1:, :, 15:],
        torch.ones(1, 25, dtype=torch.bool),
        padded.scaling,
    )
    scorer = SnapKVScorer(window=8)
    torch.testing.assert_close(scorer.score(padded)[1:, :, 15:], scorer.score(alone), rtol=1e-5, atol=1e-7)
    decision_p = Method(scorer, selector=CriticalSelector(window=8)).decide(padded, Budget(0.4))
    decision_a = Method(scorer, selector=CriticalSelector(window=8)).decide(alone, Budget(0.4))
    assert torch.equal(decision_p.keep[1:, :, 15:], decision_a.keep)
    assert not bool(decision_p.keep[1:, :, :15].any())


@pytest.mark.parametrize("selector", [TopKSelector(), CriticalSelector(window=8)], ids=["topk", "critical"])
def test_snapkv_window_always_kept(selector):
    view = _view([48, 40], 48, seed=4)
    decision = Method(SnapKVScorer(window=8), selector=selector).decide(view, Budget(0.25))
    assert decision.keep.sum(-1).tolist() == [[12, 12], [10, 10]]
    assert bool(decision.keep[:, :, -8:].all())


def test_snapkv_budget_smaller_than_window_keeps_most_recent():
    view = _view([48], 48, seed=5)
    decision = Method(SnapKVScorer(window=16), selector=TopKSelector()).decide(view, Budget(5))
    expected = torch.zeros(1, 2, 48, dtype=torch.bool)
    expected[..., -5:] = True
    assert torch.equal(decision.keep, expected)


@pytest.mark.parametrize("budget", [Budget(0.2), Budget(1)])
@pytest.mark.parametrize("length", [1, 4, 5, 16])
def test_context_not_longer_than_window_is_kept_whole(length, budget):
    """Even where the fraction rounds to zero entries (0.2 of 1-4 tokens)."""
    view = _view([length], length, seed=6)
    decision = Method(SnapKVScorer(window=16), selector=CriticalSelector(window=16)).decide(view, budget)
    assert decision.keep is None
    assert decision.kept_whole.tolist() == [True]
    assert decision.budgets.tolist() == [[length, length]]


def test_short_row_kept_whole_beside_a_compressed_row_where_its_fraction_rounds_to_zero():
    view = _view([40, 3], 40, seed=8)
    decision = Method(SnapKVScorer(window=16), selector=CriticalSelector(window=16)).decide(view, Budget(0.2))
    assert decision.kept_whole.tolist() == [False, True]
    assert decision.budgets.tolist() == [[8, 8], [3, 3]]
    assert decision.keep.sum(-1).tolist() == [[8, 8], [3, 3]]
    assert torch.equal(decision.keep[1], view.valid[1].expand(2, -1))


def test_mixed_batch_short_row_kept_whole_long_row_compressed():
    view = _view([40, 10], 40, seed=7)
    decision = Method(SnapKVScorer(window=16), selector=CriticalSelector(window=16)).decide(view, Budget(0.5))
    assert decision.kept_whole.tolist() == [False, True]
    assert torch.equal(decision.keep[1], view.valid[1].expand(2, -1))  # every real entry, no padding
    assert decision.budgets.tolist() == [[20, 20], [10, 10]]
    assert decision.keep.sum(-1).tolist() == [[20, 20], [10, 10]]
    assert bool(torch.isfinite(SnapKVScorer(window=16).score(view)[0]).all())


# ----------------------------------------------------------------------------------------------------------------
# StreamingLLM


def test_streaming_protects_first_real_tokens_under_left_padding():
    view = _view([20, 13, 3], 20, seed=0)
    protected = StreamingScorer().protected(view)
    assert protected[0].nonzero().flatten().tolist() == [0, 1, 2, 3]
    assert protected[1].nonzero().flatten().tolist() == [7, 8, 9, 10]
    assert protected[2].nonzero().flatten().tolist() == [17, 18, 19]  # a 3-token row: every token is a sink
    assert StreamingScorer(sinks=2).protected(view)[1].nonzero().flatten().tolist() == [7, 8]


def test_streaming_keeps_sinks_and_recent():
    view = _view([20, 13], 20, seed=0)
    decision = Method(StreamingScorer(), selector=TopKSelector()).decide(view, Budget(0.5))
    assert decision.keep.sum(-1).tolist() == [[10, 10], [6, 6]]
    row0 = [0, 1, 2, 3, 14, 15, 16, 17, 18, 19]
    row1 = [7, 8, 9, 10, 18, 19]
    for h in range(2):
        assert decision.keep[0, h].nonzero().flatten().tolist() == row0
        assert decision.keep[1, h].nonzero().flatten().tolist() == row1
    scores = StreamingScorer().score(view)
    assert bool((scores[..., 1:] > scores[..., :-1]).all())  # strictly increasing with recency
    assert bool((scores > 0).all())  # non-negative: the critical selector accepts them


# ----------------------------------------------------------------------------------------------------------------
# TOVA


@pytest.mark.parametrize("groups", [1, 3])
def test_tova_scores_identical_across_heads_and_match_reference(groups):
    view = _view([24, 17], 24, h_kv=3, groups=groups, seed=1, scale=2.0)
    scores = TOVAScorer().score(view)
    assert scores.shape == (2, 3, 24)
    for h in range(1, 3):
        assert torch.equal(scores[:, h], scores[:, 0])
    want = _naive_attention(view)[:, :, -1, :].mean(dim=1)  # last query, mean over all query heads
    torch.testing.assert_close(scores[:, 0][view.valid], want[view.valid], rtol=1e-5, atol=1e-7)
    assert TOVAScorer().protected(view).nonzero().tolist() == [[0, 23], [1, 23]]
    decision = Method(TOVAScorer(), selector=TopKSelector()).decide(view, Budget(0.5))
    for h in range(1, 3):
        assert torch.equal(decision.keep[:, h], decision.keep[:, 0])


# ----------------------------------------------------------------------------------------------------------------
# key norm


def test_key_norm_scores():
    view = _view([10, 6], 10, seed=2)
    scores = KeyNormScorer().score(view)
    torch.testing.assert_close(scores, -view.keys.norm(dim=-1))
    assert not bool(KeyNormScorer().protected(view).any())
    decision = Method(KeyNormScorer(), selector=TopKSelector()).decide(view, Budget(3))
    for bi in range(2):
        for h in range(2):
            norms = view.keys[bi, h].norm(dim=-1).masked_fill(~view.valid[bi], float("inf"))
            assert decision.keep[bi, h].nonzero().flatten().tolist() == sorted(norms.argsort()[:3].tolist())


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 6),
    n=st.integers(1, 40),
    kernel=st.sampled_from([1, 3, 5, 7, 9]),
    seed=st.integers(0, 2**16),
)
def test_pool_along_keys_is_torchs_average_pool_to_the_bit(rows, n, kernel, seed):
    """The shifted-add pool gives ``F.avg_pool1d``'s float32 bits, rows shorter than the kernel included."""
    x = torch.rand(rows, n, generator=torch.Generator().manual_seed(seed)).softmax(-1)
    want = F.avg_pool1d(x[:, None], kernel, stride=1, padding=kernel // 2)[:, 0]
    assert torch.equal(pool_along_keys(x, kernel), want)
