"""Saving and loading a compressed context: bit-identical answers from the file, refusals of another model, dtype or
layout version, and atomic writes."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_runtime import _ids, _model

from criticalkv import Method
from criticalkv.errors import CacheStateError, StoredContextError
from criticalkv.methods import build_method
from criticalkv.runtime import persist
from criticalkv.runtime.session import ContextSession
from criticalkv.scorers import SnapKVScorer
from criticalkv.selectors import CriticalSelector

#: one preset per family of the cache's layouts: uniform, head-wise (variable segment lengths), cross-layer (deferred)
PRESETS = ["snapkv:window=8", "critical-adakv:window=8", "layer-defensive:window=8"]
STEPS = 5


def _greedy_logits(session: ContextSession, question: torch.Tensor, question_mask: torch.Tensor) -> torch.Tensor:
    """Logits (b, STEPS, vocab) of the question's last token, then of each greedy token, from ``session``'s cache;
    the session is rewound after."""
    mask = torch.cat([session.mask, question_mask], dim=1)
    logits = [session._forward(question, mask)]
    for _ in range(STEPS - 1):
        token = logits[-1].argmax(-1, keepdim=True)  # (b, 1)
        mask = torch.cat([mask, torch.ones_like(token)], dim=1)
        logits.append(session._forward(token, mask))
    session.rewind()
    return torch.stack(logits, dim=1)


def _padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows, the second left-padded by 5 tokens: ids (2, 40), mask (2, 40)."""
    ids = _ids(40, seed=3, b=2)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    ids[1, :5] = 0
    return ids, mask


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("method", PRESETS)
def test_a_loaded_session_answers_bit_identically(tmp_path: Path, method: str, rows: int) -> None:
    model = _model("llama")
    ids, mask = _padded_batch() if rows == 2 else (_ids(40, seed=3), None)
    session = ContextSession(model, method, 0.3)
    session.prefill(ids, mask)
    question = _ids(6, seed=4, b=rows)
    question_mask = torch.ones_like(question)
    expected = _greedy_logits(session, question, question_mask)
    size = session.save(tmp_path / "context.safetensors")
    loaded = ContextSession.load(tmp_path / "context.safetensors", model)
    assert size == (tmp_path / "context.safetensors").stat().st_size
    assert torch.equal(_greedy_logits(loaded, question, question_mask), expected)
    assert torch.equal(loaded.last_logits, session.last_logits)
    assert loaded.kv_entries() == session.kv_entries()
    assert loaded.context_digest == session.context_digest is not None
    # ask itself, twice (the loaded session rewinds to its context like the original)
    for _ in range(2):
        answers = [s.ask(question, max_new_tokens=4).tokens for s in (loaded, session)]
        assert torch.equal(*answers)


def test_head_wise_segments_survive_the_file(tmp_path: Path) -> None:
    """The head-wise preset really stores segments of different lengths, and they come back as they were."""
    model = _model("llama")
    session = ContextSession(model, "critical-adakv:window=8", 0.3)
    session.prefill(_ids(40, seed=3))
    session.save(tmp_path / "c.safetensors")
    loaded = ContextSession.load(tmp_path / "c.safetensors", model)
    before = [layer.lengths for layer in session.cache.layers]
    after = [layer.lengths for layer in loaded.cache.layers]
    assert any(int(lengths.min()) != int(lengths.max()) for lengths in before)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_a_joined_layer_is_saved_as_its_flat_context(tmp_path: Path) -> None:
    """After an answer, a uniform layer holds its context joined with the tail's room: the file holds the same
    entries as the flat layout, and saving does not change the layer's layout."""
    model = _model("llama")
    session = ContextSession(model, "snapkv", 0.3)
    session.prefill(_ids(40, seed=3))
    flat = [(layer.context_keys.clone(), layer.context_values.clone()) for layer in session.cache.layers]
    session.ask(_ids(4, seed=5), max_new_tokens=3)
    assert all(layer._joined is not None for layer in session.cache.layers)
    session.save(tmp_path / "c.safetensors")
    assert all(layer._joined is not None for layer in session.cache.layers)
    tensors = load_file(tmp_path / "c.safetensors")
    for index, (keys, values) in enumerate(flat):
        assert torch.equal(tensors[f"layer.{index}.keys"], keys)
        assert torch.equal(tensors[f"layer.{index}.values"], values)


def test_a_cache_saved_alone_loads_under_its_method(tmp_path: Path) -> None:
    model = _model("llama")
    session = ContextSession(model, "critical-adakv:window=8", 0.3)
    session.prefill(_ids(40, seed=3))
    persist.save_cache(session.cache, tmp_path / "cache.safetensors")
    cache = persist.load_cache(tmp_path / "cache.safetensors", model)
    assert cache.compressor.method.name == "critical-adakv:window=8" and cache.compressor.budget.value == 0.3
    question = _ids(6, seed=4)
    expected = _greedy_logits(session, question, torch.ones_like(question))
    reloaded = ContextSession.from_cache(model, cache.compressor, cache, session.mask, session.last_logits)
    assert torch.equal(_greedy_logits(reloaded, question, torch.ones_like(question)), expected)
    with pytest.raises(StoredContextError, match="bare cache"):
        ContextSession.load(tmp_path / "cache.safetensors", model)


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    session = ContextSession(_model("llama"), "snapkv", 0.3)
    session.prefill(_ids(40, seed=3))
    session.save(tmp_path / "c.safetensors")
    return tmp_path / "c.safetensors"


def test_another_models_weights_are_refused(saved: Path) -> None:
    other = copy.deepcopy(_model("llama"))
    with torch.no_grad():
        next(other.parameters())[0, 0] += 1.0  # one weight differs
    with pytest.raises(StoredContextError, match="another model: its weights differ"):
        ContextSession.load(saved, other)


def test_an_in_place_change_of_the_same_model_is_seen(saved: Path) -> None:
    """The fingerprint is memoised per model object, yet a weight changed in place afterwards is not missed."""
    model = copy.deepcopy(_model("llama"))
    ContextSession.load(saved, model)  # memoises the fingerprint
    with torch.no_grad():
        next(model.parameters())[0, 0] += 1.0
    with pytest.raises(StoredContextError, match="weights differ"):
        ContextSession.load(saved, model)


def test_another_config_is_refused(saved: Path) -> None:
    with pytest.raises(StoredContextError, match="another model: its model family differs"):
        ContextSession.load(saved, _model("qwen2"))


def test_another_dtype_is_refused(saved: Path) -> None:
    """The same weights in bfloat16 hash differently; the dtype check names the dtypes when only they differ."""
    header = persist.read_header(saved)
    model = copy.deepcopy(_model("llama")).to(torch.bfloat16)
    header["model"] = persist.model_fingerprint(model)
    _rewrite_header(saved, header)
    with pytest.raises(StoredContextError, match="holds a float32 cache; the model runs in bfloat16"):
        ContextSession.load(saved, model)


def test_another_layout_version_is_refused(saved: Path) -> None:
    header = persist.read_header(saved)
    header["layout_version"] = persist.LAYOUT_VERSION + 1
    _rewrite_header(saved, header)
    with pytest.raises(StoredContextError, match="layout version 2, this library reads version 1"):
        ContextSession.load(saved, _model("llama"))


def test_a_file_that_is_no_saved_context_is_refused(tmp_path: Path) -> None:
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(StoredContextError, match="is not a saved criticalkv context"):
        ContextSession.load(tmp_path / "junk.safetensors", _model("llama"))
    save_file({"x": torch.zeros(2)}, tmp_path / "plain.safetensors")
    with pytest.raises(StoredContextError, match="without a criticalkv header"):
        ContextSession.load(tmp_path / "plain.safetensors", _model("llama"))


def _rewrite_header(path: Path, header: dict) -> None:
    save_file(load_file(path), path, metadata={persist.HEADER_KEY: json.dumps(header)})


def test_the_header_says_what_the_file_holds(saved: Path) -> None:
    header = persist.read_header(saved)
    assert header["kind"] == "session" and header["dtype"] == "float32" and header["budget"] == 0.3
    assert header["method"]["spec"] == "snapkv" and "SnapKVScorer" in header["method"]["description"]
    assert header["context"]["tokens"] == 40 and len(header["context"]["sha256"]) == 64
    assert header["model"] == persist.model_fingerprint(_model("llama"))


def test_the_header_spec_holds_the_keyword_options_and_builds_what_it_describes(tmp_path: Path) -> None:
    model = _model("llama")
    made = ContextSession(model, "critical-snapkv", 12, window=8, alpha=0.25)
    made.prefill(_ids(40, seed=4))
    made.save(tmp_path / "options.safetensors")
    header = persist.read_header(tmp_path / "options.safetensors")["method"]
    assert header["spec"] == "critical-snapkv:alpha=0.25;window=8"
    assert header["description"] == repr(build_method(header["spec"]))  # the spec builds what the file describes
    custom = Method(SnapKVScorer(window=8), selector=CriticalSelector(window=8))
    made = ContextSession(model, custom, 12)
    made.prefill(_ids(40, seed=4))
    made.save(tmp_path / "custom.safetensors")
    header = persist.read_header(tmp_path / "custom.safetensors")["method"]
    assert header["spec"] == "custom" and header["description"] == repr(custom)
    with pytest.raises(StoredContextError, match="pass method="):
        ContextSession.load(tmp_path / "custom.safetensors", model, compress_every=4)
    loaded = ContextSession.load(tmp_path / "custom.safetensors", model, custom, compress_every=4)
    assert loaded.compressor.rolling.cap == 12


def test_a_crash_mid_write_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    session = ContextSession(_model("llama"), "snapkv", 0.3)
    session.prefill(_ids(40, seed=3))
    real_fsync = os.fsync

    def crash(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", crash)
    with pytest.raises(OSError, match="No space left"):
        session.save(tmp_path / "c.safetensors")
    assert list(tmp_path.iterdir()) == []  # neither the target nor a temporary file
    monkeypatch.setattr(os, "fsync", real_fsync)
    session.save(tmp_path / "c.safetensors")
    before = (tmp_path / "c.safetensors").read_bytes()
    monkeypatch.setattr(os, "fsync", crash)
    with pytest.raises(OSError):
        session.save(tmp_path / "c.safetensors")
    assert (tmp_path / "c.safetensors").read_bytes() == before  # the earlier file is intact
    assert [p.name for p in tmp_path.iterdir()] == ["c.safetensors"]


def test_what_cannot_be_saved_is_refused(tmp_path: Path) -> None:
    model = _model("llama")
    full = ContextSession(model, "full")
    full.prefill(_ids(20))
    with pytest.raises(CacheStateError, match="only a CompressedCache is saved"):
        full.save(tmp_path / "f.safetensors")
    with pytest.raises(CacheStateError, match="call prefill"):
        ContextSession(model, "snapkv", 0.3).save(tmp_path / "g.safetensors")
    sliding = ContextSession(_model("gemma3"), "snapkv", 0.5)
    sliding.prefill(_ids(20))
    with pytest.raises(CacheStateError, match="sliding-window layers"):
        sliding.save(tmp_path / "s.safetensors")
    assert list(tmp_path.iterdir()) == []
