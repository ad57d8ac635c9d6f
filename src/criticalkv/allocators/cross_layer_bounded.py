"""A cross-layer allocation that compresses every layer on arrival and still ends with the reference allocation.

The reference contest (``CrossLayerAllocator``) keeps the ``K`` best pooled entries of all layers. The best
``K`` of a union can be found one part at a time while holding only ``K`` entries: an entry among the best ``K``
of everything is among the best ``K`` of any subset that contains it, so it is never dropped on the way, and
whatever is dropped on the way would have lost at the end. Hence: when layer ``l`` arrives, the held entries of
layers ``< l`` and the new layer's entries compete for ``K``; layer ``l`` is compressed to its winners right away,
and the earlier layers give back the entries they lost (``CompressedLayer.shrink``). Under a strict order (ties go
to the earlier layer, head and position, as in the reference) the final kept set is the reference's, while only
the layer being prefilled is ever dense and the compressed layers together never hold more than the final
budget.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from criticalkv.allocators.base import Allocator
from criticalkv.allocators.cross_layer import LayerShare, contest_winners
from criticalkv.core.stages import refuse_split
from criticalkv.core.view import LayerView
from criticalkv.errors import CriticalKVError
from criticalkv.models.families import compressed_layer_position
from criticalkv.selectors.base import keep_protected
from criticalkv.selectors.defensive import take_ordered

_STATE_KEY = "bounded-cross-layer"


@dataclass
class _Held:
    """One prefill's contest so far (per row): the pooled entries held, best first, and each layer's kept set."""

    layers: int  # compressed layers of the model
    heads: int
    length: int  # t: padded prompt length, the same for every layer of a prefill
    room_per_layer: torch.Tensor  # (b,) long
    room: torch.Tensor  # (b,) long: pooled entries of the whole model (every layer's room)
    values: torch.Tensor  # (b, S) float32: held pooled entries' scores, best first; -inf marks an empty slot
    ids: torch.Tensor  # (b, S) long: (layer position * heads + head) * length + token position; -1 when empty
    alive: list[torch.Tensor] = field(default_factory=list)  # per layer so far: (b, h, t) bool, entries kept now
    reserved: list[torch.Tensor] = field(default_factory=list)  # per layer so far: (b, h, t) bool, never dropped
    layer_index: list[int] = field(default_factory=list)  # the model's layer index of each
    base: torch.Tensor | None = None  # (b,) the arriving layer's reserve per head, between allocate and settle
    whole: torch.Tensor | None = None  # (b,) bool
    survivors: tuple[torch.Tensor, torch.Tensor] | None = None  # earlier pooled entries that stay: (values, ids)


@dataclass
class BoundedCrossLayerAllocator(Allocator):
    """The reference cross-layer contest, computed layer by layer: no layer waits dense for the others.

    Each layer is compressed right after its prefill, like a per-layer method; the allocation is nevertheless the
    one ``CrossLayerAllocator`` computes after the whole prefill (see the module notes), exactly so when the
    selector keeps each head's best entries by the scores the allocator ranks (top-k, DefensiveKV's selector).
    Until the last layer, earlier layers hold more than their final share and shrink as later layers win entries
    from them; the compressed layers never hold more than the final ``L h B`` entries per row, and at most one
    layer (the one being prefilled) is dense.

    ``streaming`` tells the runtime to give ``allocate`` and ``settle`` one scratch ``state`` per prefill and to
    apply the shrink orders ``settle`` returns to the layers already compressed.

    Parameters
    ----------
    safeguard
        As in ``CrossLayerAllocator``: share of ``B`` each head reserves from its own best entries (at least one).

    Notes
    -----
    Costs, per layer: a sort of the held pool plus the new layer's entries (at most ``L h B + h t`` scores per
    row), and a (b, h, t) bool mask per layer kept until the last layer arrives. With a selector that does not
    keep the best entries by the allocation scores (CriticalKV's two stages), shrinking drops a head's lowest
    allocation scores first, which is no longer the reference allocation.
    """

    safeguard: float = 0.0
    streaming: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if not 0.0 <= self.safeguard <= 1.0:
            raise ValueError(f"safeguard must be in [0, 1], got {self.safeguard}")

    def allocate(
        self,
        scores: torch.Tensor,
        row_budgets: torch.Tensor,
        view: LayerView,
        protected: torch.Tensor | None,
        state: dict,
    ) -> torch.Tensor:
        """This layer's per-head budgets (b, h_kv) long, given the layers of this prefill that came before."""
        refuse_split(
            view.module,
            "BoundedCrossLayerAllocator (it holds one process's layers and shrinks them as later ones arrive)",
            "CrossLayerAllocator (preset layer-defensive), which reaches the same allocation",
        )
        b, h, t = scores.shape
        position, layers = compressed_layer_position(view.module)
        share = LayerShare.of(scores, row_budgets, view, protected, self.safeguard)
        held = self._held(state, position, layers, share, h, t)
        values = torch.cat([held.values, share.contest.reshape(b, h * t)], dim=1)  # held first: earlier ids
        won = contest_winners(values, held.room)  # (b, S + h t)
        earlier = won[:, : held.values.shape[1]]
        held.survivors = (held.values.masked_fill(~earlier, float("-inf")), held.ids.masked_fill(~earlier, -1))
        held.base, held.whole = share.base, share.whole
        return share.base[:, None] + won[:, held.values.shape[1] :].view(b, h, t).sum(-1)

    def settle(
        self,
        scores: torch.Tensor,
        keep: torch.Tensor,
        view: LayerView,
        protected: torch.Tensor | None,
        state: dict,
    ) -> dict[int, torch.Tensor]:
        """Record what this layer kept (keep (b, h_kv, t) bool); return the shrink orders of earlier layers.

        Each order maps a model layer index to a (N,) bool mask over that layer's kept entries in storage order.
        """
        held: _Held = state[_STATE_KEY]
        b, h, t = keep.shape
        position = len(held.alive)
        base = held.base[:, None].expand(-1, h)
        prot = torch.zeros_like(view.valid) if protected is None else protected & view.valid
        reserved = keep_protected(prot, base) & keep  # the first `base` kept entries of each head, in its order
        reserved = take_ordered(
            scores.float().masked_fill(~keep, float("-inf")), reserved, view.valid, base - reserved.sum(-1)
        )
        reserved = torch.where(held.whole[:, None, None], keep, reserved & keep)
        pooled = keep & ~reserved
        ids = position * h * t + torch.arange(h * t, device=keep.device).view(h, t)
        values = torch.cat([held.survivors[0], scores.float().masked_fill(~pooled, float("-inf")).view(b, -1)], dim=1)
        all_ids = torch.cat([held.survivors[1], ids.expand(b, h, t).masked_fill(~pooled, -1).view(b, -1)], dim=1)
        ordered = values.sort(dim=-1, descending=True, stable=True)  # survivors first among ties: earlier ids
        size = int(torch.isfinite(ordered.values).sum(-1).max()) if values.numel() else 0
        orders = self._shrink_orders(held, position, h, t)
        held.values, held.ids = ordered.values[:, :size], all_ids.gather(-1, ordered.indices[:, :size])
        held.alive.append(keep)
        held.reserved.append(reserved)
        held.layer_index.append(view.module.layer_idx)
        held.survivors = held.base = held.whole = None
        if position == held.layers - 1:
            del state[_STATE_KEY]  # the last layer: nothing can shrink any more
        return orders

    @staticmethod
    def _shrink_orders(held: _Held, position: int, h: int, t: int) -> dict[int, torch.Tensor]:
        """Earlier layers' entries that lost to the arriving layer, as shrink masks over their kept entries."""
        if position == 0:
            return {}
        values, ids = held.survivors
        b = values.shape[0]
        flat = torch.zeros(b, position * h * t + 1, dtype=torch.bool, device=ids.device)  # last column: empty slots
        flat.scatter_(1, torch.where(ids >= 0, ids, position * h * t), True)
        pooled = flat[:, :-1].view(b, position, h, t)
        orders = {}
        for j in range(position):
            alive = held.reserved[j] | pooled[:, j]
            if not torch.equal(alive, held.alive[j]):
                orders[held.layer_index[j]] = alive[held.alive[j]]
                held.alive[j] = alive
        return orders

    @staticmethod
    def _held(state: dict, position: int, layers: int, share: LayerShare, h: int, t: int) -> _Held:
        """This prefill's contest: started at the first layer, continued (in layer order) by the others."""
        b = share.base.shape[0]
        if position == 0:
            empty = share.contest.new_empty(b, 0)
            held = _Held(layers, h, t, share.room, share.room * layers, empty, empty.long())
            state[_STATE_KEY] = held
            return held
        held = state.get(_STATE_KEY)
        if held is None or len(held.alive) != position:
            raise CriticalKVError(
                "the bounded cross-layer allocator decides the layers of one prefill in order, with the state the "
                "runtime keeps per prefill; it cannot decide a layer on its own"
            )
        if held.heads != h or held.length != t or not torch.equal(held.room_per_layer, share.room):
            raise CriticalKVError(
                "the bounded cross-layer allocator needs every layer of a prefill to have the same heads, length, "
                "budget and protected positions"
            )
        return held
