"""What some families do to attention logits beyond the scaled dot product, applied wherever criticalkv computes
attention itself (scorers' windows, attention over compressed layers).

* Gemma 2 soft-caps every logit before the mask: ``cap * tanh(logit / cap)`` (``attn_logit_softcapping``).
* gpt-oss adds a learned logit per query head to every softmax's denominator, a "sink" with no value
  (``module.sinks``): the weights of the real entries sum to less than one.

Both are read from the attention module, as transformers' eager functions of these families read them.
"""

from __future__ import annotations

import torch
from torch import nn


def logit_softcap(module: nn.Module) -> float | None:
    """The soft cap of the module's attention logits (Gemma 2), None for none."""
    cap = getattr(module, "attn_logit_softcapping", None)
    return None if cap is None else float(cap)


def attention_sinks(module: nn.Module) -> torch.Tensor | None:
    """The module's learned sink logit of each query head (gpt-oss), (h_q,); None for none."""
    sinks = getattr(module, "sinks", None)
    return sinks if isinstance(sinks, torch.Tensor) else None


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
