"""One full-cache run of a model, recording what the output-perturbation analysis needs of every layer.

The recording is done by an attention function registered under its own name in transformers'
``AttentionInterface`` (with the base implementation's mask function in ``AttentionMaskInterface``): it stores its
inputs and delegates to the base implementation (``sdpa`` or ``eager``), so the run is the model's own run. The
model is switched to it with ``set_attn_implementation`` and switched back afterwards; nothing of transformers is
patched.

What is recorded, per attention layer, in the model's dtype:

* the context prefill, exactly as criticalkv's compressor sees it: query states after the model's QK-norm and RoPE,
  keys, values, the valid mask and the softmax scale (``LayerCapture.view()`` is the ``LayerView`` a method
  decides on);
* the query, key and value states of the tokens that follow the context, fed with the full cache at their true
  positions: the question's tokens (when given) and then the full model's own greedy continuation, labelled
  ``"question"`` and ``"generated"``.

The forwards are made the way ``SharedPrefill`` and ``ContextSession`` make them (explicit all-ones attention mask
and positions; the question in one forward, then one forward per generated token), so a compressed run over the
same tokens differs from this one only by the compression.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import AttentionInterface, DynamicCache, PretrainedConfig, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface

from criticalkv.cache.attention import MASKS, base_attention
from criticalkv.core.positions import forward_on_cache
from criticalkv.core.view import LayerView
from criticalkv.errors import CacheStateError, CriticalKVError, UnsupportedModelError
from criticalkv.logits import logit_changes
from criticalkv.models.families import attention_modules
from criticalkv.runtime.prefill_view import prefill_view
from criticalkv.selectors.value_norm import check_output_projections

__all__ = ["Capture", "LayerCapture", "attention_modules", "capture"]

_ATTR = "_criticalkv_capture"  # set on each attention module while a capture runs


def capture_name(base: str) -> str:
    """Registry name of the recording attention function over a base implementation."""
    return f"criticalkv_capture_{base}"


@dataclass
class LayerCapture:
    """One attention layer of a captured run (tensors in the model's dtype)."""

    module: nn.Module  # the attention module (o_proj, layer_idx)
    query: torch.Tensor  # (b, h_q, t, d) context prefill queries, after QK-norm and RoPE
    keys: torch.Tensor  # (b, h_kv, t, d)
    values: torch.Tensor  # (b, h_kv, t, d)
    valid: torch.Tensor  # (b, t) bool
    scaling: float
    follow_query: torch.Tensor  # (b, h_q, f, d) queries of the following tokens
    follow_keys: torch.Tensor  # (b, h_kv, f, d)
    follow_values: torch.Tensor  # (b, h_kv, f, d)
    sliding: bool = False  # a sliding-window layer: never compressed, left out of the analysis

    @property
    def layer(self) -> int:
        return int(self.module.layer_idx)

    def view(self) -> LayerView:
        """The ``LayerView`` criticalkv's compressor builds for this layer's prefill."""
        return LayerView(self.module, self.query, self.keys, self.values, self.valid, self.scaling)


@dataclass
class Capture:
    """A full-cache run over a context and the tokens that follow it."""

    context_ids: torch.Tensor  # (b, t)
    follow_ids: torch.Tensor  # (b, f): question tokens, then the full model's greedy tokens
    labels: list[str]  # f labels: "question" or "generated"
    chunks: list[int]  # sizes of the successive forwards that fed the following tokens
    layers: list[LayerCapture]
    hidden: torch.Tensor  # (b, f, hidden) last entry of hidden_states (after the final norm) per following token
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def analysed(self) -> list[LayerCapture]:
        """The layers a method compresses (full-attention layers)."""
        return [layer for layer in self.layers if not layer.sliding]

    def label_mask(self, label: str) -> torch.Tensor:
        """(f,) bool: following tokens of a label; ``"all"`` selects every one."""
        if label == "all":
            return torch.ones(len(self.labels), dtype=torch.bool)
        return torch.tensor([x == label for x in self.labels], dtype=torch.bool)


class _Recorder:
    def __init__(self, base: str) -> None:
        self.base = base
        self.prefill: dict[int, tuple] = {}
        self.follow: dict[int, list[tuple]] = {}
        self.phase = "prefill"

    def record(self, module, query, key, value, attention_mask, scaling) -> None:
        layer = module.layer_idx
        q = query.shape[2]
        if self.phase == "prefill":  # the compressor's own view of this prefill (same valid-mask rule)
            view = prefill_view(module, query.detach(), key.detach(), value.detach(), attention_mask, float(scaling))
            self.prefill[layer] = (view.query, view.keys, view.values, view.valid.clone(), view.scaling)
        else:  # the cache returns everything so far; the new tokens are its last q entries
            self.follow.setdefault(layer, []).append(
                (query.detach(), key[:, :, -q:].detach().clone(), value[:, :, -q:].detach().clone())
            )


def capture_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Record the inputs, then run the base attention implementation unchanged."""
    recorder = module.__dict__.get(_ATTR)
    if recorder is None:
        raise CriticalKVError("the capture attention runs only inside criticalkv.analysis.capture(...)")
    scaling = module.scaling if scaling is None else scaling
    recorder.record(module, query, key, value, attention_mask, scaling)
    base = base_attention(module, recorder.base)
    return base(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


def register() -> None:
    """Register the recording attention over each base implementation (idempotent)."""
    for base, mask in MASKS.items():
        AttentionInterface.register(capture_name(base), capture_attention)
        AttentionMaskInterface.register(capture_name(base), mask)


def _forward(model, ids, mask, cache, hidden: bool):
    return forward_on_cache(model, ids, mask, cache, output_hidden_states=hidden)


def check_capturable(config: PretrainedConfig) -> None:
    """Refuse a family whose attention logits the perturbation measure does not reproduce: Gemma 2's soft cap
    (when its config sets one), gpt-oss's sinks. Reads the config alone: a command checks it before loading."""
    if logit_changes(config):
        raise UnsupportedModelError(
            "the perturbation analysis does not apply soft-capped logits (Gemma 2) or attention sinks (gpt-oss) yet"
        )


@torch.no_grad()
def capture(
    model: PreTrainedModel,
    context_ids: torch.Tensor,
    question_ids: torch.Tensor | None = None,
    generate: int = 16,
    eos_token_id: int | list[int] | None = None,
) -> Capture:
    """Run ``context_ids`` (b, t) with the full cache, then the question (b, q) and ``generate`` greedy tokens.

    Parameters
    ----------
    model
        A causal LM loaded with ``sdpa`` or ``eager`` attention (not inside ``criticalkv.compress``).
    context_ids
        (b, t) token ids of the context; rows of one batch must have the same length (no padding).
    question_ids
        (b, q) token ids that follow the context, or None (question-aware use: the question is in the context).
    generate
        Number of greedy tokens of the full model whose queries are recorded too. Generation stops before an
        end-of-sequence token (a real decode never feeds it back).
    eos_token_id
        End-of-sequence id(s).

    Returns
    -------
    Capture
    """
    base = model.config._attn_implementation
    if base not in MASKS:
        raise UnsupportedModelError(f"capture needs a model with sdpa or eager attention, not {base!r}")
    if context_ids.dim() != 2:
        raise CriticalKVError(f"context_ids must be (batch, tokens), got shape {tuple(context_ids.shape)}")
    check_capturable(model.config)
    check_output_projections(model, "the perturbation analysis")
    modules = attention_modules(model)
    if any(_ATTR in m.__dict__ for m in modules):
        raise CacheStateError("a capture is already running on this model")
    eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or [])
    register()
    recorder = _Recorder(base)
    for module in modules:
        module.__dict__[_ATTR] = recorder
    model.set_attn_implementation(capture_name(base))
    b = context_ids.shape[0]
    device = context_ids.device
    cache = DynamicCache(config=model.config)
    labels: list[str] = []
    chunks: list[int] = []
    hidden: list[torch.Tensor] = []
    pieces: list[torch.Tensor] = []
    seconds: dict[str, float] = {}
    try:
        start = time.perf_counter()
        mask = torch.ones_like(context_ids)
        out = _forward(model, context_ids, mask, cache, hidden=False)
        seconds["prefill"] = time.perf_counter() - start
        recorder.phase = "follow"
        logits = out.logits[:, -1]
        start = time.perf_counter()
        if question_ids is not None and question_ids.shape[1] > 0:
            mask = torch.cat([mask, torch.ones_like(question_ids)], dim=1)
            out = _forward(model, question_ids, mask, cache, hidden=True)
            hidden.append(out.hidden_states[-1])
            pieces.append(question_ids)
            labels += ["question"] * question_ids.shape[1]
            chunks.append(question_ids.shape[1])
            logits = out.logits[:, -1]
        for _ in range(generate):
            token = logits.argmax(-1, keepdim=True)  # (b, 1)
            if eos and bool(torch.isin(token, torch.tensor(eos, device=device)).all()):
                break
            mask = torch.cat([mask, torch.ones_like(token)], dim=1)
            out = _forward(model, token, mask, cache, hidden=True)
            hidden.append(out.hidden_states[-1])
            pieces.append(token)
            labels.append("generated")
            chunks.append(1)
            logits = out.logits[:, -1]
        seconds["follow"] = time.perf_counter() - start
    finally:
        model.set_attn_implementation(base)
        for module in modules:
            module.__dict__.pop(_ATTR, None)
    sliding = {i for i, layer in enumerate(cache.layers) if getattr(layer, "is_sliding", False)}
    layers = []
    for module in modules:
        idx = module.layer_idx
        query, keys, values, valid, scaling = recorder.prefill[idx]
        follow = recorder.follow.get(idx, [])
        h_q, h_kv, d = query.shape[1], keys.shape[1], keys.shape[-1]
        empty_q, empty_kv = query.new_empty(b, h_q, 0, d), keys.new_empty(b, h_kv, 0, d)
        layers.append(
            LayerCapture(
                module,
                query,
                keys,
                values,
                valid,
                scaling,
                torch.cat([f[0] for f in follow], dim=2) if follow else empty_q,
                torch.cat([f[1] for f in follow], dim=2) if follow else empty_kv,
                torch.cat([f[2] for f in follow], dim=2) if follow else empty_kv,
                sliding=idx in sliding,
            )
        )
    follow_ids = torch.cat(pieces, dim=1) if pieces else context_ids.new_empty(b, 0)
    width = model.config.get_text_config().hidden_size
    hidden_states = torch.cat(hidden, dim=1) if hidden else torch.empty(b, 0, width)
    return Capture(context_ids, follow_ids, labels, chunks, layers, hidden_states, seconds)
