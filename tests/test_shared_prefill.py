"""One prefill serving many (method, budget) pairs gives exactly the answers of separate runs."""

import gc
import weakref

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig
from transformers.cache_utils import DummyLayer

from criticalkv.cache import CompressedCache
from criticalkv.errors import CacheStateError
from criticalkv.runtime.session import ContextSession
from criticalkv.runtime.shared_prefill import SharedPrefill

PAIRS = [
    ("full", "full", 1.0),
    ("snapkv-0.3", "snapkv", 0.3),
    ("critical-snapkv-0.3", "critical-snapkv", 0.3),
    ("critical-snapkv-0.5", "critical-snapkv", 0.5),
    ("streaming-0.3", "streaming", 0.3),
    ("tova-0.3", "tova", 0.3),
]


def _model(kind: str):
    torch.manual_seed(0)
    common = dict(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=1024,
        head_dim=16,
    )
    if kind == "gemma3":
        config = Gemma3TextConfig(
            num_hidden_layers=2, sliding_window=16, layer_types=["sliding_attention", "full_attention"], **common
        )
    else:
        config = LlamaConfig(num_hidden_layers=2, **common)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_shared_prefill_equals_separate_runs(kind):
    model = _model(kind)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (2, 120), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :30] = 0  # left padding
    question = torch.randint(0, 256, (2, 5), generator=g)
    sessions = SharedPrefill(model, PAIRS).prefill(ids, mask)
    for label, method, budget in PAIRS:
        alone = ContextSession(model, method, budget)
        alone.prefill(ids, mask)
        for _ in range(2):  # asking twice: each answer is trimmed off again
            expected = alone.ask(question, max_new_tokens=6)
            got = sessions[label].ask(question, max_new_tokens=6)
            assert torch.equal(got.tokens, expected.tokens), label
        assert sessions[label].kv_entries() == alone.kv_entries(), label


def test_a_kept_session_holds_its_own_cache_alone():
    """Keeping one pair's session (to ask it more questions) does not keep the other pairs' caches alive."""
    model = _model("llama")
    ids = torch.randint(0, 256, (1, 120), generator=torch.Generator().manual_seed(2))
    sessions = SharedPrefill(model, PAIRS[:3]).prefill(ids)
    others = [weakref.ref(sessions[label].cache) for label, _, _ in PAIRS[:2]]  # the full cache among them
    kept = sessions[PAIRS[2][0]]
    del sessions
    gc.collect()
    assert [ref() for ref in others] == [None, None]
    alone = ContextSession(model, PAIRS[2][1], PAIRS[2][2])
    alone.prefill(ids)
    assert torch.equal(kept.ask(None, max_new_tokens=6).tokens, alone.ask(None, max_new_tokens=6).tokens)


STACKED_PAIRS = [*PAIRS, ("adakv-0.3", "adakv", 0.3), ("critical-adakv-0.2", "critical-adakv", 0.2)]


@pytest.mark.parametrize("ask_question", [True, False])
def test_stacked_sessions_answer_as_each_alone(ask_question):
    """The pairs of one prompt answering as the rows of one batch (the full cache's dense layers among them, AdaKV's
    uneven segments too) give each pair's own answer, and asking again gives it again."""
    model = _model("llama")
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 256, (1, 120), generator=g)
    question = torch.randint(0, 256, (1, 5), generator=g) if ask_question else None
    sessions = SharedPrefill(model, STACKED_PAIRS).prefill(ids)
    expected = [sessions[label].ask(question, max_new_tokens=8).tokens for label, _, _ in STACKED_PAIRS]
    stacked = ContextSession.stacked([sessions[label] for label, _, _ in STACKED_PAIRS])
    assert stacked.kv_entries() == sum(sessions[label].kv_entries() for label, _, _ in STACKED_PAIRS)
    rows = None if question is None else question.expand(len(STACKED_PAIRS), -1)
    for _ in range(2):
        got = stacked.ask(rows, max_new_tokens=8).tokens
        assert torch.equal(got, torch.cat(expected)), [label for label, _, _ in STACKED_PAIRS]


def test_stacked_sessions_of_different_prompts_of_one_length_answer_as_each_alone():
    """Each row decodes from its own cache at the same positions: two prompts of one length stack as well."""
    model = _model("llama")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (1, 90), generator=g) for _ in range(2)]
    question = torch.randint(0, 256, (1, 5), generator=g)
    sessions = [SharedPrefill(model, PAIRS[1:2]).prefill(ids)[PAIRS[1][0]] for ids in prompts]
    expected = torch.cat([session.ask(question, max_new_tokens=8).tokens for session in sessions])
    assert not torch.equal(expected[0], expected[1])  # the prompts lead to different answers
    stacked = ContextSession.stacked(sessions)
    assert torch.equal(stacked.ask(question.expand(2, -1), max_new_tokens=8).tokens, expected)


def test_stacking_refuses_what_does_not_stack():
    g = torch.Generator().manual_seed(3)
    model = _model("llama")
    short = SharedPrefill(model, PAIRS[:2]).prefill(torch.randint(0, 256, (1, 60), generator=g))
    long = SharedPrefill(model, PAIRS[:2]).prefill(torch.randint(0, 256, (1, 80), generator=g))
    with pytest.raises(ValueError, match="unpadded prompts of one length"):
        ContextSession.stacked([short["snapkv-0.3"], long["snapkv-0.3"]])
    with pytest.raises(CacheStateError, match="nothing to stack"):
        ContextSession.stacked([])
    gemma = SharedPrefill(_model("gemma3"), PAIRS[:2]).prefill(torch.randint(0, 256, (1, 60), generator=g))
    assert not gemma["snapkv-0.3"].cache.stackable()
    with pytest.raises(CacheStateError, match="cannot be stacked"):
        ContextSession.stacked([gemma["full"], gemma["snapkv-0.3"]])


def test_stacking_keeps_another_stages_layers_empty():
    """On a pipeline stage the layers other stages run are ``DummyLayer``s: they stack to one, the others stack
    row by row; a layer that is a placeholder in one cache only does not stack."""
    model = _model("llama")
    ids = torch.randint(0, 256, (1, 60), generator=torch.Generator().manual_seed(4))
    sessions = SharedPrefill(model, PAIRS[:3]).prefill(ids)
    caches = [sessions[label].cache for label, _, _ in PAIRS[1:3]]
    for cache in caches:
        cache.layers[0] = DummyLayer()
    assert all(cache.stackable() for cache in caches)
    stacked = CompressedCache.stack(caches)
    assert isinstance(stacked.layers[0], DummyLayer)
    assert torch.equal(stacked.layers[1].lengths, torch.cat([cache.layers[1].lengths for cache in caches]))
    with pytest.raises(CacheStateError, match="layer 0 is not a compressed layer in every cache"):
        CompressedCache.stack([caches[0], sessions["full"].cache])


def test_every_target_is_checked_before_the_prefill_and_the_full_cache_alone_runs():
    """A target the model cannot take (reconstruction beside Gemma 3's sliding-window layers) is refused when the
    SharedPrefill is built, not after its prefill, wherever it stands; the full cache alone needs no method."""
    from criticalkv.errors import UnsupportedModelError

    gemma = _model("gemma3")
    with pytest.raises(UnsupportedModelError, match="sliding-window"):
        SharedPrefill(gemma, [("a", "snapkv", 0.5), ("r", "critical-reconstruct", 0.5)])
    llama = _model("llama")
    ids = torch.randint(3, 100, (1, 40), generator=torch.Generator().manual_seed(3))
    sessions = SharedPrefill(llama, [("full", "full", 1.0)]).prefill(ids)
    assert sessions["full"].ask(None, max_new_tokens=2).tokens.shape == (1, 2)
