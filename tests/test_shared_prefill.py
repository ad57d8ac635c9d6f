"""One prefill serving many (method, budget) pairs gives exactly the answers of separate runs."""

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig

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
