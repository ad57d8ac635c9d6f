"""A selector whose objective is the output perturbation itself, measured on the observation window's queries.

CriticalKV minimises an upper bound of the perturbation (docs/perturbation.md, section 2). ``PerturbationSelector``
starts from a kept set (top-k, or CriticalKV's) and improves it by swaps judged on the perturbation they cause, per
KV head:

    L(S) = sum_{g in group} sum_{q in window} || (o_gq - ô_gq(S)) W_O^g ||_1
    o_gq = sum_i A_gqi V_i                  (every entry; A: softmax attention of window query q, query head g)
    ô_gq = sum_{i in S} A_gqi V_i / sigma_gq,   sigma_gq = sum_{i in S} A_gqi   (renormalised on the kept set S)

The window queries are the last ``window`` prompt tokens (SnapKV's observation window), reading the context causally.

The swaps are judged on a *search norm*: ``"l1"`` is L itself; ``"l2"`` replaces each query's L1 norm by its L2 norm,
||r W_O^g||_2 = sqrt(r M_g r^T) with the Gram matrix M_g = W_O^g W_O^gT (d x d), so a candidate set costs d instead of
hidden multiply-adds per query and dimension. The finished set is always checked against its start on L itself.

Each query head g can enter the sum with a weight c_g (``head_weights``): ``objective="relative"`` sets
c_g = 1 / max(L_g(S_0), floor * mean_g' L_g'(S_0)) from the starting set S_0, so every query head's *relative* change
counts alike and a swap cannot buy a large head's gain with a small head's loss. "L" below is then the weighted sum;
the finished set is then checked against its start on the unweighted sum as well.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from criticalkv.core.view import LayerView
from criticalkv.errors import UnsupportedModelError
from criticalkv.logits import SINKS, logit_changes
from criticalkv.scorers.snapkv import shared_window_attention
from criticalkv.selectors.base import Selector, keep_protected, take_top
from criticalkv.selectors.critical import CriticalSelector
from criticalkv.selectors.topk import TopKSelector
from criticalkv.selectors.value_norm import check_output_projections

STARTS = ("topk", "critical")
SEARCHES = ("l1", "l2")
CANDIDATE_RANKINGS = ("gain", "score")
OBJECTIVES = ("relative", "sum")
# An accepted swap must lower L by this fraction of L: float32 noise never counts as progress.
_MIN_RELATIVE_GAIN = 1e-6


class WindowPerturbation:
    """The objective L(S) of every (batch row, KV head) for the window queries of one layer, float32.

    A kept set enters through its *kept sums* ``(b, h_kv, G, ..., w, d + 1)``: ``sum_{i in S} A_gqi [V_i, 1]``, the
    unnormalised kept output and, last, the kept attention mass sigma_gq. ``...`` stands for any extra dimensions
    (several candidate sets at once).

    Parameters
    ----------
    attention
        (b, h_kv, G, w, t) softmax attention of the window queries over every entry (zero rows for padding queries).
    values
        (b, h_kv, t, d) value states.
    w_heads
        (h_kv, G, d, hidden): query head ``k * G + g``'s slice of o_proj, ``o_proj.weight[:, h*d:(h+1)*d].T``.
    search
        The norm the swaps are judged on (module docstring): ``"l1"`` (L itself) or ``"l2"``.

    ``head_weights`` (b, h_kv, G) float32, None until ``improve`` sets it (``relative_floor``): the weight c_g of each
    query head's term in L and the search loss; None: all 1.
    """

    def __init__(
        self, attention: torch.Tensor, values: torch.Tensor, w_heads: torch.Tensor, search: str = "l1"
    ) -> None:
        if search not in SEARCHES:
            raise ValueError(f"search must be one of {SEARCHES}, got {search!r}")
        self.attention = attention.float()  # (b, h_kv, G, w, t)
        d = values.shape[-1]
        self.values_and_one = values.new_empty((*values.shape[:-1], d + 1), dtype=torch.float32)  # (b, h_kv, t, d+1)
        self.values_and_one[..., :d] = values  # one pass: converted while copied
        self.values_and_one[..., d] = 1.0
        self.w_heads = w_heads.float()  # (h_kv, G, d, hidden)
        self.full = _weighted_sums(self.attention, self.values_and_one[..., :d])  # o, before W_O: (b, h_kv, G, w, d)
        self.search = search
        self.head_weights: torch.Tensor | None = None
        # M_g = W_O^g W_O^gT: (h_kv, G, d, d), for the "l2" search only
        self.gram = torch.matmul(self.w_heads, self.w_heads.transpose(-1, -2)) if search == "l2" else None

    @classmethod
    def of_view(cls, view: LayerView, window: int, search: str = "l1") -> WindowPerturbation:
        """The objective of a layer's prefill: its last ``window`` queries (fewer if the prompt is shorter)."""
        _, h_kv, t, d = view.keys.shape
        w = min(window, t)
        attention = shared_window_attention(view, w)  # (b, h_kv, G, w, t); NaN rows for padding queries
        query_valid = view.valid[:, t - w :]  # (b, w)
        # a fact of the padding mask: one host read per forward, not per layer
        if not view.remember_for_prefill(("window queries valid", w), lambda: bool(query_valid.all())):
            attention = attention.masked_fill(~query_valid[:, None, None, :, None], 0.0)
        weight = view.o_proj_weight.detach()  # (hidden, h_q * d)
        # contiguous: the many small products with W_O in ``improve`` run about 30% faster than on a transposed view
        w_heads = weight.new_empty((h_kv, view.groups, d, weight.shape[0]), dtype=torch.float32)
        w_heads.view(-1, weight.shape[0]).copy_(weight.t())  # transposed and converted in one pass
        return cls(attention, view.values, w_heads, search)

    def project(self, x: torch.Tensor, matrices: torch.Tensor | None = None) -> torch.Tensor:
        """x W_O^g for x (b, h_kv, G, ..., d): (b, h_kv, G, ..., hidden), one batched matmul per (row, KV head).

        ``matrices`` (h_kv, G, d, e) replaces W_O^g (the Gram matrices: e = d)."""
        matrices = self.w_heads if matrices is None else matrices
        b, h_kv, g = x.shape[:3]
        out = torch.matmul(x.reshape(b, h_kv, g, -1, x.shape[-1]), matrices)  # (b, h_kv, G, n, e)
        return out.view(*x.shape[:-1], -1)

    def kept_sums(self, keep: torch.Tensor) -> torch.Tensor:
        """The kept sums of a keep mask (b, h_kv, t) bool: (b, h_kv, G, w, d + 1)."""
        return _weighted_sums(self.attention, self.values_and_one * keep[..., None])

    def difference(self, sums: torch.Tensor) -> torch.Tensor:
        """ô - o from kept sums (b, h_kv, G, ..., w, d + 1): (b, h_kv, G, ..., w, d); ô = 0 where sigma = 0.

        Taken before the projection, where it is d wide instead of hidden wide."""
        b, h_kv, g, w, d = self.full.shape
        return _compressed(sums) - self.full.view(b, h_kv, g, *(1,) * (sums.dim() - 5), w, d)

    def head_losses(self, sums: torch.Tensor) -> torch.Tensor:
        """Each query head's unweighted L_g for kept sums (b, h_kv, G, ..., w, d + 1): (b, h_kv, G, ...)."""
        return _l1_consuming(self.project(self.difference(sums)))

    def _over_heads(self, per_head: torch.Tensor) -> torch.Tensor:
        """Sum over the query heads (dim 2) of (b, h_kv, G, ...), weighted by ``head_weights``: (b, h_kv, ...)."""
        if self.head_weights is None:
            return per_head.sum(dim=2)
        weights = self.head_weights.view(*self.head_weights.shape, *(1,) * (per_head.dim() - 3))
        return (per_head * weights).sum(dim=2)

    def loss_of(self, sums: torch.Tensor) -> torch.Tensor:
        """L for kept sums (b, h_kv, G, ..., w, d + 1): (b, h_kv, ...)."""
        return self._over_heads(self.head_losses(sums))

    def loss(self, keep: torch.Tensor) -> torch.Tensor:
        """L(S) for a keep mask (b, h_kv, t) bool: (b, h_kv)."""
        return self.loss_of(self.kept_sums(keep))

    def search_loss(self, sums: torch.Tensor) -> torch.Tensor:
        """The search norm's loss for kept sums (b, h_kv, G, ..., w, d + 1): (b, h_kv, ...); L itself for "l1"."""
        if self.search == "l1":
            return self.loss_of(sums)
        difference = self.difference(sums)
        # ||(ô - o) W||_2^2 = (ô - o) M (ô - o)^T: (b, h_kv, G, ..., w)
        quadratic = (self.project(difference, self.gram) * difference).sum(-1)
        return self._over_heads(quadratic.clamp_min_(0.0).sqrt_().sum(-1))

    def direction(self, sums: torch.Tensor) -> torch.Tensor:
        """The search loss's gradient in ô for kept sums (b, h_kv, G, w, d + 1): (b, h_kv, G, w, d).

        L1: sign((ô - o) W) W^T; L2: (ô - o) M / ||(ô - o) W||_2 (0 where the norm is); times c_g."""
        difference = self.difference(sums)
        if self.search == "l1":
            gradient = self.project(self.project(difference).sign_(), self.w_heads.transpose(-1, -2))
        else:
            mapped = self.project(difference, self.gram)  # (ô - o) M
            norms = (mapped * difference).sum(-1, keepdim=True).clamp_min_(0.0).sqrt_()
            gradient = torch.where(norms > 0, mapped / norms.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
        return gradient if self.head_weights is None else gradient * self.head_weights[..., None, None]

    def gain(
        self,
        sums: torch.Tensor,
        attention: torch.Tensor,
        values_and_one: torch.Tensor,
        direction: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """First-order decrease of the search loss when an entry joins S (for one in S: the increase when it leaves):
        (b, h_kv, n).

        ``sums`` (b, h_kv, G, w, d + 1) are the current set's; ``attention`` (b, h_kv, G, w, n) and
        ``values_and_one`` (b, h_kv, n, d + 1) are the entries' columns of ``self.attention`` and
        ``self.values_and_one``. Adding i moves ô_gq by (A_gqi / sigma_gq)(V_i - ô_gq) to first order, so the loss
        drops by about -sum_gq (A_gqi / sigma_gq) D_gq . (V_i - ô_gq) with D the loss's gradient in ô
        (``direction``; for L, sign((ô - o) W) W^T): one (n x Gw x (d + 1)) matmul. Reliable while no sign of
        (o - ô) W flips, i.e. for entries of small A_gqi / sigma_gq. ``direction``: computed from ``sums`` if not given.
        """
        direction = self.direction(sums) if direction is None else direction
        back = -direction  # (b, h_kv, G, w, d)
        offset = (back * _compressed(sums)).sum(-1, keepdim=True)  # -D . ô: (b, h_kv, G, w, 1)
        coefficients = torch.cat([back, -offset], dim=-1) * _inverse_mass(sums)[..., None]  # (b, h_kv, G, w, d + 1)
        b, h_kv, g, w, n = attention.shape
        per_entry = torch.matmul(
            attention.reshape(b, h_kv, g * w, n).transpose(-1, -2), coefficients.reshape(b, h_kv, g * w, -1)
        )  # (b, h_kv, n, d + 1)
        return per_entry.mul_(values_and_one).sum(-1)

    def improve(
        self,
        keep: torch.Tensor,
        free: torch.Tensor,
        pool: int = 64,
        rounds: int = 8,
        candidates: int = 256,
        max_weight: float = 0.03,
        ranking: torch.Tensor | None = None,
        relative_floor: float | None = None,
    ) -> torch.Tensor:
        """Lower L by swaps of entries of ``free`` (b, h_kv, t) or (b, 1, t) bool in and out of ``keep``.

        The candidate set: the ``candidates`` best excluded and the ``candidates`` worst kept entries by ``gain``
        over every free entry, or by ``ranking`` (b, h_kv, t) when given (the scorer's scores: the entries on either
        side of the kept set's edge). Candidates with ``max_gq A_gqi / sigma_gq > max_weight`` stay as they are
        (``gain`` misjudges them). Each round, per head: rank the candidates by ``gain``, pair the ``pool`` best
        excluded with the ``pool`` worst kept (best with worst), evaluate the search loss exactly for swapping the
        first m pairs, m = 1, 4, 16, ..., ``pool``, and apply the best m if it lowers it; if none does, the first
        pair's kept entry (whose removal ``gain`` misjudged) leaves the candidates. Budgets never change. Returns a
        new mask, per head never worse than ``keep`` on L (the search loss is L itself for ``"l1"``) and, with head
        weights, on the unweighted sum of the query heads' losses too.

        ``relative_floor``: first set ``head_weights`` relative to ``keep`` (``relative_weights``), so L is then the
        sum of each query head's loss relative to its start.
        """
        b, h_kv, t = keep.shape
        device = keep.device
        start_sums = self.kept_sums(keep)  # (b, h_kv, G, w, d + 1)
        by_gain = ranking is None
        if by_gain and max_weight < 1.0:
            free = free & ~_heavy(self.attention, start_sums, max_weight)
        addable, movable = free & ~keep, free & keep
        n = min(candidates, t)
        if n < 1 or pool < 1 or rounds < 1 or not bool((addable.any(-1) & movable.any(-1)).any()):
            return keep
        start_heads = self.head_losses(start_sums)  # L_g of the start: (b, h_kv, G)
        if relative_floor is not None:
            self.head_weights = relative_weights(start_heads, relative_floor)
        start_loss = self._over_heads(start_heads)  # L of the start: (b, h_kv)
        current = start_loss if self.search == "l1" else self.search_loss(start_sums)  # (b, h_kv)
        direction = self.direction(start_sums)  # (b, h_kv, G, w, d)
        if by_gain:
            ranking = self.gain(start_sums, self.attention, self.values_and_one, direction)  # (b, h_kv, t)
        # the candidates, best first on each side: (b, h_kv, 2n) positions, and which of them are real candidates
        add_side = ranking.masked_fill(~addable, -math.inf).topk(n, dim=-1).indices
        drop_side = ranking.masked_fill(~movable, math.inf).topk(n, dim=-1, largest=False).indices
        index = torch.cat([add_side, drop_side], dim=-1)
        member = torch.cat([addable.gather(-1, add_side), movable.gather(-1, drop_side)], dim=-1)
        start_in_set = torch.cat([torch.zeros_like(member[..., :n]), member[..., n:]], dim=-1)
        g, w, width = self.attention.shape[2], self.attention.shape[3], self.values_and_one.shape[-1]
        attention = self.attention.gather(-1, index[:, :, None, None, :].expand(b, h_kv, g, w, 2 * n))
        values_and_one = self.values_and_one.gather(2, index[..., None].expand(b, h_kv, 2 * n, width))
        if by_gain:
            gain = ranking.gather(-1, index)  # (b, h_kv, 2n)
        else:
            if max_weight < 1.0:
                member = member & ~_heavy(attention, start_sums, max_weight)
            gain = self.gain(start_sums, attention, values_and_one, direction)
        pool = min(pool, n)
        sizes = torch.tensor(sorted({min(4**i, pool) for i in range(math.ceil(math.log(pool, 4)) + 1)}), device=device)
        take = (torch.arange(pool, device=device)[None, :] < sizes[:, None]).float()  # (J, P): the first m pairs
        signed = torch.cat([take, -take], dim=-1)  # (J, 2P): the first m pairs' entries in (+1), out (-1)
        ranks = torch.arange(pool, device=device)[None, None, :]
        sums, in_set = start_sums, start_in_set
        for round_ in range(rounds):
            if round_:
                gain = self.gain(sums, attention, values_and_one, direction)
            can_add, can_drop = member & ~in_set, member & in_set
            add = gain.masked_fill(~can_add, -math.inf).topk(pool, dim=-1).indices  # (b, h_kv, P)
            drop = gain.masked_fill(~can_drop, math.inf).topk(pool, dim=-1, largest=False).indices
            pairs = torch.minimum(can_add.sum(-1), can_drop.sum(-1))  # (b, h_kv)
            both = torch.cat([add, drop], dim=-1)  # (b, h_kv, 2P)
            a = attention.gather(-1, both[:, :, None, None, :].expand(b, h_kv, g, w, 2 * pool))  # (b, h_kv, G, w, 2P)
            v = values_and_one.gather(2, both[..., None].expand(b, h_kv, 2 * pool, width))  # (b, h_kv, 2P, d + 1)
            # per size m: sum_p signed[m, p] A_p [V_p, 1], as one product per (row, KV head): (b, h_kv, G, J, w, d + 1)
            weighted = (signed.t()[None, None, :, :, None] * v[:, :, :, None]).flatten(-2)  # (b, h_kv, 2P, J (d + 1))
            change = torch.matmul(a.reshape(b, h_kv, g * w, 2 * pool), weighted)  # (b, h_kv, G*w, J (d + 1))
            change = change.view(b, h_kv, g, w, -1, width).transpose(3, 4)
            proposed = sums[:, :, :, None] + change
            losses = self.search_loss(proposed).masked_fill(sizes > pairs[..., None], math.inf)  # (b, h_kv, J)
            best, choice = losses.min(dim=-1)
            accept = best < current * (1 - _MIN_RELATIVE_GAIN)  # (b, h_kv)
            failed = ~accept & (pairs > 0)
            if not bool((accept | failed).any()):
                break
            first = torch.zeros_like(member)  # a failed head's first pair, misjudged by gain: no longer candidates
            first.scatter_(-1, drop[..., :1], failed[..., None])
            member = member & ~first
            chosen = ranks < torch.where(accept, sizes[choice], 0)[..., None]  # (b, h_kv, P); top-k indices are unique
            added = torch.zeros_like(in_set).scatter_(-1, add, chosen)
            dropped = torch.zeros_like(in_set).scatter_(-1, drop, chosen)
            in_set = (in_set | added) & ~dropped
            pick = choice[:, :, None, None, None, None].expand(b, h_kv, g, 1, w, 1)
            taken = accept[:, :, None, None, None]
            sums = torch.where(taken, proposed.gather(3, pick.expand(-1, -1, -1, -1, -1, width))[:, :, :, 0], sums)
            current = torch.where(accept, best, current)
            if round_ + 1 < rounds:  # the next round's ranking: the gradient at the new sets
                direction = self.direction(sums)
        # the sums drifted by float32 rounding over the rounds: judge the final set afresh against the start
        change = in_set.float() - start_in_set.float()  # (b, h_kv, 2n): +1 added, -1 dropped
        final = start_sums + _weighted_sums(attention, values_and_one * change[..., None])
        final_heads = self.head_losses(final)  # (b, h_kv, G)
        better = self._over_heads(final_heads) <= start_loss  # (b, h_kv)
        if self.head_weights is not None:  # and never worse on the summed perturbation itself
            better &= final_heads.sum(dim=2) <= start_heads.sum(dim=2)
        moved = (in_set != start_in_set) & better[..., None]
        flips = torch.zeros_like(keep, dtype=torch.long).scatter_add_(-1, index, moved.long()) > 0
        return keep ^ flips


def relative_weights(per_head: torch.Tensor, floor: float) -> torch.Tensor:
    """c_g = 1 / max(L_g, floor * mean_g' L_g') for a starting set's per-head losses (b, h_kv, G): (b, h_kv, G).

    The floor keeps a head whose start is already almost exact from dominating its group; c_g = 1 where the whole
    group's loss is 0 (nothing to lower)."""
    scale = torch.maximum(per_head, floor * per_head.mean(dim=-1, keepdim=True))
    return torch.where(scale > 0, 1.0 / scale.clamp_min(torch.finfo(torch.float32).tiny), 1.0)


def _heavy(attention: torch.Tensor, sums: torch.Tensor, max_weight: float) -> torch.Tensor:
    """Entries with A_gqi / sigma_gq > max_weight for some window query, for attention (b, h_kv, G, w, n) and kept
    sums (b, h_kv, G, w, d + 1): (b, h_kv, n) bool; never where sigma = 0."""
    weight = attention * _inverse_mass(sums)[..., None]  # A_gqi / sigma_gq: (b, h_kv, G, w, n)
    return weight.amax(dim=(2, 3)) > max_weight


def _weighted_sums(attention: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """sum_i A_gqi rows_i for attention (b, h_kv, G, w, n) and rows (b, h_kv, n, e): (b, h_kv, G, w, e)."""
    b, h_kv, g, w, n = attention.shape
    return torch.matmul(attention.reshape(b, h_kv, g * w, n), rows).view(b, h_kv, g, w, -1)


def _l1_consuming(residual: torch.Tensor) -> torch.Tensor:
    """L_g from (ô - o) W (b, h_kv, G, ..., w, hidden): (b, h_kv, G, ...). Overwrites ``residual`` (no copy)."""
    return residual.abs_().sum(dim=(-1, -2))


def _compressed(sums: torch.Tensor) -> torch.Tensor:
    """ô = kept sum / sigma from kept sums (..., d + 1), 0 where sigma = 0: (..., d)."""
    return sums[..., :-1] / sums[..., -1:].clamp_min(torch.finfo(torch.float32).tiny)


def _inverse_mass(sums: torch.Tensor) -> torch.Tensor:
    """1 / sigma_gq from kept sums (..., d + 1), 0 where nothing is kept: (...)."""
    sigma = sums[..., -1]
    return torch.where(sigma > 0, 1.0 / sigma.clamp_min(torch.finfo(torch.float32).tiny), 0.0)


@dataclass
class PerturbationSelector(Selector):
    """Minimises the measured output perturbation of the observation window's queries, per KV head.

    Starts from the scorer's top-k set (or CriticalKV's) and improves it by swaps (``WindowPerturbation.improve``):
    each round ranks the candidates by the first-order change of L, pairs the ``pool`` most promising excluded
    entries with the ``pool`` least useful kept ones and applies the number of pairs (1, 4, 16, ..., ``pool``) whose
    exact L is lowest, if it beats the current set. Protected entries (SnapKV's window) and the ``anchor`` share of
    the budget with the best scores stay kept: the window's 32 queries are a small sample of the queries that come
    later, and the pooled scores of the best entries generalise where the window's exact perturbation overfits
    (with ``start="critical"`` and ``alpha`` below ``anchor``, CriticalKV's second stage may leave some of that share
    out: those are not forced in, and a swap may bring them back like any other entry).
    With ``objective="relative"`` (default) L sums each query head's loss relative to the starting set's, so the
    search lowers the loss of the group's heads alike instead of trading a small head's loss for a large head's gain.
    Budgets are unchanged. Deterministic, and per head never worse on L than its starting set.

    Cost per KV head, with w window queries, G query heads per KV head, t entries, head size d, hidden size H and
    c = ``candidates``: once, O(G w t d) (the full and kept window outputs and the first ranking; the window
    attention itself is SnapKV's, shared; ``candidates_by="score"`` skips the first ranking's pass over t); per round,
    O(G w c d) for the ranking and O(log4(pool) G w d H) for the exact evaluations (O(log4(pool) G w d^2) with
    ``search="l2"``). ``start="critical"`` adds CriticalKV's value norm, O(t d G H).

    Parameters
    ----------
    window
        Window queries in the objective (the last ``window`` prompt tokens); SnapKV's option of the same name,
        so ``build_method(..., window=64)`` sets both.
    start
        ``"topk"`` (the scorer's top-k set, SnapKV's) or ``"critical"`` (CriticalKV's two-stage set with ``alpha``,
        ``eps``, ``norm_dtype``).
    pool
        Most swaps per head and round.
    rounds
        Most rounds of swaps.
    candidates
        Entries per side (excluded / kept) that may be swapped at all, chosen by the first ranking.
    max_weight
        Entries whose attention share ``A_gqi / sigma_gq`` exceeds this for some window query are never swapped: the
        first-order ranking misjudges them.
    anchor
        Share of each head's budget (protected entries included) filled by the best scores and never swapped out.
    search
        The norm the swaps are judged on: ``"l2"`` (default: each query's L1 norm replaced by its L2 norm, through
        the d x d Gram matrix of W_O: per round O(log4(pool) G w d^2) instead of O(log4(pool) G w d H)) or ``"l1"``
        (the perturbation L itself). The final set is checked against the start on L either way. On the prompts of
        docs/selectors.md "l2" lowers L on as many heads as "l1" or more, by as much, and its rounds cost 30-47% less.
    candidates_by
        How the ``candidates`` on either side are chosen: ``"gain"`` (the first-order change of the search loss,
        over every free entry) or ``"score"`` (the scorer's ranking: the excluded entries just below the kept set's
        edge and the kept ones just above it; no pass over every entry).
    objective
        How the query heads of a KV head's group enter L: ``"relative"`` (default: each head's loss divided by its
        starting set's, floored at ``floor`` times the group's mean) or ``"sum"`` (the summed perturbation itself, the
        default up to commit ``827fe2e``). On the prompts of docs/selectors.md section 8 "relative"
        lowers the perturbation against snapkv's set on more heads at the same mean.
    floor
        The ``"relative"`` objective's floor, a fraction of the group's mean starting loss: a head whose start is
        almost exact does not dominate its group.
    alpha, eps, norm_dtype, stage2, aggregate
        The CriticalKV starting set's options (see ``CriticalSelector``); ``start="critical"`` with
        ``stage2="unpooled"`` gives the lowest mean perturbation in docs/selectors.md.
    """

    window: int = 32
    start: str = "topk"
    pool: int = 64
    rounds: int = 8
    candidates: int = 256
    max_weight: float = 0.03
    anchor: float = 0.5
    search: str = "l2"
    candidates_by: str = "gain"
    objective: str = "relative"
    floor: float = 0.3
    alpha: float = 0.5
    eps: float = 1e-4
    norm_dtype: str = "float32"
    stage2: str = "scores"
    aggregate: str = "mean"

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        if self.start not in STARTS:
            raise ValueError(f"start must be one of {STARTS}, got {self.start!r}")
        if self.pool < 1 or self.rounds < 0 or self.candidates < 1:
            raise ValueError(
                f"pool and candidates must be >= 1, rounds >= 0; got {self.pool}, {self.candidates}, {self.rounds}"
            )
        if not 0.0 < self.max_weight <= 1.0:
            raise ValueError(f"max_weight must be in (0, 1], got {self.max_weight}")
        if not 0.0 <= self.anchor <= 1.0:
            raise ValueError(f"anchor must be in [0, 1], got {self.anchor}")
        if self.search not in SEARCHES:
            raise ValueError(f"search must be one of {SEARCHES}, got {self.search!r}")
        if self.candidates_by not in CANDIDATE_RANKINGS:
            raise ValueError(f"candidates_by must be one of {CANDIDATE_RANKINGS}, got {self.candidates_by!r}")
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {self.objective!r}")
        if not self.floor > 0.0:
            raise ValueError(f"floor must be > 0, got {self.floor}")
        self._critical()  # validates its options

    def _critical(self) -> CriticalSelector:
        return CriticalSelector(
            alpha=self.alpha,
            eps=self.eps,
            norm_dtype=self.norm_dtype,
            stage2=self.stage2,
            window=self.window,
            aggregate=self.aggregate,
        )

    @property
    def needs_non_negative_scores(self) -> bool:
        """The CriticalKV start multiplies the scores by value norms (a ``Method`` then checks their sign)."""
        return self.start == "critical"

    def starting_selector(self) -> CriticalSelector | TopKSelector:
        """The selector whose set the swaps start from."""
        return TopKSelector() if self.start == "topk" else self._critical()

    def check_config(self, config: PretrainedConfig) -> None:
        """Refuse, from the config alone, a model with attention sinks (gpt-oss): the perturbation of a kept set
        renormalises the window's attention over the kept entries, without the sinks' share."""
        if SINKS in logit_changes(config):
            raise UnsupportedModelError(
                "the measured selectors do not apply attention sinks (gpt-oss) yet; use snapkv, critical-snapkv, "
                "adakv, critical-adakv or another preset without 'measured'"
            )

    def check_model(self, model: nn.Module) -> None:
        """Refuse output projections whose weight is not W_O (quantized, offloaded): the perturbation passes it."""
        check_output_projections(model, "the measured selectors")

    def select(
        self, scores: torch.Tensor, budgets: torch.Tensor, protected: torch.Tensor, view: LayerView
    ) -> torch.Tensor:
        keep = self.starting_selector().select(scores, budgets, protected, view)
        free = (view.valid & ~protected)[:, None, :]  # (b, 1, t): entries a swap may move
        if self.anchor > 0:
            anchored = keep_protected(protected, budgets)
            anchored = take_top(
                scores, anchored, view.valid, torch.floor(budgets * self.anchor).long() - anchored.sum(-1)
            )
            free = free & ~(anchored & keep)  # an anchored entry the start left out may still be swapped in
        objective = WindowPerturbation.of_view(view, self.window, self.search)
        ranking = scores if self.candidates_by == "score" else None
        floor = self.floor if self.objective == "relative" else None
        return objective.improve(keep, free, self.pool, self.rounds, self.candidates, self.max_weight, ranking, floor)
