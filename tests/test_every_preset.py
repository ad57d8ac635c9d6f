"""Every preset of ``method_names()`` on a tiny random model of every supported family: a prefill compressed at a
budget below the context and a few greedy tokens decoded from it, and with a budget of every entry (the
compressor installed, nothing evicted: what budget 1.0 gives without installing it) the uncompressed model's
logits and tokens, bit for bit.

One test per family, each running every preset: what a preset refuses on a family is refused on purpose (a
clear ``UnsupportedModelError`` before the first forward), and the table of refusals below says why.
"""

from __future__ import annotations

import functools

import pytest
import torch
from test_runtime import EAGER_ONLY, FAMILIES
from transformers import AutoModelForCausalLM

from criticalkv import Budget, build_method, method_names
from criticalkv.allocators import HeadKVAllocator, HeadProfile
from criticalkv.errors import UnsupportedModelError
from criticalkv.logits import SINKS, logit_changes
from criticalkv.models.families import SUPPORTED_FAMILIES, full_attention_layers, head_dim, layer_types
from criticalkv.models.fingerprint import model_fingerprint
from criticalkv.runtime.session import ContextSession
from criticalkv.scorers import ReconstructionScorer, SurrogateScorer
from criticalkv.scorers.surrogate import SurrogateWeights, feature_count
from criticalkv.selectors import PerturbationSelector

VOCAB = 320  # above the tiny tokenizer's 300 ids: the reconstruction presets write their prompt with it
CONTEXT = 80  # tokens of the prompt; the default observation window (32) and the budget below both fit
NEW = 3  # greedy tokens decoded from each cache (a ContextSession's loop: cheaper than generate)
BUDGET = 0.5
PRESETS = [name for name in method_names() if name != "full"]


def test_the_table_covers_every_supported_family_and_preset() -> None:
    assert {FAMILIES[f]().model_type for f in FAMILIES} >= set(SUPPORTED_FAMILIES)
    assert "pyramidkv" in PRESETS and len(PRESETS) == len(method_names()) - 1


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models run faster on one thread than on a pool (about 1.5 CPU s a family instead of 10 on two cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@functools.cache
def _model(family: str):
    config = FAMILIES[family]()
    config.vocab_size = VOCAB
    torch.manual_seed(7)
    attn = "eager" if family in EAGER_ONLY else "sdpa"
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # always NEW tokens
    model.generation_config.pad_token_id = 0
    return model


def _options(name: str, model, tokenizer) -> dict:
    """What a preset needs that a random model lacks: a tokenizer (reconstruction), a head profile (HeadKV)."""
    method = build_method(name)
    options: dict = {}
    if isinstance(method.scorer, ReconstructionScorer):
        options.update(tokenizer=tokenizer, chunk_size=CONTEXT)  # one reconstruction chunk: fast
    if isinstance(method.scorer, SurrogateScorer):
        options["weights"] = _random_surrogate(model)
    if isinstance(method.allocator, HeadKVAllocator):
        importance = torch.rand(model.config.num_hidden_layers, model.config.num_key_value_heads) + 0.1
        options["profile"] = HeadProfile.from_config(model.config, importance, name="tiny")
    return options


def _random_surrogate(model) -> SurrogateWeights:
    """Random linear maps for a random model, which no shipped surrogate fits: the presets' plumbing is tested here,
    the fit in test_surrogate.py."""
    layers = tuple(full_attention_layers(model.config))
    shape = (len(layers), model.config.num_key_value_heads, 2)  # maps at two lengths
    weight = 0.1 * torch.randn(
        *shape, feature_count(head_dim(model.config)), generator=torch.Generator().manual_seed(5)
    )
    return SurrogateWeights(weight, torch.zeros(shape), layers, model_fingerprint(model), (16, 64))


def _refusal(name: str, model) -> str | None:
    """Why a preset refuses a family, or None when it runs: the reconstruction scorer re-runs the model on the
    cache and cannot rewind a sliding-window layer, nor recompute soft-capped logits or attention sinks; the measured
    selectors renormalise the window's attention without the sinks' share."""
    method = build_method(name)
    if isinstance(method.selector, PerturbationSelector) and SINKS in logit_changes(model.config):
        return "do not apply attention sinks"
    if not isinstance(method.scorer, ReconstructionScorer):
        return None
    if any(kind != "full_attention" for kind in layer_types(model.config)[0]):
        return "sliding-window layers"
    if logit_changes(model.config):
        return "soft-capped logits|attention sinks"
    return None


def _answer(model, method, budget: Budget, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list]:
    """The context's last logits (1, vocab), NEW greedy tokens (1, NEW) decoded from its (compressed) cache, and
    what the compressor recorded of each layer (empty when nothing was installed)."""
    session = ContextSession(model, method, budget)
    logits = session.prefill(ids)
    tokens = session.ask(None, NEW).tokens
    return logits, tokens, [] if session.compressor is None else session.compressor.records


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_preset_prefills_and_decodes(family: str, tiny_tokenizer) -> None:
    model = _model(family)
    ids = torch.randint(3, 300, (1, CONTEXT), generator=torch.Generator().manual_seed(11))
    plain_logits, plain_tokens, _ = _answer(model, "full", Budget.parse(1.0), ids)
    for name in PRESETS:
        method = build_method(name, **_options(name, model, tokenizer=tiny_tokenizer))
        reason = _refusal(name, model)
        if reason is not None:
            with pytest.raises(UnsupportedModelError, match=reason):
                ContextSession(model, method, Budget.parse(BUDGET))
            continue
        logits, tokens, records = _answer(model, method, Budget.parse(BUDGET), ids)
        assert tokens.shape == (1, NEW) and bool(logits.isfinite().all()), name
        kept = sum(int(r.kept.sum()) for r in records)
        held = sum(int(r.before.sum()) * r.kept.shape[1] for r in records)
        assert records and 0 < kept < held, (name, kept, held)  # compressed, not emptied
        # a budget of every entry: the compressor installed (unlike 1.0, which installs nothing), nothing evicted
        logits, tokens, records = _answer(model, method, Budget.parse(CONTEXT), ids)
        assert records and all(bool(r.kept_whole.all()) for r in records), name
        assert torch.equal(tokens, plain_tokens) and torch.equal(logits, plain_logits), name
