"""Chunked prefill with compression between chunks (runtime/chunked.py, runtime/rolling.py) on tiny random models:
one chunk is the one-shot compression, an unreachable cap is the uncompressed chunked prefill bit for bit, and
after several chunks every forward equals full attention with the evicted entries masked out."""

from __future__ import annotations

import json

import pytest
import torch
from bounded_reference import Tracker
from hypothesis import given, settings
from hypothesis import strategies as st
from test_allocators import _profile
from test_every_preset import _random_surrogate
from test_runtime import _ids, _left_padded, _model
from transformers import DynamicCache
from typer.testing import CliRunner

import criticalkv
from criticalkv.allocators import HeadKVAllocator
from criticalkv.cache import CompressedLayer
from criticalkv.cache.rolling import held_entries
from criticalkv.cli import app
from criticalkv.core.view import LayerView
from criticalkv.errors import BoundedMemoryError, CriticalKVError
from criticalkv.methods import build_method
from criticalkv.runtime.chunked import prefill_in_chunks
from criticalkv.runtime.method import Method
from criticalkv.runtime.session import ContextSession
from criticalkv.scorers.base import window_attention

WINDOWED = (
    "snapkv",
    "critical-snapkv",
    "critical-adakv",
    "pyramidkv",
    "layer-defensive",
    "defensive",
    "measured-adakv",
)


def _layers(session: ContextSession) -> list[CompressedLayer]:
    return [layer for layer in session.cache.layers if isinstance(layer, CompressedLayer)]


def _method(name: str, model) -> str | Method:
    """A preset, with what a tiny random model lacks: HeadKV's profile, the surrogate's maps."""
    if name == "headkv":
        built = build_method("critical-snapkv", window=8)
        return Method(built.scorer, HeadKVAllocator(profile=_profile(model.config)), built.selector, name="headkv")
    return name


def _options(name: str, model) -> dict:
    if "surrogate" in name:
        return {"weights": _random_surrogate(model)}
    return {"window": 8} if name in WINDOWED else {}


def test_one_chunk_is_the_one_shot_compression():
    model = _model("llama")
    ids = _ids(40, seed=3)
    one_shot = ContextSession(model, "critical-adakv", budget=12, window=8)
    chunked = ContextSession(model, "critical-adakv", chunk_size=64, cap=12, window=8)
    assert torch.equal(one_shot.prefill(ids), chunked.prefill(ids))
    for a, b in zip(_layers(one_shot), _layers(chunked), strict=True):
        assert torch.equal(a.lengths, b.lengths) and torch.equal(a.context_keys, b.context_keys)
    assert torch.equal(one_shot.ask(_ids(3, seed=4), 6).tokens, chunked.ask(_ids(3, seed=4), 6).tokens)


@pytest.mark.parametrize("method", ["critical-snapkv", "critical-adakv", "pyramidkv", "layer-defensive"])
def test_an_unreachable_cap_is_the_uncompressed_chunked_prefill_bit_for_bit(method):
    model = _model("llama")
    ids, mask = _left_padded([_ids(37, seed=5)[0], _ids(22, seed=6)[0]])
    full = ContextSession(model, "full", chunk_size=10)
    capped = ContextSession(model, method, chunk_size=10, cap=1000, **_options(method, model))
    assert torch.equal(full.prefill(ids, mask), capped.prefill(ids, mask))
    whole = ContextSession(model, method, budget=1.0, chunk_size=10)  # budget 1.0: nothing installed, as one-shot
    assert whole.compressor is None and torch.equal(whole.prefill(ids, mask), full.last_logits)
    assert all(not layer.is_compressed for layer in _layers(capped))
    question = _ids(3, seed=7).expand(2, -1)
    assert torch.equal(full.ask(question, 5).tokens, capped.ask(question, 5).tokens)
    # the full session is transformers' own cache, prefilled chunk by chunk as prefill_in_chunks does
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        logits = prefill_in_chunks(model, ids, mask, cache, 10).logits[:, -1].float()
    assert torch.equal(logits, full.last_logits)


@pytest.mark.parametrize(
    ("method", "padded"),
    [
        ("critical-snapkv", False),
        ("critical-snapkv", True),
        ("critical-adakv", True),
        ("headkv", False),
        ("pyramidkv", True),
        ("layer-defensive", True),
        ("streaming", False),
        ("tova", True),
        ("critical-surrogate", False),
        ("defensive", True),
        ("measured-adakv", True),
        ("knorm", False),
    ],
)
def test_several_chunks_equal_the_masked_dense_reference(method, padded, monkeypatch):
    model = _model("llama")
    if padded:  # the second row's padding spans the first chunk whole
        ids, mask = _left_padded([_ids(50, seed=8)[0], _ids(27, seed=9)[0]])
    else:
        ids, mask = _ids(50, seed=8), torch.ones(1, 50, dtype=torch.long)
    tracker = Tracker(model, monkeypatch)
    try:
        session = ContextSession(model, _method(method, model), chunk_size=12, cap=10, **_options(method, model))
        session.prefill(ids, mask)
    finally:
        tracker.close()
    assert len(tracker.forwards) == 5
    reference = tracker.replay(model)
    for forward, want in zip(tracker.forwards, reference, strict=True):
        assert (forward["logits"] - want).abs().max().item() < 1e-4
    last = tracker.held(-1)
    for held in last.values():
        assert not bool((held & ~mask.bool()[:, None, :]).any())  # padding never held
    total = sum(held.sum(-1).sum(-1) for held in last.values())  # (b,): every layer and head of a row
    # allocators share out the cap; PyramidKV's shares come from each layer's own held length: up to twice the cap
    assert bool((total <= (2 if method == "pyramidkv" else 1) * 10 * 2 * len(last)).all())
    if method in ("critical-snapkv", "streaming", "tova", "critical-surrogate"):  # uniform: each head at the cap
        assert all(bool((held.sum(-1) == 10).all()) for held in last.values())


def test_a_chunk_over_compressed_layers_gets_a_mask_over_its_tail_alone(monkeypatch):
    """transformers sizes the mask by ``CompressedCache.get_mask_sizes``: after the first chunk it covers the tail
    (the chunk) alone, not every token seen (the test above holds with it); a dense layer widens it back to 0."""
    model = _model("llama")
    ids, mask = _left_padded([_ids(50, seed=8)[0], _ids(27, seed=9)[0]])  # padding in the second chunk: a mask
    widths = []  # (mask width, tail, seen) of every compressed layer's attention that received a mask
    tail_mask = CompressedLayer.tail_mask

    def spy(layer: CompressedLayer, logical_mask, query_length: int):
        if logical_mask is not None:
            widths.append((logical_mask.shape[-1], layer.tail, layer.seen))
        return tail_mask(layer, logical_mask, query_length)

    monkeypatch.setattr(CompressedLayer, "tail_mask", spy)
    session = ContextSession(model, "snapkv", chunk_size=12, cap=10, window=4)
    session.prefill(ids, mask)
    assert widths and all(width == tail < seen for width, tail, seen in widths)
    layers = _layers(session)
    assert session.cache.get_mask_sizes(3, 0) == (3, 50)  # the context ends at 50 in every layer: the question's
    layers[1].context_seen = 0  # as a layer still dense (or kept whole) reads the mask from position 0
    assert session.cache.get_mask_sizes(3, 0) == (53, 0)


@settings(max_examples=12)
@given(
    t=st.integers(5, 40),
    chunk=st.integers(4, 16),
    cap=st.integers(6, 16),
    window=st.integers(1, 6),
    pad=st.integers(0, 20),
)
def test_every_head_holds_at_most_the_cap_and_the_window_after_each_chunk(t, chunk, cap, window, pad):
    model = _model("llama")
    ids, mask = _left_padded([_ids(t, seed=t)[0], _ids(max(t - pad, 1), seed=pad)[0]])
    real = mask.sum(-1)  # (b,)
    with pytest.MonkeyPatch.context() as monkeypatch:
        tracker = Tracker(model, monkeypatch)
        try:
            ContextSession(model, "snapkv", chunk_size=chunk, cap=cap, window=window).prefill(ids, mask)
        finally:
            tracker.close()
    for index in range(len(tracker.forwards)):
        for held in tracker.held(index).values():  # (b, h_kv, seen)
            seen = held.shape[-1]
            held = held & mask[:, None, :seen].bool()  # a layer kept whole holds its padding (masked), as one-shot
            so_far = mask[:, :seen].sum(-1)  # (b,) real tokens prefilled so far
            assert torch.equal(held.sum(-1), torch.minimum(so_far, torch.tensor(cap))[:, None].expand(-1, 2))
            recent = held[..., -window:] | ~mask[:, None, seen - min(window, seen) : seen].bool()
            assert bool(recent.all())  # the last window's real tokens, in every head
    assert len(tracker.forwards) == -(-ids.shape[1] // chunk) and bool((real > 0).all())


def test_the_window_is_kept_after_each_chunk(monkeypatch):
    model = _model("llama")
    tracker = Tracker(model, monkeypatch)
    try:
        ContextSession(model, "critical-snapkv", chunk_size=7, cap=9, window=5).prefill(_ids(45, seed=2))
    finally:
        tracker.close()
    for index in range(len(tracker.forwards)):
        for held in tracker.held(index).values():
            assert bool(held[..., -5:].all())  # the last five tokens, in every head
            assert int(held.sum(-1).max()) <= 9


def test_generate_in_a_chunked_block_is_the_session_with_the_last_token_as_question():
    model = _model("llama")
    ids = _ids(41, seed=11)
    with criticalkv.compress(model, "critical-snapkv", chunk_size=16, cap=12, window=8):
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False)
    session = ContextSession(model, "critical-snapkv", chunk_size=16, cap=12, window=8)
    session.prefill(ids[:, :-1])
    assert torch.equal(out[:, 41:], session.ask(ids[:, -1:], 5).tokens)


@pytest.mark.parametrize(
    ("method", "options", "words"),
    [
        ("reconstruct", {}, "'reconstruct'"),
        ("layer-defensive-bounded", {}, "'layer-defensive-bounded'"),
        ("snapkv", {"budget": 0.2}, "fraction"),
        ("snapkv", {"cap": 1}, "cap"),
        ("snapkv", {"budget": 64, "cap": 8}, "give one"),
    ],
)
def test_what_cannot_run_in_chunks_is_refused_by_name(method, options, words):
    model = _model("llama")
    options = {"cap": 8, **options} if "budget" not in options else options
    with pytest.raises(BoundedMemoryError, match=words):
        ContextSession(model, method, chunk_size=8, **options)
    with pytest.raises(BoundedMemoryError, match="cap applies"):
        ContextSession(model, "snapkv", cap=8)


def test_run_prefills_in_chunks_and_compresses_while_answering(short_model, tmp_path):
    context = tmp_path / "context.txt"
    context.write_text("The quick brown fox jumps over the lazy dog. " * 3)
    out = tmp_path / "run.json"
    args = ["run", "--model", str(short_model), "--device", "cpu", "--context-file", str(context)]
    args += ["--question", "Who jumps?", "--methods", "snapkv", "--max-new-tokens", "6", "--option", "window=4"]
    args += ["--chunk-size", "16", "--cap", "12", "--compress-every", "4", "--json", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, (result.exception, result.output)
    report = json.loads(out.read_text())
    assert report["bounded"] == {"chunk_size": 16, "cap": 12, "compress_every": 4}
    snapkv = next(r for r in report["results"] if r["method"] == "snapkv")
    assert snapkv["kept_entries"] == 12  # one layer, one KV head, at the cap


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["run", "--chunk-size", "16"], "fraction"),
        (["run", "--cap", "16"], "cap applies"),
        (["eval", "ruler", "--chunk-size", "16"], "budget as a count"),
        (["eval", "needle", "--chunk-size", "16", "--cap", "8", "--budgets", "512"], "--cap is the one budget"),
        (["compress", "--chunk-size", "16", "--context-file", "x", "--out", "y"], "give --cap"),
        (["serve", "--compress-every", "16"], "give --cap"),
        (["serve", "--guide-chunks", "--cap", "16"], "give --chunk-size"),
        (["eval", "ruler", "--budgets", "8", "--full-from", "x"], "--full-from copies the full cache's rows"),
        (["eval", "needle", "--budgets", "8", "--full-from", "x"], "--full-from copies the full cache's rows"),
    ],
)
def test_the_commands_refuse_what_cannot_be_bounded(short_model, args, words):
    result = CliRunner().invoke(app, [*args, "--model", str(short_model), "--device", "cpu"])
    assert result.exit_code == 2 and words in " ".join(result.output.split()), result.output


@pytest.mark.parametrize(
    "benchmark",
    [["ruler", "--tasks", "vt", "--length", "128", "--samples", "1"], ["needle", "--lengths", "64", "--depths", "0.5"]],
)
def test_the_eval_sweeps_prefill_with_the_bounded_options_given(short_model, tmp_path, monkeypatch, benchmark):
    """--chunk-size and --cap reach the sweep's sessions and its folder's settings, --full-from the sweep, needle's as
    RULER's."""
    recorded = []

    def sweep(*args, bounded=None, settings, full_from=None, **kwargs):
        recorded.append((bounded, settings.get("bounded"), full_from))
        raise CriticalKVError("stop before answering")

    monkeypatch.setattr("criticalkv.eval.commands.run_sweep", sweep)
    monkeypatch.setattr("criticalkv.eval.ruler.generate", lambda *args, **kwargs: [])
    monkeypatch.setattr("criticalkv.eval.commands._check_prompts", lambda *args: None)  # the template exceeds 128
    args = ["eval", *benchmark, "--model", str(short_model), "--device", "cpu", "--out", str(tmp_path / "out")]
    result = CliRunner().invoke(app, [*args, "--chunk-size", "16", "--cap", "8", "--full-from", str(tmp_path / "one")])
    assert "stop before answering" in result.output, result.output
    assert recorded == [({"chunk_size": 16, "cap": 8}, {"chunk_size": 16, "cap": 8}, tmp_path / "one")]


def test_heads_holding_different_counts_read_their_own_entries_alone():
    """A ragged layer (head-wise budgets) compressed again: the window's attention of each head is its softmax over
    the entries it holds, as on that head's entries alone; its padding gets nothing."""
    module = _model("llama").model.layers[0].self_attn
    gen = torch.Generator().manual_seed(0)
    layer = CompressedLayer()
    layer.update(torch.randn(1, 2, 10, 16, generator=gen), torch.randn(1, 2, 10, 16, generator=gen))
    keep = torch.ones(1, 2, 10, dtype=torch.bool)
    keep[0, 0, :4] = False  # head 0 holds 6 entries, head 1 all 10
    layer.compress(keep)
    layer.update(torch.randn(1, 2, 3, 16, generator=gen), torch.randn(1, 2, 3, 16, generator=gen))
    keys, values, held = held_entries(layer)  # (1, 2, 13, 16), (1, 2, 13)
    assert held.sum(-1).tolist() == [[9, 13]]
    query = torch.randn(1, 4, 3, 16, generator=gen)
    view = LayerView(module, query, keys, values, held.any(1), 0.25, held=held)
    attention = window_attention(view, 3)  # (1, 2, G, 3, 13)
    for head in range(2):
        own = held[0, head]
        alone = LayerView(
            module,
            query[:, 2 * head : 2 * head + 2],
            keys[:, head : head + 1, own],
            values[:, head : head + 1, own],
            torch.ones(1, int(own.sum()), dtype=torch.bool),
            0.25,
        )
        torch.testing.assert_close(attention[:, head, ..., own], window_attention(alone, 3)[:, 0])
        assert float(attention[:, head, ..., ~own].abs().sum()) == 0.0


@pytest.mark.parametrize("family", ["granite", "qwen3"])  # a softmax scale of its own; QK-norm
def test_chunks_on_other_families_equal_the_masked_dense_reference(family, monkeypatch):
    model = _model(family)
    ids, mask = _left_padded([_ids(40, seed=12)[0], _ids(29, seed=13)[0]])
    tracker = Tracker(model, monkeypatch)
    try:
        ContextSession(model, "critical-adakv", chunk_size=10, cap=8, window=4).prefill(ids, mask)
    finally:
        tracker.close()
    for forward, want in zip(tracker.forwards, tracker.replay(model), strict=True):
        assert (forward["logits"] - want).abs().max().item() < 1e-4


def test_generate_takes_the_prompt_by_keyword_or_position_and_beams_are_refused_while_decoding():
    model = _model("llama")
    ids = _ids(30, seed=14)
    with criticalkv.compress(model, "snapkv", chunk_size=8, cap=10, window=4):
        by_keyword = model.generate(input_ids=ids, max_new_tokens=4, do_sample=False)
        by_position = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(by_keyword, by_position)
    with (
        criticalkv.compress(model, "snapkv", cap=10, compress_every=4, window=4),
        pytest.raises(BoundedMemoryError, match="beam search"),
    ):
        model.generate(ids, max_new_tokens=4, num_beams=2, do_sample=False)


def test_generate_continues_a_compressed_cache_in_chunks_and_refuses_what_it_would_prefill_whole():
    model = _model("llama")
    widths = []  # tokens of every forward
    hook = model.get_input_embeddings().register_forward_hook(lambda module, args, out: widths.append(out.shape[1]))
    try:
        with criticalkv.compress(model, "snapkv", chunk_size=8, cap=10, window=4):
            out = model.generate(_ids(30, seed=15), max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
            ids = torch.cat([out.sequences, _ids(25, seed=16)], dim=1)  # (1, 58): 32 tokens cached, 26 new
            widths.clear()
            model.generate(ids, cache=out.past_key_values, max_new_tokens=3, do_sample=False)
            assert widths == [8, 8, 8, 1, 1, 1, 1]  # the new tokens but the last in chunks, then three steps
            assert all(int(layer.lengths.max()) <= 10 + 2 for layer in out.past_key_values.layers)
            with pytest.raises(BoundedMemoryError, match="inputs_embeds"):
                model.generate(inputs_embeds=model.get_input_embeddings()(ids), max_new_tokens=2)
            widths.clear()
            with pytest.warns(UserWarning, match="stays empty"):
                model.generate(ids[:, :20], cache=DynamicCache(config=model.config), max_new_tokens=1)
            assert widths == [8, 8, 3, 1]  # an empty cache of the user's is a new prompt's
        filled = DynamicCache(config=model.config)
        model(ids[:, :5], cache=filled)
        with (
            criticalkv.compress(model, "snapkv", chunk_size=8, cap=10, window=4),
            pytest.raises(BoundedMemoryError, match="DynamicCache"),
        ):
            model.generate(ids, cache=filled, max_new_tokens=2)
    finally:
        hook.remove()
