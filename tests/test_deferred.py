"""The deferred path (every layer decided after the whole prefill) decides exactly what the per-layer path does,
through ``compress``, ``ContextSession`` and ``SharedPrefill``, and keeps layers dense until the end."""

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import criticalkv
from criticalkv import Method
from criticalkv.allocators import UniformAllocator
from criticalkv.cache import CompressedLayer
from criticalkv.methods import build_method
from criticalkv.runtime.session import ContextSession
from criticalkv.runtime.shared_prefill import SharedPrefill
from criticalkv.scorers import SnapKVScorer
from criticalkv.selectors import CriticalSelector


def _model():
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=1024,
        head_dim=16,
        num_hidden_layers=3,
    )
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def _deferred(name: str):
    method = build_method(name)
    return dataclasses.replace(method, defer=True)


@pytest.mark.parametrize("name", ["critical-snapkv", "adakv", "streaming"])
def test_deferred_generate_equals_per_layer(name):
    model = _model()
    ids = torch.randint(0, 256, (2, 90), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, :20] = 0  # left padding
    runs = []
    for method in (build_method(name), _deferred(name)):
        with criticalkv.compress(model, method, 0.3) as compressor:
            compressor.record_keep = True
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        runs.append((out, [(r.layer, r.kept, r.keep) for r in compressor.records]))
    (plain, plain_records), (deferred, deferred_records) = runs
    assert torch.equal(plain, deferred)
    assert len(plain_records) == len(deferred_records) == 3
    for (layer_a, kept_a, keep_a), (layer_b, kept_b, keep_b) in zip(plain_records, deferred_records, strict=True):
        assert layer_a == layer_b
        assert torch.equal(kept_a, kept_b)
        assert torch.equal(keep_a, keep_b)


def test_deferred_selector_reads_its_window_from_the_kept_query_rows():
    """A deferred layer keeps only its last ``query_rows`` query rows (the method's window); the selector must find
    its window's queries there (it read the rows by the key length and failed)."""
    model = _model()
    ids = torch.randint(0, 256, (2, 90), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :25] = 0  # left padding
    keeps = []
    for defer in (False, True):
        method = Method(SnapKVScorer(window=16), UniformAllocator(), CriticalSelector(stage2="unpooled", window=16))
        with criticalkv.compress(model, dataclasses.replace(method, defer=defer), 0.3) as compressor:
            compressor.record_keep = True
            with torch.no_grad():
                model(input_ids=ids, attention_mask=mask, use_cache=True)
        keeps.append([r.keep for r in compressor.records])
    assert len(keeps[0]) == len(keeps[1]) == 3
    for plain, deferred in zip(*keeps, strict=True):
        assert torch.equal(plain, deferred)


def test_deferred_layers_stay_dense_until_the_forward_ends():
    model = _model()
    ids = torch.randint(0, 256, (1, 80), generator=torch.Generator().manual_seed(4))
    seen = []

    def observe(module, args, kwargs, output):  # runs after the layer's attention, before the model's forward ends
        layer = kwargs["cache"].layers[module.layer_idx]
        seen.append((layer.pending, layer.is_compressed))

    hooks = [layer.self_attn.register_forward_hook(observe, with_kwargs=True) for layer in model.model.layers]
    session = ContextSession(model, _deferred("critical-snapkv"), 0.25)
    session.prefill(ids)
    for hook in hooks:
        hook.remove()
    assert seen == [(True, False)] * 3
    layers = [layer for layer in session.cache.layers if isinstance(layer, CompressedLayer)]
    assert all(layer.is_compressed and not layer.pending for layer in layers)
    assert session.kv_entries() == 3 * 2 * int(0.25 * 80)


def test_shared_prefill_runs_deferred_targets():
    model = _model()
    ids = torch.randint(0, 256, (2, 100), generator=torch.Generator().manual_seed(5))
    question = torch.randint(0, 256, (2, 4), generator=torch.Generator().manual_seed(6))
    pairs = [("plain", "critical-adakv", 0.3), ("deferred", _deferred("critical-adakv"), 0.3), ("full", "full", 1.0)]
    sessions = SharedPrefill(model, pairs).prefill(ids)
    plain = sessions["plain"].ask(question, max_new_tokens=5)
    deferred = sessions["deferred"].ask(question, max_new_tokens=5)
    assert torch.equal(plain.tokens, deferred.tokens)
    assert sessions["plain"].kv_entries() == sessions["deferred"].kv_entries()
    assert sessions["full"].kv_entries() == 3 * 2 * 2 * 100
