"""Question-guided chunked prefill (``ContextSession.prefill(..., guide_ids=)``, ``--guide-chunks``): every chunk but
the last is scored by the guide's queries, run right after it; the guide's entries are never kept and leave the
cache. References: one-shot SnapKV over chunk + guide (the guide as its window), the masked dense replay of every
forward, and the uncompressed chunked prefill."""

from __future__ import annotations

import json

import pytest
import torch
from bounded_reference import Tracker
from test_chunked import _layers, _method, _options
from test_runtime import _ids, _left_padded, _model
from typer.testing import CliRunner

from criticalkv.budget import Budget
from criticalkv.cli import app
from criticalkv.errors import BoundedMemoryError
from criticalkv.runtime.session import ContextSession
from criticalkv.serve.app import ServerSettings
from criticalkv.serve.store import ContextStore


def _tracked(model, monkeypatch, session: ContextSession, *args, **kwargs) -> Tracker:
    tracker = Tracker(model, monkeypatch)
    try:
        session.prefill(*args, **kwargs)
    finally:
        tracker.close()
    return tracker


def test_a_guided_chunk_keeps_what_one_shot_snapkv_keeps_of_it_with_the_guide_as_its_window(monkeypatch):
    """Chunk + guide in one forward is what one-shot SnapKV sees of the prompt chunk + guide; with a guide as long
    as the window, one-shot keeps the window (the guide) and the best ``cap`` of the chunk: the guided chunk keeps
    those ``cap`` in every layer and head (the layers above read the uncompressed layer below in both)."""
    model = _model("llama")
    chunk, guide = _ids(30, seed=11), _ids(8, seed=12)
    guided = ContextSession(model, "snapkv", chunk_size=30, cap=10, window=8)
    tracker = _tracked(model, monkeypatch, guided, torch.cat([chunk, guide], 1), guide_ids=guide)
    assert len(tracker.forwards) == 3  # the chunk, its guide, the last chunk (the guide as the prompt's end)
    after_guide = tracker.held(1)  # layer -> (b, h_kv, 30)
    with pytest.MonkeyPatch.context() as other:
        one_shot = ContextSession(model, "snapkv", budget=18, window=8)
        reference = _tracked(model, other, one_shot, torch.cat([chunk, guide], 1)).held(-1)  # (b, h_kv, 38)
    assert after_guide.keys() == reference.keys()
    for layer, held in after_guide.items():
        assert held.shape[-1] == 30 and bool(reference[layer][..., 30:].all())
        assert torch.equal(held, reference[layer][..., :30])
        assert bool((held.sum(-1) == 10).all())


@pytest.mark.parametrize(
    ("method", "padded"),
    [
        ("snapkv", False),
        ("critical-snapkv", True),
        ("critical-adakv", False),
        ("headkv", True),
        ("layer-defensive", True),
        ("tova", False),
        ("critical-surrogate", False),
    ],
)
def test_several_guided_chunks_equal_the_masked_dense_reference(method, padded, monkeypatch):
    """Every forward (chunks and guides) equals full attention over the positions the cache held; the guide's
    positions are never held afterwards (the tracker checks it); each layer ends at the prompt's length."""
    model = _model("llama")
    if padded:
        ids, mask = _left_padded([_ids(50, seed=8)[0], _ids(27, seed=9)[0]])
    else:
        ids, mask = _ids(50, seed=8), torch.ones(1, 50, dtype=torch.long)
    guide = _ids(6, seed=10).expand(ids.shape[0], -1)
    session = ContextSession(model, _method(method, model), chunk_size=12, cap=10, **_options(method, model))
    tracker = _tracked(model, monkeypatch, session, ids, mask, guide_ids=guide)
    assert len(tracker.forwards) == 9  # 5 chunks, a guide after each of the first 4
    for forward, want in zip(tracker.forwards, tracker.replay(model), strict=True):
        assert (forward["logits"] - want).abs().max().item() < 1e-4
    assert all(layer.seen == layer.context_seen == 50 for layer in _layers(session))
    if method in ("snapkv", "critical-snapkv", "tova", "critical-surrogate"):  # uniform: each head at the cap
        for index in range(1, 8, 2):  # after each guide, each head at the cap, or at every real token so far
            for held in tracker.held(index).values():  # (b, h_kv, seen)
                seen = held.shape[-1]
                want = torch.minimum(mask[:, :seen].sum(-1), torch.tensor(10))[:, None]
                assert torch.equal((held & mask[:, None, :seen].bool()).sum(-1), want.expand(-1, held.shape[1]))


def test_a_guide_changes_nothing_where_nothing_is_evicted():
    model = _model("llama")
    ids, guide = _ids(37, seed=5), _ids(4, seed=6)
    plain = ContextSession(model, "critical-snapkv", chunk_size=10, cap=1000, window=8)
    guided = ContextSession(model, "critical-snapkv", chunk_size=10, cap=1000, window=8)
    assert torch.equal(plain.prefill(ids), guided.prefill(ids, guide_ids=guide))
    one_chunk = ContextSession(model, "critical-snapkv", chunk_size=64, cap=12, window=8)  # one chunk: no guide runs
    one_shot = ContextSession(model, "critical-snapkv", budget=12, window=8)
    assert torch.equal(one_chunk.prefill(ids, guide_ids=guide), one_shot.prefill(ids))
    full = ContextSession(model, "full", chunk_size=10)  # nothing compressed: the guide is not run
    assert torch.equal(full.prefill(ids, guide_ids=guide), plain.last_logits)


@pytest.mark.parametrize(
    ("kwargs", "guide", "words"),
    [
        ({"budget": 12}, _ids(4, seed=1), "give the session a chunk_size"),
        ({"chunk_size": 10, "cap": 12}, _ids(4, seed=1)[0], "(batch, g)"),
        ({"chunk_size": 10, "cap": 12}, _ids(4, seed=1).expand(2, -1), "the prompt's batch 1"),
    ],
)
def test_a_guide_that_cannot_apply_is_refused(kwargs, guide, words):
    session = ContextSession(_model("llama"), "snapkv", window=4, **kwargs)
    with pytest.raises(BoundedMemoryError, match=words.replace("(", r"\(").replace(")", r"\)")):
        session.prefill(_ids(30, seed=2), guide_ids=guide)


def test_a_guide_is_refused_where_sliding_window_layers_would_keep_it(tmp_path):
    """By a session's prefill, and by a server's settings before it serves."""
    model = _model("gemma3")
    session = ContextSession(model, "snapkv", window=4, chunk_size=10, cap=12)
    with pytest.raises(BoundedMemoryError, match="sliding-window layers would keep"):
        session.prefill(_ids(30, seed=2), guide_ids=_ids(4, seed=1))
    store, bounded = ContextStore(model, tmp_path, max_bytes=1 << 20), {"chunk_size": 10, "cap": 12}
    with pytest.raises(BoundedMemoryError, match="sliding-window layers would keep"):
        ServerSettings(model, None, "tiny", store, "snapkv", Budget(12), bounded=bounded, guide_chunks=True)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["run", "--guide-chunks", "--cap", "8", "--chunk-size", "16"], "--mode aware"),
        (["eval", "ruler", "--guide-chunks", "--budgets", "8", "--mode", "aware"], "give --chunk-size"),
        (["eval", "needle", "--guide-chunks", "--cap", "8", "--chunk-size", "16"], "--mode aware"),
    ],
)
def test_the_commands_refuse_a_guide_without_chunks_or_question(short_model, args, words):
    result = CliRunner().invoke(app, [*args, "--model", str(short_model), "--device", "cpu"])
    assert result.exit_code == 2 and words in " ".join(result.output.split()), result.output


def test_run_guides_its_chunks_with_the_question(short_model, tmp_path):
    context = tmp_path / "context.txt"
    context.write_text("The quick brown fox jumps over the lazy dog. " * 3)
    out = tmp_path / "run.json"
    args = ["run", "--model", str(short_model), "--device", "cpu", "--context-file", str(context), "--mode", "aware"]
    args += ["--question", "Who jumps?", "--methods", "snapkv", "--max-new-tokens", "4", "--option", "window=4"]
    args += ["--chunk-size", "16", "--cap", "12", "--guide-chunks", "--json", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, (result.exception, result.output)
    report = json.loads(out.read_text())
    assert report["bounded"] == {"chunk_size": 16, "cap": 12, "guide_chunks": True}
    assert next(r for r in report["results"] if r["method"] == "snapkv")["kept_entries"] == 12


@pytest.mark.parametrize("method", ["knorm", "streaming", "surrogate"])
def test_scorers_that_read_no_queries_keep_the_same_entries_with_a_guide(method):
    """Key norm, StreamingLLM and the surrogate (each entry placed in the prompt, the guide's tokens not counted)
    score each entry alone: the guide's forward changes no choice."""
    model = _model("llama")
    ids, guide = _ids(45, seed=3), _ids(5, seed=4)
    plain = ContextSession(model, _method(method, model), chunk_size=10, cap=8, **_options(method, model))
    guided = ContextSession(model, _method(method, model), chunk_size=10, cap=8, **_options(method, model))
    assert torch.equal(plain.prefill(ids), guided.prefill(ids, guide_ids=guide))
    for a, b in zip(_layers(plain), _layers(guided), strict=True):
        assert torch.equal(a.lengths, b.lengths) and torch.equal(a.context_keys, b.context_keys)


@pytest.mark.parametrize(
    ("regime", "bounded", "words"),
    [("agnostic", {"chunk_size": 16, "cap": 8}, "--mode aware"), ("aware", None, "give --chunk-size")],
)
def test_a_sweep_refuses_a_guide_without_chunks_or_question_before_any_work(regime, bounded, words, tmp_path):
    from criticalkv.eval.sweep import run_sweep

    with pytest.raises(BoundedMemoryError, match=words):
        run_sweep(
            None, None, [], None, ["snapkv"], [], regime, tmp_path / "out", None, bounded=bounded, guide_chunks=True
        )
    assert not (tmp_path / "out").exists()
