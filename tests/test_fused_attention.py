"""The fused attention paths over a compressed layer (uniform and padded SDPA, flash-attn varlen) against masked dense
attention, the rule that picks a path, and the environment variable that forces one."""

from __future__ import annotations

import math
from importlib.util import find_spec

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, LlamaConfig

import criticalkv
from criticalkv.cache import CompressedLayer, fused_attention
from criticalkv.cache import attention as attention_module
from criticalkv.cache.attention import compressed_attention, segment_attention
from criticalkv.cache.fused_attention import (
    ATTENTION_ENV_VAR,
    CPU_PADDED_MAX_BYTES,
    CPU_SEGMENT_ENTRIES,
    PADDING_FACTOR,
    choose_path,
    flash_reasons,
    flash_varlen_attention,
    is_plain_causal,
    padded_attention,
    padded_segments,
    padding_fits,
    uniform_attention,
    varlen_inputs,
)
from criticalkv.errors import CriticalKVError

HAS_FLASH = torch.cuda.is_available() and find_spec("flash_attn") is not None


@pytest.fixture(autouse=True)
def _no_forced_path(monkeypatch):
    monkeypatch.delenv(ATTENTION_ENV_VAR, raising=False)


# ----------------------------------------------------------------------------------------------------------------
# references


def reference_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal):
    """flash_attn_varlen_func's contract in plain torch (float64): sequence s is rows cu[s]:cu[s+1] of q and of
    k/v; query head h reads KV head h // (h_q / h_kv); causal is aligned to the bottom right."""
    out = torch.empty_like(q)
    g = q.shape[1] // k.shape[1]
    for s in range(cu_seqlens_q.numel() - 1):
        qs = q[cu_seqlens_q[s] : cu_seqlens_q[s + 1]].double().transpose(0, 1)  # (h_q, Lq, d)
        ks = k[cu_seqlens_k[s] : cu_seqlens_k[s + 1]].double().transpose(0, 1).repeat_interleave(g, 0)
        vs = v[cu_seqlens_k[s] : cu_seqlens_k[s + 1]].double().transpose(0, 1).repeat_interleave(g, 0)
        assert qs.shape[1] <= max_seqlen_q and ks.shape[1] <= max_seqlen_k
        logits = qs @ ks.transpose(-1, -2) * softmax_scale
        if causal:
            lq, lk = qs.shape[1], ks.shape[1]
            visible = torch.ones(lq, lk, dtype=torch.bool).tril(diagonal=lk - lq)
            logits = logits.masked_fill(~visible, float("-inf"))
        out[cu_seqlens_q[s] : cu_seqlens_q[s + 1]] = (logits.softmax(-1) @ vs).transpose(0, 1).to(q.dtype)
    return out


def masked_dense(query, keys, values, mask, scaling, softcap=None, sinks=None):
    """repeat_kv + explicit softmax over a dense (b, h_kv, q, n) mask, in float64; returns (b, q, h_q, d). As
    Gemma 2's and gpt-oss's eager attention: ``softcap * tanh(logits / softcap)`` before the mask, and a sink logit
    per query head, (h_q,), as one more softmax column whose weight is dropped."""
    g = query.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(g, dim=1)
    v = values.double().repeat_interleave(g, dim=1)
    logits = query.double() @ k.transpose(-1, -2) * scaling
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    logits = logits.masked_fill(~mask.repeat_interleave(g, dim=1), float("-inf"))
    if sinks is None:
        return (logits.softmax(-1) @ v).transpose(1, 2)
    b, h_q, q, _ = logits.shape
    column = sinks.double().view(1, h_q, 1, 1).expand(b, h_q, q, 1)
    weights = torch.cat([logits, column], dim=-1).softmax(-1)[..., :-1]
    return (weights @ v).transpose(1, 2)


# ----------------------------------------------------------------------------------------------------------------
# a compressed layer with random per-segment budgets, the inputs of its attention, and the dense answer


def make_case(
    b, h_kv, groups, t, d, q, previous, gen, lengths=None, padded_tail=False, dtype=torch.float32, extras=None
):
    """Compress a random (b, h_kv, t, d) prompt to ``lengths`` (b, h_kv) entries per segment (random when None;
    row i > 0 has i * t // 4 leading padding positions that are never kept, as left padding), append ``previous``
    then ``q`` tokens. Returns (layer, query, tail_keys, tail_values, tail_mask, want)."""
    pads = [i * t // 4 for i in range(b)]
    if lengths is None:
        lengths = torch.stack([torch.randint(1, t - pads[i] + 1, (h_kv,), generator=gen) for i in range(b)])
    keep = torch.zeros(b, h_kv, t, dtype=torch.bool)
    for i in range(b):
        for h in range(h_kv):
            chosen = pads[i] + torch.randperm(t - pads[i], generator=gen)[: int(lengths[i, h])]
            keep[i, h, chosen] = True
    keys, values = torch.randn(2, b, h_kv, t, d, generator=gen, dtype=torch.float64).to(dtype)
    layer = CompressedLayer()
    layer.update(keys, values, 0)
    layer.compress(keep)
    appended = [torch.randn(2, b, h_kv, n, d, generator=gen, dtype=torch.float64).to(dtype) for n in (previous, q)]
    for new_keys, new_values in appended:
        tail_keys, tail_values = layer.update(new_keys, new_values, 0)
    tail = previous + q
    visible = torch.ones(q, tail, dtype=torch.bool).tril(diagonal=tail - q).expand(b, q, tail).clone()
    if padded_tail:  # some appended tokens are padding for some rows (a query always sees itself)
        hidden = torch.rand(b, 1, tail, generator=gen) < 0.3
        visible &= ~hidden
        visible[:, torch.arange(q), tail - q + torch.arange(q)] = True
    tail_mask = visible[:, None]  # (b, 1, q, tail)
    query = torch.randn(b, h_kv * groups, q, d, generator=gen, dtype=torch.float64).to(dtype)
    dense_keys = torch.cat([keys, *(k for k, _ in appended)], dim=2)
    dense_values = torch.cat([values, *(v for _, v in appended)], dim=2)
    dense_mask = torch.cat([keep[:, :, None].expand(b, h_kv, q, t), visible[:, None].expand(b, h_kv, q, tail)], -1)
    want = masked_dense(query, dense_keys, dense_values, dense_mask, 1 / math.sqrt(d), **(extras or {}))
    return layer, query, tail_keys, tail_values, tail_mask, want


def run_path(path, layer, query, tail_keys, tail_values, tail_mask, softcap=None, sinks=None):
    scaling = 1 / math.sqrt(query.shape[-1])
    if softcap is not None or sinks is not None:
        return compressed_attention(
            query, layer, tail_keys, tail_values, tail_mask, scaling, path, softcap=softcap, sinks=sinks
        )
    if path == "flash-reference":  # the flash path's packing and unpacking, with flash-attn's contract in torch
        assert is_plain_causal(tail_mask)
        return flash_varlen_attention(query, layer, tail_keys, tail_values, scaling, kernel=reference_varlen)
    if path == "padded":
        return padded_attention(query, layer, tail_keys, tail_values, tail_mask, scaling)
    if path == "uniform":
        return uniform_attention(query, layer, tail_keys, tail_values, tail_mask, scaling)
    return segment_attention(query, layer, tail_keys, tail_values, tail_mask, scaling)


PATHS = ["padded", "segments", "flash-reference"]


# ----------------------------------------------------------------------------------------------------------------
# every path equals masked dense attention


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("groups", [1, 2, 7])
@pytest.mark.parametrize("q", [1, 4])
@pytest.mark.parametrize("padded_tail", [False, True])
def test_paths_equal_masked_dense_attention(path, groups, q, padded_tail):
    if path == "flash-reference" and padded_tail:
        pytest.skip("the flash path reads the tail causally; padded tails go to the padded path (choose_path)")
    gen = torch.Generator().manual_seed(100 * groups + 10 * q + padded_tail)
    b, h_kv, t = 3, 2, 40
    lengths = torch.randint(1, 11, (b, h_kv), generator=gen)
    lengths[0, 0] = 1  # a 1-entry head
    lengths[1, 1] = t - t // 4  # a whole (padded) row's head
    layer, query, tail_keys, tail_values, tail_mask, want = make_case(
        b, h_kv, groups, t, 8, q, previous=3, gen=gen, lengths=lengths, padded_tail=padded_tail
    )
    out = run_path(path, layer, query, tail_keys, tail_values, tail_mask)
    assert out.shape == (b, q, h_kv * groups, 8) and out.dtype == torch.float32
    assert (out.double() - want).abs().max().item() <= 1e-5


@pytest.mark.parametrize("groups", [1, 2, 7])
@pytest.mark.parametrize("q", [1, 4])
@pytest.mark.parametrize("padded_tail", [False, True])
@pytest.mark.parametrize("kept", [1, 7])
def test_uniform_path_equals_masked_dense_attention(groups, q, padded_tail, kept):
    """Every segment keeps the same count (a per-layer budget): the flat context viewed as one dense tensor."""
    gen = torch.Generator().manual_seed(1000 * groups + 10 * q + padded_tail + kept)
    b, h_kv, t = 3, 2, 40
    lengths = torch.full((b, h_kv), kept)
    layer, query, tail_keys, tail_values, tail_mask, want = make_case(
        b, h_kv, groups, t, 8, q, previous=3, gen=gen, lengths=lengths, padded_tail=padded_tail
    )
    assert layer.uniform_width() == kept
    for path in ("uniform", "padded", "segments"):
        out = run_path(path, layer, query, tail_keys, tail_values, tail_mask)
        assert out.shape == (b, q, h_kv * groups, 8)
        assert (out.double() - want).abs().max().item() <= 1e-5, path
    assert choose_path(query, layer, tail_mask, tail_keys.shape[2]) == "uniform"


@pytest.mark.parametrize("uniform", [False, True])
@pytest.mark.parametrize("padded_tail", [False, True])
def test_a_chunk_attends_in_blocks_of_query_rows_whose_masks_stay_small(uniform, padded_tail, monkeypatch):
    """A tail some query may not read (a prefill chunk) goes through SDPA a block of query rows at a time: no call's
    mask holds more than ``LOGIT_BLOCK_ELEMENTS`` entries (SDPA makes a float copy of it), every query row is
    answered once, and the output is masked dense attention's."""
    limit = 600  # b x heads x G x (width + tail) = 3 x (1 or 2) x 3 x (<= 10 + 10): 1-5 query rows a block
    monkeypatch.setattr(fused_attention, "LOGIT_BLOCK_ELEMENTS", limit)
    sdpa, masks = torch.nn.functional.scaled_dot_product_attention, []

    def spy(query, keys, values, attn_mask=None, **kwargs):
        masks.append(attn_mask)
        return sdpa(query, keys, values, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(fused_attention.F, "scaled_dot_product_attention", spy)
    gen = torch.Generator().manual_seed(31 + padded_tail + 2 * uniform)
    b, h_kv, groups, q = 3, 2, 3, 7
    lengths = torch.full((b, h_kv), 10) if uniform else torch.randint(4, 11, (b, h_kv), generator=gen)
    case = make_case(b, h_kv, groups, 40, 8, q, previous=3, gen=gen, lengths=lengths, padded_tail=padded_tail)
    layer, query, tail_keys, tail_values, tail_mask, want = case
    out = run_path("uniform" if uniform else "padded", layer, query, tail_keys, tail_values, tail_mask)
    assert len(masks) > 1 and all(mask.numel() <= limit for mask in masks)
    assert sum(mask.shape[2] for mask in masks) == groups * q  # the folded rows, each once
    assert (out.double() - want).abs().max().item() <= 1e-5


@pytest.mark.parametrize("extras", ["softcap", "sinks", "both"])
@pytest.mark.parametrize("uniform", [False, True])
@pytest.mark.parametrize("padded_tail", [False, True])
@pytest.mark.parametrize("row_blocks", [False, True])
def test_soft_capped_and_sink_attention_on_every_cpu_path(extras, uniform, padded_tail, row_blocks, monkeypatch):
    """Gemma 2's soft cap and gpt-oss's sinks on the paths that write the attention out (uniform, padded) and the
    segment loop, against the families' eager attention written in float64; with ``row_blocks`` the uniform and
    padded paths take their 12 folded query rows a few at a time (360 logits: b x h_kv = 6 rows of <= 13 keys)."""
    if row_blocks:
        monkeypatch.setattr(fused_attention, "LOGIT_BLOCK_ELEMENTS", 360)
    gen = torch.Generator().manual_seed(7 + 2 * uniform + padded_tail)
    b, h_kv, groups, t, q = 3, 2, 3, 40, 4
    lengths = torch.full((b, h_kv), 9) if uniform else torch.randint(1, 11, (b, h_kv), generator=gen)
    options = {
        "softcap": 0.7 if extras != "sinks" else None,  # logits of a few units: the cap bites
        "sinks": torch.randn(h_kv * groups, generator=gen) + 2.0 if extras != "softcap" else None,
    }
    layer, query, tail_keys, tail_values, tail_mask, want = make_case(
        b,
        h_kv,
        groups,
        t,
        8,
        q,
        3,
        gen,
        lengths=lengths,
        padded_tail=padded_tail,
        dtype=torch.float32,
        extras=options,
    )
    plain = masked_dense(query, *_dense_of(layer, tail_keys, tail_values, tail_mask, t), 1 / math.sqrt(8))
    assert (plain - want).abs().max() > 1e-2  # the soft cap or the sinks change the output
    for path in ("uniform", "padded", "segments") if uniform else ("padded", "segments"):
        out = run_path(path, layer, query, tail_keys, tail_values, tail_mask, **options)
        assert (out.double() - want).abs().max().item() <= 1e-5, path
    with pytest.raises(CriticalKVError, match="soft-caps its logits or adds attention sinks"):
        run_path("flash", layer, query, tail_keys, tail_values, tail_mask, **options)


@pytest.mark.parametrize("extras", [{"softcap": 0.7}, {"sinks": torch.tensor([1.0, 2.0, 0.5, -1.0])}])
def test_a_query_that_reads_nothing_gets_zeros_with_a_soft_cap_or_sinks(extras):
    """A segment that kept nothing and a padding query that reads no tail entry: zeros, as from SDPA and the segment
    loop; a NaN there would reach every later layer through the padding position's keys and values."""
    gen = torch.Generator().manual_seed(3)
    lengths = torch.tensor([[0, 5]])  # KV head 0 kept nothing
    layer, query, tail_keys, tail_values, tail_mask, _ = make_case(1, 2, 2, 20, 8, 2, 2, gen, lengths=lengths)
    tail_mask = tail_mask.clone()
    tail_mask[0, 0, 0] = False  # the first query reads no tail entry (a padding position of the question)
    outs = {path: run_path(path, layer, query, tail_keys, tail_values, tail_mask, **extras) for path in PATHS[:2]}
    for path, out in outs.items():
        assert not bool(out.isnan().any()), path
        assert bool((out[0, 0, :2] == 0).all()), path  # query 0 of KV head 0's two query heads
    torch.testing.assert_close(outs["padded"], outs["segments"], rtol=1e-5, atol=1e-6)


def _dense_of(layer, tail_keys, tail_values, tail_mask, t):
    """The padded keys, values and (b, h_kv, q, max_len + tail) mask of a compressed layer (its kept entries)."""
    keys, values, valid = padded_segments(layer, tail_keys, tail_values)
    b, h_kv, width = valid.shape
    q = tail_mask.shape[2]
    mask = torch.cat([valid[:, :, None].expand(b, h_kv, q, width), tail_mask.expand(b, h_kv, q, -1)], dim=-1)
    return keys, values, mask


def test_uniform_width_follows_the_counts():
    """CompressedLayer.uniform_width is remembered; a shrink or an in-place change of the counts is seen at once."""
    gen = torch.Generator().manual_seed(5)
    layer, *_ = make_case(2, 2, 1, 20, 8, 1, previous=0, gen=gen, lengths=torch.full((2, 2), 6))
    assert layer.uniform_width() == 6 and layer.uniform_width() == 6
    keep = torch.ones(24, dtype=torch.bool)
    keep[:2] = False  # two entries of the first segment only
    layer.shrink(keep)
    assert layer.uniform_width() is None
    layer.lengths.fill_(5)  # in place: same tensor, new version
    assert layer.uniform_width() == 5


@settings(max_examples=60)
@given(
    b=st.integers(1, 3),
    h_kv=st.integers(1, 3),
    groups=st.sampled_from([1, 2, 7]),
    t=st.integers(4, 24),
    d=st.sampled_from([4, 8]),
    q=st.integers(1, 3),
    previous=st.integers(0, 3),
    padded_tail=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_paths_equal_masked_dense_property(b, h_kv, groups, t, d, q, previous, padded_tail, seed):
    gen = torch.Generator().manual_seed(seed)
    case = make_case(b, h_kv, groups, t, d, q, previous, gen, padded_tail=padded_tail)
    layer, query, tail_keys, tail_values, tail_mask, want = case
    for path in PATHS:
        if path == "flash-reference" and not is_plain_causal(tail_mask):
            continue
        out = run_path(path, layer, query, tail_keys, tail_values, tail_mask)
        assert (out.double() - want).abs().max().item() <= 1e-5, path
    if layer.uniform_width() is not None:
        out = run_path("uniform", layer, query, tail_keys, tail_values, tail_mask)
        assert (out.double() - want).abs().max().item() <= 1e-5, "uniform"


@pytest.mark.parametrize("path", PATHS)
def test_a_segment_with_no_kept_entry_reads_only_the_tail(path):
    """Segments may be emptied (a layer shrunk by a cross-layer allocator): they attend over their tail alone."""
    gen = torch.Generator().manual_seed(21)
    lengths = torch.tensor([[0, 5, 1], [7, 0, 2]])
    case = make_case(2, 3, 2, 12, 8, 2, previous=2, gen=gen, lengths=lengths)
    layer, query, tail_keys, tail_values, tail_mask, want = case
    assert layer.lengths.tolist() == lengths.tolist()
    out = run_path(path, layer, query, tail_keys, tail_values, tail_mask)
    assert (out.double() - want).abs().max().item() <= 1e-5


def test_varlen_inputs_are_each_segment_context_then_tail():
    gen = torch.Generator().manual_seed(5)
    layer, _, tail_keys, tail_values, _, _ = make_case(2, 3, 1, 12, 4, 2, previous=1, gen=gen)
    keys, values, cu_seqlens, longest = varlen_inputs(layer, tail_keys, tail_values)
    counts = layer.lengths.flatten()
    offsets = layer.offsets()
    assert cu_seqlens.dtype == torch.int32 and keys.shape == (int(counts.sum()) + 6 * 3, 1, 4)
    assert cu_seqlens.tolist() == (offsets + 3 * torch.arange(7)).tolist()
    assert longest == int(counts.max()) + 3
    for s in range(6):
        want_keys = torch.cat([layer.context_keys[offsets[s] : offsets[s + 1]], tail_keys.reshape(6, 3, 4)[s]])
        want_values = torch.cat([layer.context_values[offsets[s] : offsets[s + 1]], tail_values.reshape(6, 3, 4)[s]])
        assert torch.equal(keys[cu_seqlens[s] : cu_seqlens[s + 1], 0], want_keys)
        assert torch.equal(values[cu_seqlens[s] : cu_seqlens[s + 1], 0], want_values)


# ----------------------------------------------------------------------------------------------------------------
# the choice of a path


def _layer_with_lengths(lengths: torch.Tensor, tail: int, d: int = 4) -> CompressedLayer:
    b, h_kv = lengths.shape
    t = int(lengths.max())
    keep = torch.arange(t) < lengths[..., None]
    layer = CompressedLayer()
    layer.update(torch.randn(b, h_kv, t, d), torch.randn(b, h_kv, t, d), 0)
    layer.compress(keep)
    if tail:
        layer.update(torch.randn(b, h_kv, tail, d), torch.randn(b, h_kv, tail, d), 0)
    return layer


def test_segments_path_with_empty_segments_row_blocks_and_float64(monkeypatch):
    """Zero-length segments, many blocks of query rows, a padded tail, float64 kept as float64: masked dense."""
    monkeypatch.setattr(fused_attention, "LOGIT_BLOCK_ELEMENTS", 5)  # a block of one query row
    gen = torch.Generator().manual_seed(21)
    lengths = torch.tensor([[0, 5, 3], [2, 0, 7]])
    case = make_case(2, 3, 2, 12, 4, 3, previous=2, gen=gen, lengths=lengths, padded_tail=True, dtype=torch.float64)
    layer, query, tail_keys, tail_values, tail_mask, want = case
    got = run_path("segments", layer, query, tail_keys, tail_values, tail_mask)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_auto_is_uniform_when_every_segment_keeps_the_same_count():
    query = torch.randn(2, 4, 1, 64)
    mask = torch.ones(2, 1, 1, 1, dtype=torch.bool)
    same = _layer_with_lengths(torch.full((2, 4), 6000), tail=1, d=64)  # beyond the CPU padded limit: no padding
    assert same.uniform_width() == 6000 and not padding_fits(same, 1)
    assert choose_path(query, same, mask, 1) == "uniform"
    uneven = _layer_with_lengths(torch.tensor([[3, 3, 3, 3], [3, 3, 2, 3]]), tail=1)
    assert uneven.uniform_width() is None
    with pytest.raises(CriticalKVError, match="uniform attention path"):
        choose_path(torch.randn(2, 4, 1, 4), uneven, mask, 1, path="uniform")
    with pytest.raises(CriticalKVError, match="uniform attention path"):
        uniform_attention(torch.randn(2, 4, 1, 4), uneven, torch.randn(2, 4, 1, 4), torch.randn(2, 4, 1, 4), mask, 1.0)


def test_auto_on_cpu_is_padded_within_the_padding_factor_and_size_else_segments():
    query = torch.randn(1, 4, 1, 4)
    mask = torch.ones(1, 1, 1, 1, dtype=torch.bool)
    even = _layer_with_lengths(torch.tensor([[30, 20, 25, 10]]), tail=1)
    assert padding_fits(even, 1) and choose_path(query, even, mask, 1) == "padded"
    # one head keeps 100 entries, seven keep 1: 8 * (100 + 1) padded against 107 + 8 stored > PADDING_FACTOR
    uneven = _layer_with_lengths(torch.tensor([[100, 1, 1, 1], [1, 1, 1, 1]]), tail=1)
    assert PADDING_FACTOR * (107 + 8) < 8 * 101
    assert not padding_fits(uneven, 1)
    assert choose_path(torch.randn(2, 4, 1, 4), uneven, mask.expand(2, 1, 1, 1), 1) == "segments"
    # a long tail shared by every segment makes the same budgets cheap to pad
    long_tail = _layer_with_lengths(torch.tensor([[100, 1, 1, 1], [1, 1, 1, 1]]), tail=200)
    assert padding_fits(long_tail, 200)
    # evenly padded but large: on CPU the per-segment loop is faster (module docstring)
    large = _layer_with_lengths(torch.tensor([[5000, 4990, 5000, 4999]]), tail=1, d=64)
    assert CPU_PADDED_MAX_BYTES < 4 * 5001 * 64 * 4
    assert choose_path(torch.randn(1, 4, 1, 64), large, mask, 1) == "segments"
    # small enough to pad, evenly, but long segments: read in place (CPU_SEGMENT_ENTRIES)
    long = _layer_with_lengths(torch.tensor([[300, 290, 300, 299]]), tail=1, d=64)
    assert CPU_PADDED_MAX_BYTES > 4 * 301 * 64 * 4 and 4 * CPU_SEGMENT_ENTRIES <= (1189 + 4)
    assert choose_path(torch.randn(1, 4, 1, 64), long, mask, 1) == "segments"
    shorter = _layer_with_lengths(torch.tensor([[250, 240, 250, 249]]), tail=1, d=64)
    assert choose_path(torch.randn(1, 4, 1, 64), shorter, mask, 1) == "padded"


def test_environment_variable_forces_a_path(monkeypatch):
    query = torch.randn(2, 4, 1, 4)
    mask = torch.ones(2, 1, 1, 1, dtype=torch.bool)
    uneven = _layer_with_lengths(torch.tensor([[100, 1, 1, 1], [1, 1, 1, 1]]), tail=1)
    even = _layer_with_lengths(torch.tensor([[3, 3, 3, 3], [3, 3, 2, 3]]), tail=1)
    monkeypatch.setenv(ATTENTION_ENV_VAR, "segments")
    assert choose_path(query, even, mask, 1) == "segments"
    monkeypatch.setenv(ATTENTION_ENV_VAR, "padded")
    assert choose_path(query, uneven, mask, 1) == "padded"  # forced: the padding factor is not consulted
    monkeypatch.setenv(ATTENTION_ENV_VAR, " Auto ")
    assert choose_path(query, uneven, mask, 1) == "segments"
    assert choose_path(query, even, mask, 1, path="segments") == "segments"  # an explicit path beats the variable
    monkeypatch.setenv(ATTENTION_ENV_VAR, "fast")
    with pytest.raises(CriticalKVError, match=ATTENTION_ENV_VAR):
        choose_path(query, even, mask, 1)
    with pytest.raises(CriticalKVError, match="choose one of"):
        choose_path(query, even, mask, 1, path="fused")


@pytest.mark.parametrize(
    ("forced", "called"),
    [("segments", "segment_attention"), ("padded", "padded_attention"), ("uniform", "uniform_attention")],
)
def test_compressed_attention_runs_the_forced_path(monkeypatch, forced, called):
    gen = torch.Generator().manual_seed(9)
    lengths = torch.full((2, 2), 4)
    case = make_case(2, 2, 2, 10, 4, 1, previous=0, gen=gen, lengths=lengths)
    layer, query, tail_keys, tail_values, tail_mask, want = case
    calls = []
    for name in ("segment_attention", "padded_attention", "uniform_attention"):
        real = getattr(attention_module, name)
        monkeypatch.setattr(attention_module, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    monkeypatch.setenv(ATTENTION_ENV_VAR, forced)
    out = compressed_attention(query, layer, tail_keys, tail_values, tail_mask, 1 / math.sqrt(4))
    assert calls == [called]
    assert (out.double() - want).abs().max().item() <= 1e-5


def test_flash_refused_with_reasons_where_it_cannot_run(monkeypatch):
    mask = torch.ones(1, 1, 1, 1, dtype=torch.bool)
    layer = _layer_with_lengths(torch.tensor([[2, 3]]), tail=1, d=12)
    reasons = flash_reasons(torch.randn(1, 2, 1, 12), mask)
    assert len(reasons) == 3 and "CUDA" in reasons[0] and "dtype" in reasons[1] and "head size 12" in reasons[2]
    monkeypatch.setenv(ATTENTION_ENV_VAR, "flash")
    with pytest.raises(CriticalKVError, match=r"flash attention path cannot run.*CUDA"):
        choose_path(torch.randn(1, 2, 1, 12), layer, mask, 1)


def test_plain_causal_tail_masks():
    assert is_plain_causal(torch.ones(2, 1, 1, 5, dtype=torch.bool))  # decoding one token reads the whole tail
    causal = torch.ones(3, 7, dtype=torch.bool).tril(diagonal=4)[None, None].expand(2, 1, 3, 7)
    assert is_plain_causal(causal)
    padded = causal.clone()
    padded[1, 0, :, 0] = False  # the first appended token of row 1 is padding
    assert not is_plain_causal(padded)
    assert not is_plain_causal(torch.ones(1, 1, 3, 7, dtype=torch.bool))  # not causal at all


# ----------------------------------------------------------------------------------------------------------------
# the real flash-attn kernel (CUDA + flash_attn only)


@pytest.mark.skipif(not HAS_FLASH, reason="needs CUDA and the flash_attn package")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("groups", [1, 2, 7])
@pytest.mark.parametrize("q", [1, 4])
def test_flash_path_on_cuda_equals_masked_dense(dtype, groups, q):
    gen = torch.Generator().manual_seed(groups + q)
    b, h_kv, t, d = 3, 2, 200, 64
    lengths = torch.randint(1, 120, (b, h_kv), generator=gen)
    lengths[0, 0] = 1
    case = make_case(b, h_kv, groups, t, d, q, previous=5, gen=gen, lengths=lengths, dtype=dtype)
    layer, query, tail_keys, tail_values, tail_mask, want = case
    layer.context_keys, layer.context_values = layer.context_keys.cuda(), layer.context_values.cuda()
    layer.lengths = layer.lengths.cuda()
    query, tail_keys, tail_values, tail_mask = (x.cuda() for x in (query, tail_keys, tail_values, tail_mask))
    assert choose_path(query, layer, tail_mask, tail_keys.shape[2]) == "flash"
    out = compressed_attention(query, layer, tail_keys, tail_values, tail_mask, 1 / math.sqrt(d))
    tolerance = 3e-2 if dtype == torch.bfloat16 else 5e-3  # a wrong path is off by O(1)
    assert (out.double().cpu() - want).abs().max().item() <= tolerance
    padded_tail = tail_mask.clone()
    padded_tail[1, 0, :, 0] = False
    assert choose_path(query, layer, padded_tail, tail_keys.shape[2]) == "padded"


# ----------------------------------------------------------------------------------------------------------------
# end to end: greedy generation is the same whichever path runs


def test_generation_is_the_same_on_every_cpu_path(monkeypatch):
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    ids = torch.randint(3, 96, (2, 60), generator=torch.Generator().manual_seed(1))
    results = {}
    runs = [("critical-adakv", "segments"), ("critical-adakv", "padded")]
    runs += [("critical-snapkv", "segments"), ("critical-snapkv", "padded"), ("critical-snapkv", "uniform")]
    for method, path in runs:
        monkeypatch.setenv(ATTENTION_ENV_VAR, path)
        with criticalkv.compress(model, method, budget=0.3, window=8):
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=6,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
        results[method, path] = out.sequences, torch.stack(out.logits, dim=1)
    for method, path in runs:
        reference = results[method, "segments"]
        assert torch.equal(results[method, path][0], reference[0]), (method, path)
        assert (results[method, path][1] - reference[1]).abs().max().item() <= 1e-4, (method, path)
