"""CriticalKV's perturbation-constrained selection (Feng et al., ICML 2026); docs/method.md."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from criticalkv.core.view import LayerView
from criticalkv.scorers.snapkv import AGGREGATES, window_head_scores
from criticalkv.selectors.base import Selector, add_top, keep_protected, largest, open_places, take_top
from criticalkv.selectors.norm_screen import BRACKETS, first_round, screen_kind, take_top_by_value_norm
from criticalkv.selectors.value_norm import check_output_projections, projected_value_norm

STAGE2_ATTENTION = ("scores", "unpooled")
VALUE_NORMS = ("group_mean", "per_head")


@dataclass
class CriticalSelector(Selector):
    """Two stages: ``floor(alpha * b)`` entries by attention, the rest by ``(A + eps) * ||V W_O||_1``.

    Stage 1 secures a large kept attention mass, the condition under which the paper's bound on the output
    perturbation holds; stage 2 re-scores the remaining entries by their projected value norm. Protected
    entries (e.g. SnapKV's window) count in stage 1 first, as they do in kvpress, where they carry the
    highest score. The scores must be >= 0 outside padding and protected positions (stage 2 multiplies them by
    norms): a ``Method`` checks it, unless its scorer is non-negative by construction (``Scorer``).

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
    stage2
        Which attention A stage 2 multiplies: ``"scores"``, the scorer's (the paper); ``"unpooled"``, the
        observation window's attention without the pooling along the keys (an ablation).
    value_norm
        ``"group_mean"``: ``(A + eps) * N`` with A and N averaged over the GQA group (the paper, kvpress);
        ``"per_head"``: the group mean of the per-query-head products ``(A_g + eps) * ||V W_O^g||_1``, with A_g
        the window's attention of query head g (an ablation).
    screen
        With float32 norms, bracket every norm between cheap bounds and compute the float32 norm only for the
        entries the brackets cannot settle (``selectors/norm_screen.py``): with bfloat16 values on a device with
        native bfloat16 products, the norms from bfloat16 products and their error bound; elsewhere on a CPU, an
        upper bound from the norm in l2 (budgets up to about 0.4 of a head's entries). The same choice as the
        float32 norms everywhere. False computes every float32 norm (the reference, and the timing baseline).
    window, kernel, aggregate
        The observation window the ablations read A from: its last ``window`` queries, pooled with ``kernel``
        (not with ``stage2="unpooled"``), reduced over the queries by ``aggregate`` (``"mean"`` or ``"max"``).
        The same names as ``SnapKVScorer``'s options, so ``build_method`` keeps both in step; unused by the paper's
        defaults.
    """

    alpha: float = 0.5
    eps: float = 1e-4
    norm_dtype: str = "float32"
    stage2: str = "scores"
    value_norm: str = "group_mean"
    screen: bool = True
    window: int = 32
    kernel: int = 5
    aggregate: str = "mean"
    needs_non_negative_scores: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {self.alpha}")
        if self.eps < 0 or not math.isfinite(self.eps):
            raise ValueError(f"eps must be finite and >= 0, got {self.eps}")
        if self.norm_dtype not in ("float32", "model"):
            raise ValueError(f"norm_dtype must be 'float32' or 'model', got {self.norm_dtype!r}")
        if self.stage2 not in STAGE2_ATTENTION:
            raise ValueError(f"stage2 must be one of {STAGE2_ATTENTION}, got {self.stage2!r}")
        if self.value_norm not in VALUE_NORMS:
            raise ValueError(f"value_norm must be one of {VALUE_NORMS}, got {self.value_norm!r}")
        if self.window < 1 or self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError(f"window must be >= 1 and kernel a positive odd number, got {self.window}, {self.kernel}")
        if self.aggregate not in AGGREGATES:
            raise ValueError(f"aggregate must be one of {AGGREGATES}, got {self.aggregate!r}")

    def check_model(self, model: nn.Module) -> None:
        """Refuse output projections whose weight is not W_O (quantized, offloaded): stage 2 multiplies by it."""
        check_output_projections(model, "CriticalKV's stage 2")

    def select(
        self, scores: torch.Tensor, budgets: torch.Tensor, protected: torch.Tensor, view: LayerView
    ) -> torch.Tensor:
        def start() -> tuple[torch.Tensor, ...]:
            """The stages' plan from the budgets alone: once per forward under a uniform allocator."""
            keep = keep_protected(protected, budgets)  # (b, h_kv, t)
            stage1 = torch.floor(budgets.double() * self.alpha + 1e-9).long()  # (b, h_kv)
            open1, need1 = open_places(keep, view.valid, stage1 - keep.sum(-1))  # (b, h_kv, t), (b, h_kv)
            # stage 1 adds exactly need1 entries, so stage 2's need (capped by what is left) is known before it runs
            need2 = torch.minimum((budgets - keep.sum(-1) - need1).clamp(min=0), open1.sum(-1) - need1)  # (b, h_kv)
            k1, k2 = torch.stack([largest(need1), largest(need2)]).tolist()  # the two top-k widths in one host read
            return keep, open1, need1, need2, k1, k2

        keep, open1, need1, need2, k1, k2 = view.remember_for_tensors(
            ("critical start", self.alpha), (budgets, protected), start
        )
        keep = add_top(scores, keep, open1, need1, k1)
        kind = self._screen(view)
        first = None if kind is None else first_round(kind, k2, view.values.shape[2])
        if first is not None:
            weights = self._stage2_attention(scores, view) + self.eps  # (b, h_kv, t)
            o_proj = view.o_proj_weight
            bounds = view.remember(("value_norm_bounds", kind), lambda: BRACKETS[kind](view.values, o_proj))
            return take_top_by_value_norm(weights, bounds, view.values, o_proj, keep, view.valid, need2, k2, first)
        return take_top(self.stage2_scores(scores, view), keep, view.valid, need2, k2)

    def _screen(self, view: LayerView) -> str | None:
        """The bracket stage 2 screens the float32 norms with (``screen``; ``norm_screen.screen_kind``), None when
        it computes them all: unless another method already computed them (the brackets are shared the same way:
        one prefill compressed for several budgets computes them once)."""
        screened = (
            self.screen
            and self.norm_dtype == "float32"
            and self.value_norm == "group_mean"
            and ("value_norm", torch.float32) not in view.memo
        )
        return screen_kind(view.values, view.o_proj_weight) if screened else None

    def _stage2_attention(self, scores: torch.Tensor, view: LayerView) -> torch.Tensor:
        """The attention A of ``(A + eps) * N`` with group-mean norms: (b, h_kv, t) float32."""
        if self.stage2 == "scores":
            return scores
        return self._window_attention_per_head(view).mean(dim=2)

    def stage2_scores(self, scores: torch.Tensor, view: LayerView) -> torch.Tensor:
        """The score stage 2 ranks the remaining entries by: (b, h_kv, t) float32."""
        dtype = torch.float32 if self.norm_dtype == "float32" else None
        if self.value_norm == "group_mean":
            norms = view.remember(
                ("value_norm", dtype), lambda: projected_value_norm(view.values, view.o_proj_weight, dtype)
            )  # (b, h_kv, t)
            return (self._stage2_attention(scores, view) + self.eps) * norms
        attention = self._window_attention_per_head(view)  # (b, h_kv, G, t)
        head_norms = view.remember(
            ("value_norm_per_head", dtype),
            lambda: projected_value_norm(view.values, view.o_proj_weight, dtype, per_head=True),
        )  # (b, h_kv, G, t)
        return ((attention + self.eps) * head_norms).mean(dim=2)

    def _window_attention_per_head(self, view: LayerView) -> torch.Tensor:
        """The window's attention per query head over every position, (b, h_kv, G, t): the window's own
        (protected) positions get each head's row maximum, as SnapKV's scores do."""
        b, h_kv, t, _ = view.keys.shape
        w = min(self.window, t)
        kernel = self.kernel if self.stage2 == "scores" else 1
        context = window_head_scores(view, w, kernel, self.aggregate)  # (b, h_kv, G, t-w)
        g = context.shape[2]
        top = context.amax(dim=-1, keepdim=True) if t > w else context.new_zeros(b, h_kv, g, 1)
        return torch.cat([context, top.expand(b, h_kv, g, w)], dim=-1)
