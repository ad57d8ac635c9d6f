"""The selector contract and the two building blocks every selector shares."""

from __future__ import annotations

from typing import ClassVar, Protocol, runtime_checkable

import torch

from criticalkv.core.piece import Piece
from criticalkv.core.view import LayerView


@runtime_checkable
class Selector(Piece, Protocol):
    """Chooses which entries fill each head's budget.

    ``select`` is the contract; the other members are optional capabilities with defaults, which a selector inherits
    by deriving from ``Selector`` and overrides where it differs (with ``window``, ``check_config`` and
    ``check_model`` of ``Piece``).

    Attributes
    ----------
    needs_non_negative_scores
        True for a selector that multiplies scores by value norms: a ``Method`` then refuses negative scores
        (``NegativeScoreError``) unless its scorer is non-negative by construction. A class attribute or a property.
        Default False.
    """

    needs_non_negative_scores: ClassVar[bool] = False

    def select(
        self, scores: torch.Tensor, budgets: torch.Tensor, protected: torch.Tensor, view: LayerView
    ) -> torch.Tensor:
        """Keep mask (b, h_kv, t) bool with exactly ``budgets[b, h]`` entries per head.

        ``scores`` (b, h_kv, t) float32; ``budgets`` (b, h_kv) long, counted with the protected entries;
        ``protected`` (b, t) bool, positions kept first.
        """
        ...

    def rank(
        self, scores: torch.Tensor, row_budgets: torch.Tensor, protected: torch.Tensor, view: LayerView
    ) -> torch.Tensor:
        """The scores (b, h_kv, t) float32 that allocation and selection follow, from the scorer's (b, h_kv, t),
        the rows' budgets (b,) long and the protected positions (b, t) bool: DefensiveKV re-scores here. The default
        returns the scorer's scores as they are."""
        return scores


def keep_protected(protected: torch.Tensor, budgets: torch.Tensor) -> torch.Tensor:
    """Protected positions, the most recent first when the budget cannot hold them all: (b, h, t) bool."""
    # from_right[b, i] = number of protected positions at or after i
    from_right = protected.flip(-1).long().cumsum(-1).flip(-1)  # (b, t)
    return protected[:, None, :] & (from_right[:, None, :] <= budgets[:, :, None])


def open_places(keep: torch.Tensor, valid: torch.Tensor, need: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What a head can still add: candidates (b, h, t) bool (valid, not kept) and each head's need capped by its
    candidates (b, h) long."""
    candidates = valid[:, None, :] & ~keep
    return candidates, torch.minimum(need.clamp(min=0), candidates.sum(-1))


def largest(need: torch.Tensor) -> torch.Tensor:
    """The largest of the needs (b, h), a 0-d long tensor (0 when there are none): the ``k`` of ``add_top``, read
    by the host (a wait for a GPU: read it together with other values where there are any)."""
    return need.max() if need.numel() else need.new_zeros(())


def add_top(
    scores: torch.Tensor, keep: torch.Tensor, candidates: torch.Tensor, need: torch.Tensor, k: int
) -> torch.Tensor:
    """Add to ``keep`` each head's ``need[b, h]`` best-scored ``candidates``; ``k`` >= every need (``largest``).

    scores (b, h, t) float32; keep, candidates (b, h, t) bool; need (b, h) long. Returns a new mask.
    """
    if k == 0:
        return keep
    # candidates rank above every other position, also where a scorer gave them -inf (a tie with the positions masked
    # out would let top-k pick those, and keep fewer than the need)
    lowest = torch.finfo(scores.dtype).min
    ranked = torch.where(candidates, scores.clamp(min=lowest), float("-inf")).topk(k, dim=-1)  # sorted, best first
    take = torch.arange(k, device=scores.device)[None, None, :] < need[:, :, None]  # (b, h, k)
    added = torch.zeros_like(keep)
    added.scatter_(-1, ranked.indices, take)
    return keep | added


def take_top(
    scores: torch.Tensor, keep: torch.Tensor, valid: torch.Tensor, need: torch.Tensor, k: int | None = None
) -> torch.Tensor:
    """Add to ``keep`` the ``need[b, h]`` best-scored valid entries it does not hold yet.

    scores (b, h, t) float32; keep (b, h, t) bool; valid (b, t) bool; need (b, h) long. ``k``: the largest need
    once capped by the candidates (``open_places``), when the caller read it already; None reads it (a host read).
    Returns a new mask.
    """
    candidates, need = open_places(keep, valid, need)
    return add_top(scores, keep, candidates, need, int(largest(need)) if k is None else k)
