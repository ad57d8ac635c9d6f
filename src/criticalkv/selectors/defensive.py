"""DefensiveKV's selection (Feng et al., ICLR 2026): a cumulative-mass stage 1, then scores weighted by the
projected value norm normalised across the KV heads of the layer (docs/method.md, DefensiveKV)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from criticalkv.core.heads import head_shard, share_every_head
from criticalkv.core.view import LayerView
from criticalkv.scorers.defensive import MASS_SLICES, WindowStatistics, window_statistics
from criticalkv.selectors.base import Selector, keep_protected
from criticalkv.selectors.value_norm import check_output_projections, projected_value_norm


@dataclass
class DefensiveSelector(Selector):
    """Ranks a layer's entries as DefensiveKV does; the allocator and each head's selection follow that ranking.

    ``rank`` turns a scorer's scores ``s`` into the ranking ``r`` (the runtime calls it before the allocator):

    1. **value term**: ``p_i = s_i * N_i / sum_k N_i^(k)``, where ``N_i`` is the projected value norm
       ``||V_i W_O||_1`` (mean over the GQA group) and the sum runs over the layer's KV heads ``k`` at the same
       position: each token's norms are normalised across heads.
    2. **stage 1**: per head, the context entries by descending mean window attention (``window_statistics``),
       as shares of the head's context mass, until their cumulative share reaches ``mass`` minus the window mass;
       at most ``B - P`` of them (the row's budget per head minus its protected entries). They are raised to
       just above the row's largest ``p`` (the value the window has too), so they win every contest inside the
       layer, also against the entry carrying that largest ``p``.
    3. everything else keeps ``p``.

    ``select`` then keeps, per head, the protected entries and the best ``r`` until the head's budget is full.
    The scores must be >= 0 outside padding and protected positions (step 1 multiplies them): a ``Method`` checks
    it, unless its scorer is non-negative by construction (``Scorer``).

    Parameters
    ----------
    window
        The scorer's observation window: its queries' mean attention and window mass drive stage 1.
    mass
        Stage 1's target share of the window queries' attention (0.9).
    mass_slice
        Where the window mass is measured: ``"intended"``, the window's own positions; ``"reference"``, the ``window``
        context positions just before it, as the reference code does (docs/method.md).

    Notes
    -----
    Stage 1 keeps the entries strictly before the one whose cumulative share reaches the target, as the
    reference code counts. The raised value is the row's maximum (the reference takes it over the whole batch).
    """

    window: int = 32
    mass: float = 0.9
    mass_slice: str = "intended"
    needs_non_negative_scores: ClassVar[bool] = True  # checked by a Method (the value term multiplies them)

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        if not 0.0 <= self.mass <= 1.0 or not math.isfinite(self.mass):
            raise ValueError(f"mass must be in [0, 1], got {self.mass}")
        if self.mass_slice not in MASS_SLICES:
            raise ValueError(f"mass_slice must be one of {MASS_SLICES}, got {self.mass_slice!r}")

    def check_model(self, model: nn.Module) -> None:
        """Refuse output projections whose weight is not W_O (quantized, offloaded): the ranking multiplies by it."""
        check_output_projections(model, "DefensiveKV's ranking")

    def rank(
        self, scores: torch.Tensor, row_budgets: torch.Tensor, protected: torch.Tensor, view: LayerView
    ) -> torch.Tensor:
        """The ranking (b, h_kv, t) float32 from scores (b, h_kv, t), row budgets (b,) and protected (b, t).

        Steps 1 and 2 compare the layer's heads (norms summed over heads, the row's largest value, the window mass
        averaged over every query head): under tensor parallelism the ranking is computed over every rank's heads
        from one ``all_gather`` of what each head contributes, and the allocator reuses it (``every_head``).
        """
        norms = view.remember(
            ("value_norm", torch.float32), lambda: projected_value_norm(view.values, view.o_proj_weight)
        )  # (b, h_kv, t)
        stats = window_statistics(view, self.window)
        shard = head_shard(view)
        if shard is None:
            return self._rank(scores, norms, stats, row_budgets, protected, view.valid)
        t, rows = scores.shape[-1], stats.own_mass.shape[2] * stats.own_mass.shape[3]  # rows: G * w
        own, before = stats.own_mass.flatten(2), stats.before_mass.flatten(2)  # (b, h_kv, G * w)
        parts = shard.gather(torch.cat([scores.float(), norms, stats.mean_attention, own, before], dim=-1))
        every_scores, every_norms, mean, every_own, every_before = parts.split([t, t, t, rows, rows], dim=-1)
        every_stats = WindowStatistics(
            mean, every_own.unflatten(2, stats.own_mass.shape[2:]), every_before.unflatten(2, stats.own_mass.shape[2:])
        )
        ranking = self._rank(every_scores, every_norms, every_stats, row_budgets, protected, view.valid)
        local = shard.local(ranking)
        share_every_head(view, local, ranking)
        return local

    def _rank(
        self,
        scores: torch.Tensor,
        norms: torch.Tensor,
        stats: WindowStatistics,
        row_budgets: torch.Tensor,
        protected: torch.Tensor,
        valid: torch.Tensor,
    ) -> torch.Tensor:
        """The ranking of every head given: scores, norms (b, h, t), the heads' window statistics."""
        candidates = valid & ~protected  # (b, t)
        shares = norms / norms.sum(dim=1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
        weighted = (scores * shares).masked_fill(~candidates[:, None, :], 0.0)  # (b, h_kv, t)
        # (b, 1, 1): strictly above every p, so no entry ties with stage 1 and the window
        top = torch.nextafter(weighted.amax(dim=(1, 2)), weighted.new_tensor(float("inf")))[:, None, None]
        stage1 = self._stage1(row_budgets, protected, candidates, valid, stats)  # (b, h_kv, t)
        return torch.where(stage1 | protected[:, None, :], top, weighted)

    def _stage1(
        self,
        row_budgets: torch.Tensor,
        protected: torch.Tensor,
        candidates: torch.Tensor,
        valid: torch.Tensor,
        stats: WindowStatistics,
    ) -> torch.Tensor:
        """Entries reaching the cumulative mass target, per head: (b, h_kv, t) bool."""
        mean = stats.mean_attention.masked_fill(~candidates[:, None, :], 0.0)  # (b, h_kv, t)
        share = mean / mean.sum(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
        ordered, order = share.sort(dim=-1, descending=True)
        target = self.mass - stats.window_mass(self.mass_slice)  # (b,)
        count = (ordered.cumsum(-1) < target[:, None, None]).sum(-1)  # (b, h_kv): entries before the crossing
        cap = (row_budgets - (protected & valid).sum(-1)).clamp(min=0)  # B - P: (b,)
        count = torch.minimum(count, cap[:, None])
        ranks = torch.arange(share.shape[-1], device=share.device)
        chosen = torch.zeros(share.shape, dtype=torch.bool, device=share.device).scatter(
            -1, order, ranks[None, None, :] < count[:, :, None]
        )
        return chosen & candidates[:, None, :]

    def select(
        self, scores: torch.Tensor, budgets: torch.Tensor, protected: torch.Tensor, view: LayerView
    ) -> torch.Tensor:
        """Keep mask (b, h_kv, t): protected entries, then the best ranked ones (``scores`` is ``rank``'s output)."""
        keep = keep_protected(protected, budgets)
        return take_ordered(scores, keep, view.valid, budgets - keep.sum(-1))


def take_ordered(scores: torch.Tensor, keep: torch.Tensor, valid: torch.Tensor, need: torch.Tensor) -> torch.Tensor:
    """``take_top`` with ties broken by position (earliest first): add the ``need[b, h]`` best valid entries.

    scores (b, h, t) float32; keep (b, h, t) bool; valid (b, t) bool; need (b, h) long. DefensiveKV's ranking
    ties on purpose (stage 1 and the window share one value), and a fixed order among ties is what lets the bounded
    cross-layer allocator, which selects and then shrinks, end with the same entries as the reference.
    """
    candidates = valid[:, None, :] & ~keep  # (b, h, t)
    ordered = scores.masked_fill(~candidates, float("-inf")).sort(dim=-1, descending=True, stable=True)
    slots = torch.arange(scores.shape[-1], device=scores.device)[None, None, :] < need[:, :, None]
    take = slots & candidates.gather(-1, ordered.indices)
    return keep | torch.zeros_like(keep).scatter(-1, ordered.indices, take)
