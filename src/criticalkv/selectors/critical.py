"""CriticalKV's perturbation-constrained selection (Feng et al., ICML 2026), method.md section 2."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from criticalkv.errors import NegativeScoreError
from criticalkv.scorers.base import LayerView
from criticalkv.selectors.base import keep_protected, take_top
from criticalkv.selectors.value_norm import projected_value_norm


@dataclass
class CriticalSelector:
    """Two stages: ``floor(alpha * b)`` entries by attention, the rest by ``(A + eps) * ||V W_O||_1``.

    Stage 1 secures a large kept attention mass, the condition under which the paper's bound on the output
    perturbation holds; stage 2 re-scores the remaining entries by their projected value norm. Protected
    entries (e.g. SnapKV's window) count in stage 1 first, as they do in kvpress, where they carry the
    highest score.

    Parameters
    ----------
    alpha
        Share of the budget chosen by attention alone (0.5 in the paper and kvpress).
    eps
        Added to the scores before the product so a zero-attention entry with a large value can still win
        (1e-4 in the paper and kvpress).
    norm_dtype
        ``"float32"`` computes V W_O in float32 (method.md); ``"model"`` in the values' dtype with a float32
        sum, as kvpress does (bfloat16 products; about twice as fast on CPUs with AMX).
    """

    alpha: float = 0.5
    eps: float = 1e-4
    norm_dtype: str = "float32"

    def __post_init__(self) -> None:
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {self.alpha}")
        if self.eps < 0 or not math.isfinite(self.eps):
            raise ValueError(f"eps must be finite and >= 0, got {self.eps}")
        if self.norm_dtype not in ("float32", "model"):
            raise ValueError(f"norm_dtype must be 'float32' or 'model', got {self.norm_dtype!r}")

    def select(
        self, scores: torch.Tensor, budgets: torch.Tensor, protected: torch.Tensor, view: LayerView
    ) -> torch.Tensor:
        candidates = view.valid[:, None, :] & ~protected[:, None, :]
        if bool((scores.masked_fill(~candidates, 0.0) < 0).any()):
            raise NegativeScoreError(
                "the CriticalKV selector multiplies scores by value norms, so scores must be >= 0; "
                "this scorer produced negative scores (e.g. a negated key norm): shift them to be non-negative "
                "or use the top-k selector"
            )
        keep = keep_protected(protected, budgets)
        stage1 = torch.floor(budgets.double() * self.alpha + 1e-9).long()  # (b, h_kv)
        keep = take_top(scores, keep, view.valid, stage1 - keep.sum(-1))
        dtype = torch.float32 if self.norm_dtype == "float32" else None
        norms = view.remember(
            ("value_norm", dtype), lambda: projected_value_norm(view.values, view.o_proj_weight, dtype)
        )  # (b, h_kv, t)
        return take_top((scores + self.eps) * norms, keep, view.valid, budgets - keep.sum(-1))
