"""Compression while decoding (``compress_every``) on tiny random models: every decode step equals full attention
with the evicted entries masked out, the cache stays at the cap, an unreachable cap changes nothing bit for bit,
and a session's context is the same for every question."""

from __future__ import annotations

import json

import pytest
import torch
from bounded_reference import Tracker
from test_runtime import _generate, _ids, _left_padded, _model
from test_sweep import _score, _setup

import criticalkv
from criticalkv.budget import Budget
from criticalkv.cache import CompressedLayer
from criticalkv.errors import BoundedMemoryError, CriticalKVError
from criticalkv.eval.report import write_report
from criticalkv.eval.sweep import run_sweep
from criticalkv.prompts import encode_prompt
from criticalkv.runtime.session import ContextSession

CAP, EVERY = 12, 4


@pytest.mark.parametrize(
    ("method", "padded", "chunk_size"),
    [
        ("critical-snapkv", False, None),
        ("critical-snapkv", True, None),
        ("critical-adakv", True, None),
        ("pyramidkv", False, 16),
        ("layer-defensive", True, 16),
        ("streaming", True, None),
    ],
)
def test_decoding_with_compression_equals_the_masked_dense_reference(method, padded, chunk_size, monkeypatch):
    model = _model("llama")
    if padded:
        ids, mask = _left_padded([_ids(30, seed=1)[0], _ids(19, seed=2)[0]])
    else:
        ids, mask = _ids(30, seed=1), torch.ones(1, 30, dtype=torch.long)
    options = {} if method == "streaming" else {"window": 4}
    tracker = Tracker(model, monkeypatch)
    try:
        with criticalkv.compress(
            model, method, cap=CAP, compress_every=EVERY, chunk_size=chunk_size, **options
        ) as compressor:
            _generate(model, ids, mask, n=14)
    finally:
        tracker.close()
    assert compressor.rolling.every == EVERY
    reference = tracker.replay(model)
    for forward, want in zip(tracker.forwards, reference, strict=True):
        assert (forward["logits"] - want).abs().max().item() < 1e-4
    bound = (2 if method == "pyramidkv" else 1) * CAP * 2 * 2 + EVERY * 2 * 2  # rows' entries over layers and heads
    for index in range(1, len(tracker.forwards)):
        held = tracker.held(index)
        total = sum(h.sum(-1).sum(-1) for h in held.values())  # (b,)
        assert bool((total <= bound).all()), index
        for h in held.values():  # the newest tokens are kept in every head
            assert bool(h[..., -min(EVERY, 4) :].all())


def test_an_unreachable_cap_while_decoding_is_the_uncompressed_model_bit_for_bit():
    model = _model("llama")
    ids, mask = _left_padded([_ids(30, seed=3)[0], _ids(21, seed=4)[0]])
    tokens, logits = _generate(model, ids, mask, n=10)
    with criticalkv.compress(model, "critical-adakv", cap=1000, compress_every=3, window=4):
        capped_tokens, capped_logits = _generate(model, ids, mask, n=10)
    assert torch.equal(tokens, capped_tokens) and torch.equal(logits, capped_logits)
    full = ContextSession(model, "full")
    capped = ContextSession(model, "critical-snapkv", cap=1000, compress_every=3, window=4)
    full.prefill(ids, mask)
    capped.prefill(ids, mask)
    question = _ids(3, seed=5).expand(2, -1)
    assert torch.equal(full.ask(question, 9).tokens, capped.ask(question, 9).tokens)


def test_a_session_holds_the_cap_while_answering_and_keeps_its_context():
    model = _model("llama")
    session = ContextSession(model, "critical-snapkv", cap=CAP, compress_every=EVERY, window=4)
    session.prefill(_ids(40, seed=6))
    before = session.kv_bytes()
    question = _ids(3, seed=7)
    first = session.ask(question, 20).tokens
    steps = session.stream(question, 20)
    sizes = []
    for _ in steps:
        layers = [layer for layer in session.cache.layers if isinstance(layer, CompressedLayer)]
        sizes.append(max(int(layer.lengths.max()) + layer.tail for layer in layers))
    assert max(sizes) <= CAP + EVERY and len(sizes) == 20
    assert session.kv_bytes() == before  # the context is back, as after the prefill
    assert torch.equal(session.ask(question, 20).tokens, first)


def test_a_sweep_with_bounded_options_answers_as_separate_bounded_sessions(tmp_path, tiny_tokenizer):
    model, samples = _setup(tiny_tokenizer)
    bounded = {"chunk_size": 64, "compress_every": 4}
    rows = run_sweep(
        model,
        tiny_tokenizer,
        samples[:1],
        _score,
        methods=["critical-snapkv"],
        budgets=[Budget(24)],
        regime="agnostic",
        out_dir=tmp_path,
        max_new_tokens=lambda s: 6,
        bounded=bounded,
        settings={"bounded": bounded},
    )
    sample = samples[0]
    prefix_ids, suffix_ids = encode_prompt(tiny_tokenizer, sample.context, sample.question, sample.answer_prefix)
    for row in rows:
        session = ContextSession(model, row.method, row.budget, **bounded)
        session.prefill(torch.tensor([prefix_ids]))
        tokens = session.ask(torch.tensor([suffix_ids]), max_new_tokens=6, eos_token_id=tiny_tokenizer.eos_token_id)
        assert tiny_tokenizer.decode(tokens.tokens[0], skip_special_tokens=True).strip() == row.prediction
    assert rows[1].kept_fraction < 0.2  # 24 entries per head of a prompt of more than 200 tokens


def test_a_chunked_sweep_copies_the_full_cache_rows_of_a_one_shot_sweep(tmp_path, tiny_tokenizer, monkeypatch):
    """``full_from``: the chunked folder takes the one-shot folder's full-cache rows (marked copied) instead of
    prefilling the full cache again; a sample the one-shot folder lacks is answered; the compressed rows and their
    kept fractions are a chunked sweep's that prefilled the full cache."""
    model, samples = _setup(tiny_tokenizer)
    bounded = {"chunk_size": 64, "cap": 24}
    common = {"methods": ["critical-snapkv"], "budgets": [Budget(24)], "regime": "agnostic"}
    common |= {"max_new_tokens": lambda s: 6}
    settings = {"benchmark": "toy", "seed": 0}
    oneshot = run_sweep(
        model, tiny_tokenizer, samples[:2], _score, out_dir=tmp_path / "oneshot", settings=settings, **common
    )
    chunked = {"bounded": bounded, "settings": {"bounded": bounded, **settings}}
    reference = run_sweep(model, tiny_tokenizer, samples, _score, out_dir=tmp_path / "prefilled", **chunked, **common)
    full_prefills = []
    prefill = ContextSession.prefill

    def counted(session, *args, **kwargs):
        full_prefills.append(session.compressor is None or session.compressor.method is None)
        return prefill(session, *args, **kwargs)

    monkeypatch.setattr(ContextSession, "prefill", counted)
    rows = run_sweep(
        model,
        tiny_tokenizer,
        samples,
        _score,
        out_dir=tmp_path / "copied",
        full_from=tmp_path / "oneshot",
        **chunked,
        **common,
    )
    assert sum(full_prefills) == 1 and len(full_prefills) == 4  # the full cache of sample 2 only
    full = {r.index: r for r in rows if r.method == "full"}
    assert [full[i].copied for i in range(3)] == [True, True, False]
    assert all(full[r.index].prediction == r.prediction for r in oneshot if r.method == "full")
    compressed = [(r.index, r.prediction, r.kept_fraction) for r in rows if r.method != "full"]
    assert compressed == [(r.index, r.prediction, r.kept_fraction) for r in reference if r.method != "full"]
    stored = [json.loads(line) for line in (tmp_path / "copied" / "results.jsonl").read_text().splitlines()]
    assert [row.get("copied") for row in stored if row["method"] == "full"] == [True, True, None]
    assert all("copied" not in row for row in stored if row["method"] != "full")
    assert "full cache's rows of 2 of 3 samples were copied" in write_report(tmp_path / "copied").read_text()
    assert "copied" not in write_report(tmp_path / "prefilled").read_text()

    with pytest.raises(CriticalKVError, match="chunked sweep"):  # one-shot: its prefill is shared anyway
        run_sweep(
            model, tiny_tokenizer, samples, _score, out_dir=tmp_path / "x", full_from=tmp_path / "oneshot", **common
        )
    other = {"bounded": bounded, "settings": {"bounded": bounded, "benchmark": "toy", "seed": 1}}
    with pytest.raises(CriticalKVError, match="seed: 0 there, 1 now"):
        run_sweep(
            model,
            tiny_tokenizer,
            samples,
            _score,
            out_dir=tmp_path / "y",
            full_from=tmp_path / "oneshot",
            **other,
            **common,
        )
    with pytest.raises(CriticalKVError, match=r"no sweep\.json"):
        run_sweep(
            model, tiny_tokenizer, samples, _score, out_dir=tmp_path / "z", full_from=tmp_path, **chunked, **common
        )


def test_stacked_sessions_compress_while_answering_once_they_saw_a_window():
    model = _model("llama")
    ids = _ids(30, seed=9)
    sessions = []
    for method in ("critical-snapkv", "snapkv"):
        session = ContextSession(model, method, cap=CAP, compress_every=EVERY, window=8)  # a window > EVERY
        session.prefill(ids)
        sessions.append(session)
    stacked = ContextSession.stacked(sessions)
    question = _ids(2, seed=10).expand(2, -1)
    steps = []
    for _ in stacked.stream(question, 12):
        layers = [layer for layer in stacked.cache.layers if isinstance(layer, CompressedLayer)]
        steps.append(max(int(layer.lengths.max()) + layer.tail for layer in layers))
    assert len(steps) == 12 and steps[-1] <= CAP + EVERY  # compressed once the stacked rows saw a window


def test_a_loaded_session_compresses_while_answering_as_the_session_it_was_saved_from(tmp_path):
    model = _model("llama")
    made = ContextSession(model, "critical-snapkv", cap=CAP, compress_every=EVERY, window=4)
    made.prefill(_ids(40, seed=12))
    made.save(tmp_path / "ctx.safetensors")
    loaded = ContextSession.load(tmp_path / "ctx.safetensors", model, compress_every=EVERY)  # cap: the file's 12
    question = _ids(3, seed=13)
    sizes = []
    for _ in loaded.stream(question, 20):
        layers = [layer for layer in loaded.cache.layers if isinstance(layer, CompressedLayer)]
        sizes.append(max(int(layer.lengths.max()) + layer.tail for layer in layers))
    assert max(sizes) <= CAP + EVERY and len(sizes) == 20
    # the window (4 queries) is the question's and the answer's by the first compression: as the saved session
    assert torch.equal(loaded.ask(question, 20).tokens, made.ask(question, 20).tokens)
    plain = ContextSession.load(tmp_path / "ctx.safetensors", model)
    assert not torch.equal(plain.ask(question, 20).tokens, made.ask(question, 20).tokens)  # it did compress


def test_a_loaded_session_refuses_a_decoding_schedule_it_cannot_follow(tmp_path):
    model = _model("llama")
    for method, budget in (("critical-snapkv", 0.3), ("layer-defensive-bounded", 12)):
        session = ContextSession(model, method, budget, window=4)
        session.prefill(_ids(40, seed=14))
        session.save(tmp_path / f"{method}.safetensors")
    with pytest.raises(BoundedMemoryError, match="give cap"):
        ContextSession.load(tmp_path / "critical-snapkv.safetensors", model, compress_every=EVERY)  # 0.3 of what?
    with pytest.raises(BoundedMemoryError, match="applies with compress_every"):
        ContextSession.load(tmp_path / "critical-snapkv.safetensors", model, cap=CAP)
    with pytest.raises(BoundedMemoryError, match="'layer-defensive-bounded:window=4'"):  # state over one prefill
        ContextSession.load(tmp_path / "layer-defensive-bounded.safetensors", model, cap=CAP, compress_every=EVERY)
    loaded = ContextSession.load(tmp_path / "critical-snapkv.safetensors", model, cap=CAP, compress_every=EVERY)
    assert loaded.compressor.rolling.cap == CAP and loaded.compressor.method.scorer.window == 4  # the saved window
