"""The fused AMX value-norm kernel (selectors/value_norm_amx.c) against float64 norms, and where it runs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_norm_screen import _bf16_view
from transformers import AutoModelForCausalLM

from criticalkv.core.paths import CACHE_ENV_VAR
from criticalkv.eval.needle import needle_prompt_ids
from criticalkv.runtime.session import ContextSession
from criticalkv.selectors import norm_screen, value_norm_amx
from criticalkv.selectors.critical import CriticalSelector
from criticalkv.selectors.value_norm import projected_value_norm

needs_kernel = pytest.mark.skipif(
    value_norm_amx.amx_kernel() is None, reason=f"no AMX kernel here: {value_norm_amx.why_no_amx_kernel()}"
)


def _reference(values: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query head norms in float64, (b, h_kv, t, G), and the float32 rounding's bound: about (d + hidden) units
    of float32's roundoff times ``sum_j sum_k |V_k| |W_kj|``, taken twice."""
    h_kv, d, hidden = values.shape[1], values.shape[3], weight.shape[0]
    heads = weight.double().view(hidden, h_kv, -1, d).permute(1, 2, 3, 0)  # (h_kv, G, d, hidden)
    exact = torch.einsum("bhtd,hgdj->bhtgj", values.double(), heads).abs().sum(-1)  # (b, h_kv, t, G)
    magnitude = torch.einsum("bhtd,hgdj->bhtgj", values.double().abs(), heads.abs()).sum(-1)
    return exact, 2 * (d + hidden) * 2.0**-24 * magnitude


def _random(b: int, h_kv: int, groups: int, t: int, d: int, hidden: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(b, h_kv, t, d, generator=gen).bfloat16()
    weight = (torch.randn(hidden, h_kv * groups * d, generator=gen) / d**0.5).bfloat16()
    return values, weight


@needs_kernel
@settings(max_examples=25, deadline=None)
@given(
    b=st.integers(1, 2),
    h_kv=st.integers(1, 3),
    groups=st.integers(1, 3),
    t=st.integers(1, 70),
    d=st.sampled_from(value_norm_amx.HEAD_DIMS),
    blocks=st.integers(1, 5),
    seed=st.integers(0, 2**16),
)
def test_kernel_norms_are_float32_norms(b, h_kv, groups, t, d, blocks, seed):
    """Every token (a tile of 16 or the padded tail), KV head, query head and head_dim: within float32's rounding
    of the exact norms."""
    values, weight = _random(b, h_kv, groups, t, d, 16 * blocks, seed)
    got = value_norm_amx.amx_kernel()(values, weight)
    exact, bound = _reference(values, weight)
    assert got.shape == (b, h_kv, t, groups) and got.dtype == torch.float32
    assert value_norm_amx.describe().startswith("the AMX kernel")
    assert ((got.double() - exact).abs() <= bound).all()


@needs_kernel
def test_projected_value_norm_takes_the_kernel_for_bfloat16_float32_norms(monkeypatch):
    """The float32 group mean and the per-head norms of bfloat16 values come from the kernel, strided values too;
    ``norm_dtype="model"`` (bfloat16 products) and the bracket's rounded sums keep torch's products."""
    values, weight = _random(2, 2, 3, 40, 64, 48, seed=1)
    strided = torch.stack([values, values], dim=-1)[..., 0]  # the same values, not contiguous
    calls = []
    kernel = value_norm_amx.amx_kernel()
    monkeypatch.setattr(value_norm_amx, "amx_kernel", lambda: lambda *a: calls.append(1) or kernel(*a))
    exact, bound = _reference(values, weight)
    mean = projected_value_norm(strided, weight)
    per_head = projected_value_norm(values, weight, per_head=True)
    assert len(calls) == 2
    assert ((per_head.transpose(-1, -2).double() - exact).abs() <= bound).all()
    assert torch.equal(mean, per_head.mean(-2))
    projected_value_norm(values, weight, compute_dtype=None)
    projected_value_norm(values, weight, compute_dtype=None, rounded_sums=True)
    projected_value_norm(values.float(), weight.float())
    assert len(calls) == 2


@needs_kernel
def test_no_bracket_runs_where_the_kernel_does_and_stage_two_chooses_as_torch_float32_norms(monkeypatch):
    """With the kernel the screen has nothing to save (every float32 norm costs what the bracket's bfloat16 ones
    would); the choice is torch's float32 norms' on long heads (no near-tie in these draws)."""
    b, h_kv, t = 2, 2, 2048
    for seed in range(3):
        view = _bf16_view(b, h_kv, 3, t, 64, 192, seed)
        assert norm_screen.screen_kind(view.values, view.o_proj_weight) is None
        gen = torch.Generator().manual_seed(seed)
        scores = torch.rand(b, h_kv, t, generator=gen) ** 8
        protected = torch.zeros(b, t, dtype=torch.bool)
        protected[:, -32:] = True
        budgets = torch.full((b, h_kv), t // 5)
        got = CriticalSelector().select(scores, budgets, protected, view)
        with monkeypatch.context() as patched:
            patched.setattr(value_norm_amx, "amx_kernel", lambda: None)
            fresh = _bf16_view(b, h_kv, 3, t, 64, 192, seed)
            want = CriticalSelector(screen=False).select(scores, budgets, protected, fresh)
        assert torch.equal(got, want), seed


def test_switched_off_kernel_says_why_and_torch_computes_the_norms(monkeypatch):
    """``$CRITICALKV_AMX=0``: no kernel, the reason, and torch's products give the same float32 norms."""
    value_norm_amx.availability.cache_clear()
    try:
        monkeypatch.setenv(value_norm_amx.SWITCH_ENV_VAR, "0")
        assert value_norm_amx.amx_kernel() is None
        assert "CRITICALKV_AMX=0" in value_norm_amx.why_no_amx_kernel()
        assert value_norm_amx.describe().startswith("torch's products, no AMX kernel: $CRITICALKV_AMX=0")
        values, weight = _random(1, 1, 1, 20, 64, 32, seed=2)
        assert not value_norm_amx.handles(values, weight)
        exact, bound = _reference(values, weight)
        assert ((projected_value_norm(values, weight).double() - exact[..., 0]).abs() <= bound[..., 0]).all()
    finally:
        value_norm_amx.availability.cache_clear()


@needs_kernel
def test_a_compiler_that_fails_leaves_the_kernel_out_and_says_so(monkeypatch, tmp_path):
    """A compiler that cannot build the kernel (here one that always fails), or none, is reported with a warning on
    a CPU with AMX, not raised."""
    value_norm_amx.availability.cache_clear()
    try:
        monkeypatch.setenv("CC", "false")
        monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path))
        with pytest.warns(UserWarning, match="did not build.*torch's products"):
            assert value_norm_amx.amx_kernel() is None
        assert "did not build" in value_norm_amx.why_no_amx_kernel()
        value_norm_amx.availability.cache_clear()
        monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
        with pytest.warns(UserWarning, match="no C compiler"):
            assert value_norm_amx.amx_kernel() is None
    finally:
        value_norm_amx.availability.cache_clear()


@needs_kernel
@pytest.mark.model
def test_smollm2_keeps_what_torchs_float32_norms_keep(smollm2_folder, smollm2_tokenizer):
    """SmolLM2 in bfloat16 on a 1k needle prompt: critical-snapkv and critical-adakv at 0.1 and 0.4 keep the same
    entries in every layer with the kernel's norms as with torch's float32 products."""
    model = AutoModelForCausalLM.from_pretrained(smollm2_folder, dtype=torch.bfloat16, attn_implementation="sdpa")
    ids = torch.tensor([needle_prompt_ids(smollm2_tokenizer, 1024)])
    for spec in ("critical-snapkv", "critical-adakv"):
        for budget in ("0.1", "0.4"):
            with_kernel = ContextSession(model.eval(), spec, budget)
            with_kernel.prefill(ids)
            with pytest.MonkeyPatch.context() as patched:
                patched.setattr(value_norm_amx, "handles", lambda values, weight: False)
                reference = ContextSession(model, f"{spec}:screen=false", budget)
                reference.prefill(ids)
            for a, b in zip(with_kernel.cache.layers, reference.cache.layers, strict=True):
                assert torch.equal(a.offsets(), b.offsets()), (spec, budget)
                assert torch.equal(a.context_keys, b.context_keys), (spec, budget)
