"""Soft-capped logits and attention sinks (criticalkv.logits), and the check that a model passes its attention nothing
else of the kind."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import Gemma2Config, Gemma3TextConfig, GptOssConfig, LlamaConfig
from transformers.models.gemma2.modeling_gemma2 import Gemma2Attention
from transformers.models.gemma3.modeling_gemma3 import Gemma3Attention
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention
from transformers.models.llama.modeling_llama import LlamaAttention

from criticalkv.cache.attention import check_logit_inputs
from criticalkv.errors import CriticalKVError
from criticalkv.logits import attention_sinks, logit_softcap, soft_cap_, softmax_with_sinks_

SHAPE = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8)


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 4),
    n=st.integers(1, 9),
    masked=st.integers(0, 9),
    sink=st.floats(-30, 30),
    seed=st.integers(0, 2**16),
)
def test_softmax_with_sinks_is_a_softmax_with_one_more_column_dropped(rows, n, masked, sink, seed):
    logits = torch.randn(rows, n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 10
    logits[:, : min(masked, n)] = float("-inf")  # masked entries; a row may be masked whole
    sinks = torch.full((rows, 1), sink, dtype=torch.float64)
    full = torch.cat([logits, sinks], dim=-1).softmax(-1)  # (rows, n + 1)
    got = softmax_with_sinks_(logits.clone(), sinks)
    torch.testing.assert_close(got, full[:, :-1], rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(1 - got.sum(-1), full[:, -1], rtol=1e-9, atol=1e-12)  # the sink takes its share


def test_soft_cap_in_place_and_none():
    logits = torch.tensor([-100.0, -1.0, 0.0, 2.0, 100.0])
    assert torch.equal(soft_cap_(logits.clone(), None), logits)
    torch.testing.assert_close(soft_cap_(logits.clone(), 5.0), 5.0 * torch.tanh(logits / 5.0))


def test_the_families_that_pass_them_and_those_that_do_not():
    gemma2 = Gemma2Attention(Gemma2Config(**SHAPE, attn_logit_softcapping=50.0), layer_idx=0)
    gemma3 = Gemma3Attention(Gemma3TextConfig(**SHAPE, attn_logit_softcapping=50.0), layer_idx=0)
    gpt_oss = GptOssAttention(GptOssConfig(**SHAPE), layer_idx=0)
    llama = LlamaAttention(LlamaConfig(**SHAPE), layer_idx=0)
    assert logit_softcap(gemma2) == 50.0 and attention_sinks(gemma2) is None
    assert logit_softcap(gemma3) is None  # Gemma 3 holds the attribute and never passes it to its attention
    assert logit_softcap(gpt_oss) is None and attention_sinks(gpt_oss) is gpt_oss.sinks
    assert logit_softcap(llama) is None and attention_sinks(llama) is None


def test_a_soft_cap_or_sinks_criticalkv_would_not_apply_are_refused():
    gemma2 = Gemma2Attention(Gemma2Config(**SHAPE, attn_logit_softcapping=50.0), layer_idx=0)
    gpt_oss = GptOssAttention(GptOssConfig(**SHAPE), layer_idx=0)
    llama = LlamaAttention(LlamaConfig(**SHAPE), layer_idx=0)
    check_logit_inputs(gemma2, {"softcap": 50.0, "sliding_window": None})
    check_logit_inputs(gpt_oss, {"s_aux": gpt_oss.sinks})
    check_logit_inputs(llama, {"sliding_window": None})
    for module, kwargs in [(llama, {"softcap": 30.0}), (llama, {"sinks": torch.zeros(4)}), (gemma2, {})]:
        with pytest.raises(CriticalKVError, match="soft cap or attention sinks"):
            check_logit_inputs(module, kwargs)
