"""Where the entries of a cache compressed again stand in the prompt (``LayerView.places``, ``Rolling``'s places):
checked against the tracker of the slow reference, which follows every compression by position, and the
surrogate's ``place="prompt"``, which reads them."""

from __future__ import annotations

import pytest
import torch
from bounded_reference import Tracker
from test_chunked import _layers, _options
from test_runtime import _ids, _left_padded, _model

from criticalkv.runtime.session import ContextSession
from criticalkv.scorers.surrogate import SurrogateScorer, place_features, prompt_place_features


def _true_places(layer, positions: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """Each (row, head) segment's entries as indices among the row's real tokens, ascending: from the tracker's
    (b, h_kv, seen) bool of held positions and the (b, t) padding mask."""
    real_index = mask.long().cumsum(-1) - 1  # (b, t)
    b, h, _ = positions.shape
    return [real_index[i, : positions.shape[-1]][positions[i, j]] for i in range(b) for j in range(h)]


def _rolling_places(session: ContextSession, layer_idx: int, layer) -> list[torch.Tensor]:
    flat = session.compressor.places.known[layer_idx][2].long()
    return list(flat.split(layer.lengths.flatten().tolist()))


def _places_read(monkeypatch) -> list:
    """What the surrogate reads at each scoring from now on: (places, seen), or None where it gets no places."""
    read = []
    real_score = SurrogateScorer.score

    def score(scorer, view):
        read.append(None if view.places is None else (view.places.clone(), view.seen.clone()))
        return real_score(scorer, view)

    monkeypatch.setattr(SurrogateScorer, "score", score)
    return read


@pytest.mark.parametrize(
    ("method", "padded", "guided"),
    [("critical-surrogate", True, False), ("layer-surrogate", False, False), ("surrogate", True, True)],
)
def test_the_places_of_kept_entries_follow_every_chunk_and_decoding_compression(method, padded, guided, monkeypatch):
    """After a chunked prefill each layer's remembered places are the prompt positions the tracker says it holds
    (left padding, head-wise and cross-layer budgets, and a guide, whose tokens are not counted, included); an
    answer compressed every few tokens leaves them as they were."""
    model = _model("llama")
    if padded:
        ids, mask = _left_padded([_ids(50, seed=8)[0], _ids(27, seed=9)[0]])
    else:
        ids, mask = _ids(50, seed=8), torch.ones(1, 50, dtype=torch.long)
    weights = _options(method, model)["weights"]
    session = ContextSession(model, method, chunk_size=12, cap=10, compress_every=4, weights=weights, place="prompt")
    tracker = Tracker(model, monkeypatch)
    try:
        session.prefill(ids, mask, guide_ids=_ids(6, seed=10).expand(ids.shape[0], -1) if guided else None)
        for index, layer in enumerate(_layers(session)):
            want = _true_places(layer, tracker.positions[id(layer)][..., : layer.context_seen], mask)
            got = _rolling_places(session, index, layer)
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
            assert torch.equal(session.compressor.places.known[index][3], mask.sum(-1))
        before = [_rolling_places(session, index, layer) for index, layer in enumerate(_layers(session))]
        session.ask(_ids(3, seed=4).expand(ids.shape[0], -1), max_new_tokens=12)  # compresses a copy while decoding
    finally:
        tracker.close()
    after = [_rolling_places(session, index, layer) for index, layer in enumerate(_layers(session))]
    assert all(torch.equal(a, b) for x, y in zip(before, after, strict=True) for a, b in zip(x, y, strict=True))


def test_places_during_decoding_count_the_answer_after_the_prompt(monkeypatch):
    """Compression while decoding after a one-shot prefill: the answer's tokens stand after the prompt's. A scorer
    that does not read places gets none, and none are followed for it."""
    model = _model("llama")
    ids = _ids(30, seed=2)
    weights = _options("surrogate", model)["weights"]
    read = _places_read(monkeypatch)
    for place in ("prompt", "held"):
        read.clear()
        session = ContextSession(model, "surrogate", cap=10, compress_every=4, weights=weights, place=place)
        session.prefill(ids)
        session.ask(_ids(3, seed=4), max_new_tokens=10)
        assert len(read) > 2 and read[0] is None  # the prompt's own compression reads no places
        if place == "held":
            assert all(r is None for r in read) and session.compressor.places is None
            continue
        places, seen = read[-1]
        assert int(places.max()) == int(seen[0]) - 1 >= 30 + 3  # the newest entry: the last token seen
        assert bool((places[..., -4:] == torch.arange(int(seen[0]) - 4, int(seen[0]))).all())


def test_prompt_place_features_are_the_one_shot_features_where_places_are_every_position():
    valid = torch.tensor([[False, False, True, True, True], [True, True, True, True, True]])
    places = (valid.long().cumsum(-1) - 1).clamp(min=0)[:, None, :].expand(-1, 3, -1)  # (b, h_kv, t)
    got = prompt_place_features(places, valid.sum(-1))  # (b, h_kv, t, 3)
    want = place_features(valid)[:, None].expand(-1, 3, -1, -1)
    assert torch.allclose(got[:, :, 2:], want[:, :, 2:]) and torch.allclose(got[1], want[1])


def test_the_surrogate_reads_prompt_places_only_when_asked_and_says_so():
    model = _model("llama")
    weights = _options("critical-surrogate", model)["weights"]
    ids = _ids(60, seed=3)
    kept = {}
    for place in ("held", "prompt"):
        session = ContextSession(
            model, "critical-surrogate", chunk_size=12, cap=10, weights=weights, place=place, window=4
        )
        session.prefill(ids)
        kept[place] = [layer.context_keys.clone() for layer in _layers(session)]
        one_chunk = ContextSession(
            model, "critical-surrogate", chunk_size=64, cap=10, weights=weights, place=place, window=4
        )
        one_shot = ContextSession(model, "critical-surrogate", budget=10, weights=weights, place=place, window=4)
        assert torch.equal(one_chunk.prefill(ids), one_shot.prefill(ids))  # one chunk: no place is read
    assert not all(torch.equal(a, b) for a, b in zip(kept["held"], kept["prompt"], strict=True))
    assert "place=held" in repr(SurrogateScorer(place="held")) and "place" not in repr(SurrogateScorer())
    with pytest.raises(ValueError, match="place must be"):
        SurrogateScorer(place="chunk")


@pytest.mark.parametrize("chunked", [False, True])
def test_a_saved_session_keeps_its_entries_places_for_compression_while_decoding(chunked, tmp_path, monkeypatch):
    """A context compressed once (one-shot or in chunks) and saved: the loaded session knows where its kept entries
    stand in the prompt (the tracker's positions), so compressing its answers places them there; a file saved by a
    rank-placing scorer holds none, and a session loaded from it leaves them unknown (placed by rank)."""
    model = _model("llama")
    ids = _ids(40, seed=5)
    weights = _options("surrogate", model)["weights"]
    sizes = {"chunk_size": 12, "cap": 10} if chunked else {"budget": 10}
    with monkeypatch.context() as patches:  # the tracker follows this prefill only
        tracker = Tracker(model, patches)
        try:
            session = ContextSession(model, "surrogate", weights=weights, place="prompt", **sizes)
            session.prefill(ids)
            truth = [
                _true_places(layer, tracker.positions[id(layer)][..., : layer.context_seen], torch.ones_like(ids))
                for layer in _layers(session)
            ]
        finally:
            tracker.close()
    read = _places_read(monkeypatch)
    for place in ("prompt", "held"):
        saved = ContextSession(model, "surrogate", weights=weights, place=place, **sizes)
        saved.prefill(ids)
        saved.save(tmp_path / f"{place}.safetensors")
    method = session.compressor.method  # a surrogate of the tiny model's own maps: not a preset's spec
    loaded = ContextSession.load(tmp_path / "prompt.safetensors", model, method, cap=10, compress_every=4)
    for index, layer in enumerate(_layers(loaded)):
        assert all(torch.equal(a, b) for a, b in zip(_rolling_places(loaded, index, layer), truth[index], strict=True))
    read.clear()
    loaded.ask(_ids(3, seed=4), max_new_tokens=10)
    assert len(read) > 2 and all(r is not None for r in read)
    places, seen = read[-1]
    assert int(places.max()) == int(seen[0]) - 1 >= 40 + 3  # the newest entry: the last token seen
    assert torch.equal(places[..., :-12].sort(-1).values, places[..., :-12])  # the context's in prompt order
    unknown = ContextSession.load(tmp_path / "held.safetensors", model, method, cap=10, compress_every=4)
    assert not unknown.compressor.places.known
    read.clear()
    unknown.ask(_ids(3, seed=4), max_new_tokens=10)
    assert len(read) > 2 and all(r is None for r in read)


def test_stacked_sessions_follow_their_rows_places_while_answering(monkeypatch):
    """Sessions stacked for one batched answer (the server's batches) place their rows' entries in the prompt while
    the answer is compressed, as each session alone does; the sessions' own places are left as they were."""
    model = _model("llama")
    weights = _options("surrogate", model)["weights"]
    read = _places_read(monkeypatch)
    sessions = []
    for chunk_size in (None, 12):  # a one-shot context, and one in chunks (a dense first layer's places included)
        session = ContextSession(
            model, "surrogate", chunk_size=chunk_size, cap=10, compress_every=4, weights=weights, place="prompt"
        )
        session.prefill(_ids(40, seed=5))
        sessions.append(session)
    own = [dict(session.compressor.places.known) for session in sessions]
    alone = []
    for session in sessions:
        read.clear()
        session.ask(_ids(3, seed=4), max_new_tokens=6)
        alone.append(read[0])
    read.clear()
    stacked = ContextSession.stacked(sessions)
    stacked.ask(_ids(3, seed=4).expand(2, -1), max_new_tokens=6)
    assert read and all(r is not None for r in read)
    places, first, second = read[0][0], alone[0][0], alone[1][0]
    assert torch.equal(places[0], first[0]) and torch.equal(places[1], second[0])  # the rows, in order
    for session, before in zip(sessions, own, strict=True):
        assert session.compressor.places.known.keys() == before.keys()
        assert all(session.compressor.places.known[i][2] is before[i][2] for i in before)
