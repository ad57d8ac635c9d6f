"""What every piece of a method sees of one layer right after its prefill attention: the ``LayerView``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch
from torch import nn

from criticalkv.core.heads import output_projection

T = TypeVar("T")
_SHARED = "tensors shared by the layers of a forward"  # LayerView.prefill key: id -> tensor


def _once(store: dict, key: object, compute: Callable[[], T]) -> T:
    """``store[key]``, computed by ``compute()`` the first time it is asked for."""
    if key not in store:
        store[key] = compute()
    return store[key]


@dataclass
class LayerView:
    """One attention layer's prefill, as handed to scorers, allocators and selectors.

    ``query`` holds the query states the attention layer itself computed (after the model's QK-norm and RoPE
    at the true positions), so a scorer that reads the last ``w`` rows gets exactly the observation-window
    queries that kvpress recomputes from the hidden states.
    """

    module: nn.Module  # the attention module: o_proj, layer_idx
    query: torch.Tensor  # (b, h_q, t, d)
    keys: torch.Tensor  # (b, h_kv, t, d)
    values: torch.Tensor  # (b, h_kv, t, d)
    valid: torch.Tensor  # (b, t) bool; False on padding
    scaling: float  # softmax scale the layer uses (1/sqrt(d) for most models)
    memo: dict = field(default_factory=dict, repr=False)  # derived tensors shared by methods deciding on this view
    # Facts of the padding mask shared by every layer of one forward (lengths, a method's plan): the runtime hands
    # the views of one forward the same dict when their masks are the same (``runtime.prefill_view.prefill_view``).
    prefill: dict = field(default_factory=dict, repr=False)
    # (b, h_kv, t) bool, when the heads of a row hold different entries (a cache compressed again, with head-wise
    # budgets: ``runtime.rolling``): the positions each head really holds, the others being padding of that head.
    # None: every head holds every ``valid`` position.
    held: torch.Tensor | None = field(default=None, repr=False)
    # (b, h_kv, t) long, when entry i of a row is not the row's i-th real token (a cache compressed again and the
    # places of what it kept known: ``runtime.rolling``): each entry's index among its row's real prompt tokens, and
    # ``seen`` (b,) long, the real tokens each row has seen so far. None: entry i is the row's i-th real token.
    places: torch.Tensor | None = field(default=None, repr=False)
    seen: torch.Tensor | None = field(default=None, repr=False)

    def remember(self, key: object, compute: Callable[[], T]) -> T:
        """``compute()`` once per view and key: several methods deciding on one prefill share scores and norms."""
        return _once(self.memo, key, compute)

    def remember_for_prefill(self, key: object, compute: Callable[[], T]) -> T:
        """``compute()`` once per forward and key, for what depends on the padding mask alone (not on the layer):
        on a GPU every layer would otherwise launch the same operators and wait for the same host reads."""
        return _once(self.prefill, key, compute)

    def share_with_forward(self, tensor: torch.Tensor) -> torch.Tensor:
        """Mark ``tensor`` as one that every layer of this forward is handed (a method's per-row budgets and
        protected positions: ``Method``'s plan), for ``remember_for_tensors``; returns it. Not to be modified in
        place afterwards."""
        self.prefill.setdefault(_SHARED, {})[id(tensor)] = tensor  # held: no other tensor takes its id meanwhile
        return tensor

    def remember_for_tensors(
        self,
        key: object,
        tensors: tuple[torch.Tensor | None, ...],
        compute: Callable[[], T],
        shared_result: bool = False,
    ) -> T:
        """``compute()`` once per forward for ``key`` and ``tensors`` when each of them is shared by the forward's
        layers (``share_with_forward``; None counts as shared): what a piece derives from them alone is then computed,
        and its host reads made, once per forward instead of once per layer (on a GPU each read is a wait). Tensors
        made for one layer (a head-wise allocator's budgets) get ``compute()`` every time, and nothing is kept.
        ``shared_result``: the result is itself handed to every layer (a uniform allocator's budgets): mark it."""
        marks = self.prefill.get(_SHARED, {})
        if any(t is not None and marks.get(id(t)) is not t for t in tensors):
            return compute()

        def once() -> T:
            result = compute()
            return self.share_with_forward(result) if shared_result else result

        return self.remember_for_prefill((key, *map(id, tensors)), once)

    @property
    def groups(self) -> int:
        """Query heads per KV head (GQA group size)."""
        return self.query.shape[1] // self.keys.shape[1]

    @property
    def lengths(self) -> torch.Tensor:
        """Real (non-padding) length of each row: (b,) long."""
        return self.remember_for_prefill("lengths", lambda: self.valid.sum(-1))

    @property
    def padded(self) -> bool:
        """Whether any row holds padding (a host read, once per forward)."""
        return self.remember_for_prefill("padded", lambda: not bool(self.valid.all()))

    @property
    def o_proj_weight(self) -> torch.Tensor:
        """The output projection's columns of this view's query heads, (hidden, h_q * d): the whole weight on one
        process, this rank's own shard under tensor parallelism (``criticalkv.distributed.output_projection``)."""
        return output_projection(self.module.o_proj.weight, self.query.shape[1] * self.query.shape[-1])


def padding_or_protected(view: LayerView, protected: torch.Tensor | None) -> torch.Tensor:
    """The positions no contest may pick: padding and ``protected`` (b, t) bool, or padding alone for None; as
    (b, 1, t) bool, computed once per forward for a ``protected`` the forward's layers share."""

    def compute() -> torch.Tensor:
        free = view.valid if protected is None else view.valid & ~protected
        return ~free[:, None, :]

    return view.remember_for_tensors("padding or protected", (protected,), compute)
