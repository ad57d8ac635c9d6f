"""The compressed cache layer (a flat kept context plus a dense tail) and the attention over its
per-(batch, KV head) segments, checked against a naive dense reference."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from criticalkv.cache import CompressedCache, CompressedLayer
from criticalkv.cache.attention import as_bool_mask, segment_attention
from criticalkv.errors import CacheStateError

# ----------------------------------------------------------------------------------------------------------------
# access to a CompressedLayer's segments


def _context(layer: CompressedLayer, bi: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Kept context keys and values of segment (bi, hi): (n, d) each."""
    n = int(layer.lengths[bi, hi])
    s = bi * layer.lengths.shape[1] + hi
    start = int(layer.lengths.flatten()[:s].sum())
    return layer.context_keys[start : start + n], layer.context_values[start : start + n]


def _tail(layer: CompressedLayer, bi: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Entries appended after compression to segment (bi, hi): (tail, d) each."""
    keys, values = layer.tail_states()
    return keys[bi, hi], values[bi, hi]


def _storage_bytes(layer: CompressedLayer) -> int:
    """Bytes of key/value tensors the layer holds (allocated capacity), without bookkeeping."""
    total = layer.keys.nbytes + layer.values.nbytes
    if layer.is_compressed:
        total += layer.context_keys.nbytes + layer.context_values.nbytes
    return total


def _attend(layer, query, keys_out, values_out, logical_mask, scaling):
    """Attention of ``query`` over a compressed layer, given what ``layer.update`` returned."""
    tail_mask = layer.tail_mask(logical_mask, query.shape[2])
    return segment_attention(query, layer, keys_out, values_out, tail_mask, scaling)


# ----------------------------------------------------------------------------------------------------------------
# attention


def _naive_attention(query, keys, values, mask, scaling):
    """repeat_kv + explicit softmax with masked entries; returns (b, q, h_q, d)."""
    g = query.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(g, dim=1).double()
    v = values.repeat_interleave(g, dim=1).double()
    m = mask.repeat_interleave(g, dim=1)
    logits = (query.double() @ k.transpose(-1, -2)) * scaling
    probs = torch.softmax(logits.masked_fill(~m, float("-inf")), dim=-1)
    return (probs @ v).transpose(1, 2)


def _random_mask(b, h_kv, q, n, gen, density=0.5):
    mask = torch.rand(b, h_kv, q, n, generator=gen) < density
    # every row reads at least one entry; some heads read exactly one entry
    first = torch.randint(0, n, (b, h_kv, q), generator=gen)
    mask.scatter_(-1, first[..., None], True)
    mask[0, 0] = False
    mask[0, 0, :, n - 1] = True  # a 1-entry head
    if b > 1:
        mask[-1, -1] = False
        mask[-1, -1, :, 0] = True
    return mask


def test_as_bool_mask():
    boolean = torch.tensor([[True, False]])
    assert as_bool_mask(boolean) is boolean
    additive = torch.tensor([[0.0, torch.finfo(torch.float32).min]])
    assert as_bool_mask(additive).tolist() == [[True, False]]
    half = torch.tensor([[0.0, torch.finfo(torch.float16).min]], dtype=torch.float16)
    assert as_bool_mask(half).tolist() == [[True, False]]


# ----------------------------------------------------------------------------------------------------------------
# CompressedLayer


def _prompt(b=2, h=3, t=12, d=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(b, h, t, d, generator=gen), torch.randn(b, h, t, d, generator=gen)


def _keep_mask(b, h, t, seed=1):
    gen = torch.Generator().manual_seed(seed)
    keep = torch.rand(b, h, t, generator=gen) < 0.4
    keep[..., -1] = True
    keep[0, 0] = False
    keep[0, 0, 3] = True  # a 1-entry segment
    keep[-1, -1] = True  # a whole segment
    return keep


def _compressed(b, h, t, d, keep, seed=0):
    k, v = _prompt(b, h, t, d, seed)
    layer = CompressedLayer()
    layer.update(k, v, 0)
    layer.compress(keep)
    return layer, k, v


@settings(max_examples=40, deadline=None)
@given(
    b=st.integers(1, 3), h=st.integers(1, 3), t=st.integers(1, 40), share=st.floats(0.0, 1.0), seed=st.integers(0, 99)
)
def test_compress_with_a_known_width_stores_what_counting_stores(b, h, t, share, seed):
    """Every segment keeping ``width`` entries: gathering them without a host read stores the same entries, in the
    same order, as the positions counted from the mask."""
    width = max(1, round(share * t))
    gen = torch.Generator().manual_seed(seed)
    ranks = torch.rand(b, h, t, generator=gen).argsort(-1).argsort(-1)  # a random order of the positions
    keep = ranks < width  # (b, h, t): exactly `width` per segment
    counted, k, v = _compressed(b, h, t, 5, keep, seed)
    known = CompressedLayer()
    known.update(k, v, 0)
    known.compress(keep, width)
    assert torch.equal(known.context_keys, counted.context_keys)
    assert torch.equal(known.context_values, counted.context_values)
    assert torch.equal(known.lengths, counted.lengths) and known.keys.shape == (b, h, 0, 5)


@pytest.mark.parametrize("groups", [1, 2, 7])
@pytest.mark.parametrize("q", [1, 4])
@pytest.mark.parametrize("logical", ["none", "causal", "padded"])
def test_attention_over_compressed_layer_matches_naive(groups, q, logical):
    """Attention over the kept segments + appended tail == naive dense attention with evicted entries masked."""
    b, h_kv, t, d = 3, 2, 14, 8
    keep = _keep_mask(b, h_kv, t, seed=groups + q)
    layer, k, v = _compressed(b, h_kv, t, d, keep, seed=groups)
    gen = torch.Generator().manual_seed(10 * groups + q)
    nk, nv = torch.randn(b, h_kv, q, d, generator=gen), torch.randn(b, h_kv, q, d, generator=gen)
    keys_out, values_out = layer.update(nk, nv, 0)
    query = torch.randn(b, h_kv * groups, q, d, generator=gen)
    causal = torch.ones(q, q, dtype=torch.bool).tril()  # among the q new tokens
    tail_visible = causal[None].expand(b, q, q).clone()
    logical_mask = None
    if logical != "none":
        # transformers' 4D mask over the logical sequence (t + q): context columns (ignored for compressed
        # layers: padding is never kept) and the new tokens, here with row 1's first new token as padding
        logical_mask = torch.ones(b, 1, q, t + q, dtype=torch.bool)
        logical_mask[:, 0, :, t:] = causal
        if logical == "padded" and q > 1:
            logical_mask[1, 0, :, t] = False
            tail_visible[1, :, 0] = False
            logical_mask[1, 0, 0, t] = True  # a query always sees itself (transformers keeps rows non-empty)
            tail_visible[1, 0, 0] = True
    scaling = 1 / math.sqrt(d)
    out = _attend(layer, query, keys_out, values_out, logical_mask, scaling)
    assert out.shape == (b, q, h_kv * groups, d)
    dense_k, dense_v = torch.cat([k, nk], 2), torch.cat([v, nv], 2)
    dense_mask = torch.cat([keep[:, :, None, :].expand(b, h_kv, q, t), tail_visible[:, None].expand(b, h_kv, q, q)], -1)
    want = _naive_attention(query, dense_k, dense_v, dense_mask, scaling)
    assert (out.double() - want).abs().max().item() <= 1e-5


def test_dense_prefill_is_stored_whole():
    layer = CompressedLayer()
    k, v = _prompt()
    out_k, out_v = layer.update(k, v, 0)
    assert torch.equal(out_k, k) and torch.equal(out_v, v)
    assert layer.fresh and not layer.is_compressed
    assert layer.get_seq_length() == 12 and layer.entries() == 2 * 3 * 12
    assert layer.nbytes() == k.nbytes + v.nbytes
    assert layer.get_mask_sizes(1) == (13, 0)


def test_dense_prefill_is_stored_contiguous_like_dynamic_cache():
    # the model's projections arrive as (b, t, h_kv, d) seen through a transpose; attention reads the stored
    # prompt, and SDPA's CPU kernel is slower over that layout than over a contiguous one
    b, h, t, d = 2, 3, 12, 4
    k = torch.randn(b, t, h, d).transpose(1, 2)
    v = torch.randn(b, t, h, d).transpose(1, 2)
    assert not k.is_contiguous()
    out_k, out_v = CompressedLayer().update(k, v, 0)
    assert out_k.is_contiguous() and out_v.is_contiguous()
    assert torch.equal(out_k, k) and torch.equal(out_v, v)


def test_compress_update_crop_cycle():
    b, h, t, d = 2, 3, 12, 4
    keep = _keep_mask(b, h, t)
    layer, k, v = _compressed(b, h, t, d, keep)
    counts = keep.sum(-1)
    assert layer.is_compressed and not layer.fresh
    assert torch.equal(layer.lengths, counts)
    assert layer.entries() == int(counts.sum())
    assert layer.get_seq_length() == t  # logical positions keep counting the whole prompt
    assert _storage_bytes(layer) >= int(counts.sum()) * 2 * d * 4
    assert _storage_bytes(layer) <= layer.nbytes() <= _storage_bytes(layer) + layer.lengths.nbytes
    for bi in range(b):
        for hi in range(h):
            ck, cv = _context(layer, bi, hi)
            assert torch.equal(ck, k[bi, hi, keep[bi, hi]])  # kept entries, original order
            assert torch.equal(cv, v[bi, hi, keep[bi, hi]])

    # decode: one token at a time, then a 3-token chunk
    gen = torch.Generator().manual_seed(3)
    new = [(torch.randn(b, h, q, d, generator=gen), torch.randn(b, h, q, d, generator=gen)) for q in (1, 1, 3)]
    for nk, nv in new:
        layer.update(nk, nv, 0)
    appended_k = torch.cat([nk for nk, _ in new], dim=2)
    appended_v = torch.cat([nv for _, nv in new], dim=2)
    assert layer.tail == 5 and layer.get_seq_length() == t + 5
    assert layer.entries() == int(counts.sum()) + 5 * b * h
    assert _storage_bytes(layer) <= layer.nbytes() <= _storage_bytes(layer) + layer.lengths.nbytes
    for bi in range(b):
        for hi in range(h):
            tk, tv = _tail(layer, bi, hi)
            assert torch.equal(tk, appended_k[bi, hi]) and torch.equal(tv, appended_v[bi, hi])
            assert torch.equal(_context(layer, bi, hi)[0], k[bi, hi, keep[bi, hi]])  # context untouched

    # crop back to the context, then decode again: the new token follows the kept entries
    layer.crop(-5)
    assert layer.tail == 0 and layer.get_seq_length() == t
    assert layer.entries() == int(counts.sum())
    nk, nv = torch.randn(b, h, 1, d, generator=gen), torch.randn(b, h, 1, d, generator=gen)
    layer.update(nk, nv, 0)
    assert layer.get_seq_length() == t + 1 and layer.entries() == int(counts.sum()) + b * h
    for bi in range(b):
        for hi in range(h):
            tk, _ = _tail(layer, bi, hi)
            assert torch.equal(tk, nk[bi, hi])
            assert torch.equal(_context(layer, bi, hi)[0], k[bi, hi, keep[bi, hi]])


def test_uniform_compression_stores_exactly_the_kept_entries():
    b, h, t, d = 2, 2, 20, 8
    keep = torch.zeros(b, h, t, dtype=torch.bool)
    keep[..., ::4] = True  # 5 entries per segment
    layer, _, _ = _compressed(b, h, t, d, keep)
    assert layer.entries() == b * h * 5
    assert _storage_bytes(layer) == b * h * 5 * 2 * d * 4


def test_crop_errors():
    layer, _, _ = _compressed(1, 2, 10, 4, torch.ones(1, 2, 10, dtype=torch.bool))
    layer.update(*_prompt(1, 2, 3, 4, seed=2), 0)
    with pytest.raises(CacheStateError):
        layer.crop(-4)  # beyond the tail, into the compressed context
    with pytest.raises(CacheStateError):
        layer.crop(2)  # positive counts are not transformers' convention
    assert layer.tail == 3 and layer.get_seq_length() == 13  # a failed crop changes nothing
    layer.crop(-3)
    with pytest.raises(CacheStateError):
        layer.crop(-1)
    layer.crop(0)
    assert layer.get_seq_length() == 10


def test_compress_errors():
    layer = CompressedLayer()
    layer.update(*_prompt(1, 2, 10, 4), 0)
    with pytest.raises(CacheStateError):
        layer.compress(torch.ones(1, 2, 9, dtype=torch.bool))  # wrong length
    with pytest.raises(CacheStateError):
        layer.compress(torch.ones(2, 2, 10, dtype=torch.bool))  # wrong batch
    with pytest.raises(CacheStateError, match="bool"):
        layer.compress(torch.ones(1, 2, 10, dtype=torch.long))  # 0/1 integers: a mask is bool
    layer.compress(torch.ones(1, 2, 10, dtype=torch.bool))
    with pytest.raises(CacheStateError):
        layer.compress(torch.ones(1, 2, 10, dtype=torch.bool))  # only once


@pytest.mark.parametrize("uneven", [False, True])
def test_appends_grow_geometrically(uneven):
    """1000 single-token appends reallocate O(log n) times, and every appended entry lands where it should."""
    b, h, t, d = 2, 2, 30, 4
    keep = torch.ones(b, h, t, dtype=torch.bool)
    if uneven:
        keep[0, 0, 5:] = False
        keep[1, 0, 17:] = False
        keep[1, 1, 1:] = False
    layer, k, _ = _compressed(b, h, t, d, keep)
    capacities = [layer.keys.shape[2]]
    for i in range(1000):
        token = torch.full((b, h, 1, d), float(i))
        layer.update(token, token, 0)
        if layer.keys.shape[2] != capacities[-1]:
            capacities.append(layer.keys.shape[2])
    assert layer.tail == 1000 and layer.get_seq_length() == t + 1000
    reallocations = len(capacities) - 1
    assert 1 <= reallocations < 60, capacities
    assert all(later >= 1.1 * earlier for earlier, later in itertools.pairwise(capacities[1:]))
    counts = keep.sum(-1)
    assert layer.entries() == int(counts.sum()) + 1000 * b * h
    for bi in range(b):
        for hi in range(h):
            tk, _ = _tail(layer, bi, hi)
            assert torch.equal(tk[:, 0], torch.arange(1000, dtype=torch.float32))
            assert torch.equal(_context(layer, bi, hi)[0], k[bi, hi, keep[bi, hi]])


def _uniform_keep(b, h, t, width, seed):
    """A keep mask that keeps ``width`` random positions of every segment."""
    gen = torch.Generator().manual_seed(seed)
    order = torch.rand(b, h, t, generator=gen).argsort(-1)
    return torch.zeros(b, h, t, dtype=torch.bool).scatter_(-1, order[..., :width], True)


@pytest.mark.parametrize("groups", [1, 3])
def test_joined_layer_decodes_like_masked_dense_attention(groups):
    """The uniform path joins the layer at its first call; 150 decode steps later (two growths of the joined
    buffers) every step's output still equals naive attention over the kept and appended entries."""
    from criticalkv.cache.fused_attention import uniform_attention

    b, h_kv, t, d, width = 2, 2, 40, 8, 10
    keep = _uniform_keep(b, h_kv, t, width, seed=groups)
    layer, k, v = _compressed(b, h_kv, t, d, keep, seed=groups)
    question = torch.randn(b, h_kv, 3, d, generator=torch.Generator().manual_seed(7))
    keys_out, values_out = layer.update(question, question * 2, 0)  # a question appended before the first read
    gen = torch.Generator().manual_seed(groups + 100)
    all_keys, all_values = [k, question], [v, question * 2]
    flat_bytes = layer.nbytes()
    capacities = set()
    for step in range(150):
        if step:
            new_k, new_v = torch.randn(2, b, h_kv, 1, d, generator=gen)
            keys_out, values_out = layer.update(new_k, new_v, 0)
            all_keys.append(new_k)
            all_values.append(new_v)
        query = torch.randn(b, h_kv * groups, 1, d, generator=gen)
        got = uniform_attention(query, layer, keys_out, values_out, layer.tail_mask(None, 1), 0.3)
        dense_keys, dense_values = torch.cat(all_keys, dim=2), torch.cat(all_values, dim=2)
        visible = torch.cat([keep, torch.ones(b, h_kv, dense_keys.shape[2] - t, dtype=torch.bool)], dim=-1)
        want = _naive_attention(query, dense_keys, dense_values, visible[:, :, None], 0.3)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
        capacities.add(layer.nbytes())
        if step == 0:  # joined: the flat context is released, not held twice
            assert layer.nbytes() <= flat_bytes + 2 * b * h_kv * 64 * d * k.element_size()
    assert len(capacities) >= 3  # the joined buffers grew while decoding
    # reading the flat context splits the layer back, with every entry where it was
    assert layer.tail == 3 + 149 and layer.entries() == b * h_kv * (width + layer.tail)
    for bi in range(b):
        for hi in range(h_kv):
            assert torch.equal(_context(layer, bi, hi)[0], k[bi, hi, keep[bi, hi]])
            assert torch.equal(_tail(layer, bi, hi)[1], torch.cat(all_values[1:], dim=2)[bi, hi])


def test_joined_layer_splits_for_another_path_and_reorders():
    """After joining, the padded path (which reads the flat context) and a batch reorder see the same entries."""
    from criticalkv.cache.fused_attention import padded_attention, uniform_attention

    b, h_kv, t, d = 3, 2, 20, 4
    layer, _, _ = _compressed(b, h_kv, t, d, _uniform_keep(b, h_kv, t, 6, seed=3))
    step = torch.randn(b, h_kv, 1, d, generator=torch.Generator().manual_seed(4))
    keys_out, values_out = layer.update(step, step, 0)
    query = torch.randn(b, h_kv, 1, d, generator=torch.Generator().manual_seed(5))
    mask = layer.tail_mask(None, 1)
    joined = uniform_attention(query, layer, keys_out, values_out, mask, 0.5)
    split = padded_attention(query, layer, *layer.tail_states(), mask, 0.5)
    torch.testing.assert_close(joined, split)
    uniform_attention(query, layer, *layer.tail_states(), mask, 0.5)  # joined again
    layer.batch_select_indices(torch.tensor([2, 0]))
    torch.testing.assert_close(
        uniform_attention(query[[2, 0]], layer, *layer.tail_states(), layer.tail_mask(None, 1), 0.5), joined[[2, 0]]
    )


def test_a_single_segment_split_back_keeps_no_joined_buffer():
    """Batch 1 with one KV head: the joined buffer's front is contiguous, so the flat context read back was a view of
    the whole buffer, its tail room included, and the layer held more than ``nbytes`` said."""
    layer, _, _ = _compressed(1, 1, 20, 4, _uniform_keep(1, 1, 20, 6, seed=3))
    step = torch.randn(1, 1, 1, 4)
    layer.update(step, step, 0)
    layer.joined_states()
    context = layer.context_keys  # split back to the flat layout
    assert context.untyped_storage().nbytes() == context.nbytes == 6 * 4 * context.element_size()
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in (
        layer.context_keys, layer.context_values, layer.keys, layer.values)}  # fmt: skip
    assert sum(held.values()) == layer.nbytes() - layer.lengths.nbytes


def test_uniform_path_with_a_tail_not_the_layers_own():
    """A caller's own tail (not what ``update`` returned) is attended for that call only: the same output as the
    padded path, and the layer's stored tail is unchanged."""
    from criticalkv.cache.fused_attention import padded_attention, uniform_attention

    b, h_kv, t, d = 2, 2, 16, 4
    layer, _, _ = _compressed(b, h_kv, t, d, _uniform_keep(b, h_kv, t, 5, seed=8))
    gen = torch.Generator().manual_seed(9)
    stored = torch.randn(b, h_kv, 2, d, generator=gen)
    layer.update(stored, stored, 0)
    other = torch.randn(b, h_kv, 3, d, generator=gen)
    query = torch.randn(b, h_kv, 1, d, generator=gen)
    mask = torch.ones(b, 1, 1, 3, dtype=torch.bool)
    got = uniform_attention(query, layer, other, other, mask, 0.5)
    torch.testing.assert_close(got, padded_attention(query, layer, other, other, mask, 0.5))
    assert layer.tail == 2 and torch.equal(layer.tail_states()[0], stored)


def test_batch_select_and_repeat_keep_segments_consistent():
    b, h, t, d = 3, 2, 9, 4
    keep = _keep_mask(b, h, t, seed=12)
    layer, k, _ = _compressed(b, h, t, d, keep, seed=11)
    nk = torch.randn(b, h, 2, d)
    layer.update(nk, nk, 0)
    lengths = layer.lengths.clone()
    layer.batch_select_indices(torch.tensor([2, 0]))
    assert torch.equal(layer.lengths, lengths[[2, 0]])
    for new_row, old_row in enumerate([2, 0]):
        for hi in range(h):
            assert torch.equal(_context(layer, new_row, hi)[0], k[old_row, hi, keep[old_row, hi]])
            assert torch.equal(_tail(layer, new_row, hi)[0], nk[old_row, hi])
    layer.batch_repeat_interleave(2)
    assert torch.equal(layer.lengths, lengths[[2, 2, 0, 0]])
    assert layer.entries() == int(lengths[[2, 2, 0, 0]].sum()) + 4 * h * 2
    for new_row, old_row in enumerate([2, 2, 0, 0]):
        for hi in range(h):
            assert torch.equal(_context(layer, new_row, hi)[0], k[old_row, hi, keep[old_row, hi]])
    layer.reset()
    assert not layer.is_initialized and layer.entries() == 0 and layer.nbytes() == 0 and layer.get_seq_length() == 0


def test_compressed_cache_layer_kinds_and_accounting():
    from transformers import Gemma3TextConfig, LlamaConfig

    llama = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3)
    cache = CompressedCache(llama)
    assert all(isinstance(layer, CompressedLayer) for layer in cache.layers) and len(cache.layers) == 3
    gemma = Gemma3TextConfig(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_hidden_layers=6, sliding_window=4
    )
    cache = CompressedCache(gemma)
    kinds = [isinstance(layer, CompressedLayer) for layer in cache.layers]
    assert kinds == [t == "full_attention" for t in gemma.layer_types]
    assert any(kinds) and not all(kinds)
    assert cache.entries() == 0 and cache.nbytes() == 0
