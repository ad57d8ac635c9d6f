"""What some families do to attention logits beyond the scaled dot product, applied wherever criticalkv computes
attention itself (scorers' windows, attention over compressed layers).

* Gemma 2 soft-caps every logit before the mask: ``cap * tanh(logit / cap)`` (``attn_logit_softcapping``).
* gpt-oss adds a learned logit per query head to every softmax's denominator, a "sink" with no value
  (``module.sinks``): the weights of the real entries sum to less than one.

Both are read from the attention module of the families whose attention functions receive them, as transformers'
eager functions of these families read them (``criticalkv.cache.attention`` checks, call by call, that a model
passes its attention function nothing else of the kind).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

#: model types whose attention modules pass ``softcap=module.attn_logit_softcapping`` to their attention function
SOFT_CAPPED = frozenset({"gemma2"})
#: model types whose attention modules pass ``s_aux=module.sinks`` (one learned logit per query head)
WITH_SINKS = frozenset({"gpt_oss"})


def _model_type(module: nn.Module) -> str | None:
    return getattr(getattr(module, "config", None), "model_type", None)


def logit_softcap(module: nn.Module) -> float | None:
    """The soft cap of the module's attention logits (Gemma 2), None for none. Gemma 3's modules also hold an
    ``attn_logit_softcapping`` attribute but never pass it to their attention: read for ``SOFT_CAPPED`` only."""
    cap = getattr(module, "attn_logit_softcapping", None) if _model_type(module) in SOFT_CAPPED else None
    return None if cap is None else float(cap)


def attention_sinks(module: nn.Module) -> torch.Tensor | None:
    """The module's learned sink logit of each query head (gpt-oss), (h_q,); None for none."""
    return module.sinks if _model_type(module) in WITH_SINKS else None


SOFT_CAP, SINKS = "soft-capped logits", "attention sinks"


def logit_changes(config: PretrainedConfig) -> list[str]:
    """What a checkpoint's attention does to its logits beyond the scaled dot product, read from its config alone
    (before any weight is loaded): ``SOFT_CAP`` (Gemma 2, when its config sets a cap), ``SINKS`` (gpt-oss); empty
    for a plain softmax."""
    text = config.get_text_config(decoder=True)
    capped = text.model_type in SOFT_CAPPED and getattr(text, "attn_logit_softcapping", None) is not None
    return [SOFT_CAP] * capped + [SINKS] * (text.model_type in WITH_SINKS)


def soft_cap_(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap * tanh(logits / cap)`` in place (nothing for None); before any mask, as the model applies it."""
    if cap is not None:
        logits.div_(cap).tanh_().mul_(cap)
    return logits


def softmax_with_sinks_(logits: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Softmax over the last axis of ``logits`` with one more logit per row, ``sinks`` (broadcast to
    ``logits.shape[:-1] + (1,)``), that takes its share of the denominator and is dropped; in place. A row whose
    logits are all -inf gets zeros (the sink takes everything)."""
    sinks = sinks.to(logits.dtype)
    top = torch.maximum(logits.amax(dim=-1, keepdim=True), sinks)  # finite: the sink is
    logits.sub_(top).exp_()
    return logits.div_(logits.sum(dim=-1, keepdim=True) + (sinks - top).exp())
