"""What a scorer sees of one layer right after its prefill attention, and the scorer contract."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import torch
from torch import nn

from criticalkv.distributed.heads import output_projection
from criticalkv.logits import attention_sinks, logit_softcap, soft_cap_, softmax_with_sinks_

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
    # the views of one forward the same dict when their masks are the same (``runtime.compressor.prefill_view``).
    prefill: dict = field(default_factory=dict, repr=False)

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


class Scorer(Protocol):
    """Scores every cached entry of a layer; higher means more worth keeping.

    A scorer whose scores are >= 0 by construction (attention probabilities, recency) says so with a class
    attribute ``non_negative = True``: a selector that multiplies scores by value norms (CriticalKV, DefensiveKV)
    then trusts it, where otherwise a ``Method`` checks the sign of every layer's scores (a host read per layer,
    on a GPU a wait for the device). A subclass that computes the scores anew must say so again
    (``declares_non_negative``).
    """

    def score(self, view: LayerView) -> torch.Tensor:
        """Scores (b, h_kv, t), float32. Values at padding positions are ignored."""
        ...

    def protected(self, view: LayerView) -> torch.Tensor:
        """Positions always kept and counted inside the budget: (b, t) bool."""
        ...


_SCORING_METHODS = ("score", "score_after_prefill")


def declares_non_negative(scorer: object) -> bool:
    """Whether ``scorer``'s scores are >= 0 by its class's word (``non_negative = True``), given by the class that
    computes them or a subclass of it: a subclass that overrides ``score`` (e.g. shifting a built-in scorer's
    scores) below the class that said so is not trusted until it says so itself."""
    mro = type(scorer).__mro__
    owner = next((cls for cls in mro if "non_negative" in vars(cls)), None)
    if owner is None or not vars(owner)["non_negative"]:
        return False
    for name in _SCORING_METHODS:
        source = next((cls for cls in mro if name in vars(cls)), None)
        if source is not None and not issubclass(owner, source):
            return False
    return True


def last_positions(view: LayerView, n: int) -> torch.Tensor:
    """The last ``n`` positions of every row: (b, t) bool. Left padding keeps real tokens at the end."""
    b, t = view.valid.shape
    mask = torch.zeros(b, t, dtype=torch.bool, device=view.valid.device)
    if n > 0:
        mask[:, max(t - n, 0) :] = True
    return mask & view.valid


def padding_or_protected(view: LayerView, protected: torch.Tensor | None) -> torch.Tensor:
    """The positions no contest may pick: padding and ``protected`` (b, t) bool, or padding alone for None; as
    (b, 1, t) bool, computed once per forward for a ``protected`` the forward's layers share."""

    def compute() -> torch.Tensor:
        free = view.valid if protected is None else view.valid & ~protected
        return ~free[:, None, :]

    return view.remember_for_tensors("padding or protected", (protected,), compute)


# Keys per product on a CPU. One product over every key writes the whole (G*w, t) float32 block, which at 16k keys
# (Qwen2.5-0.5B: 29 MB a layer) fills most of an L3 cache before the softmax reads it back; products over 512 keys
# at a time and the softmax written over the logits took the compression of a 16k prefill from 1.12 to 0.80 CPU s,
# the same values, no measurable change at 2k-8k (docs/benchmarks.md, "The window's attention on a CPU in blocks of
# keys").
CPU_KEY_CHUNK = 512


def window_logits(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``q @ keys^T``, (b, h_kv, r, t) from q (b, h_kv, r, d) and keys (b, h_kv, t, d): on a CPU, product by product
    over ``CPU_KEY_CHUNK`` keys at a time (each entry is the same dot product as in one product)."""
    t = keys.shape[2]
    if q.device.type != "cpu" or t <= CPU_KEY_CHUNK:
        return torch.matmul(q, keys.transpose(-1, -2))
    logits = q.new_empty(*q.shape[:-1], t)
    for start in range(0, t, CPU_KEY_CHUNK):
        part = slice(start, start + CPU_KEY_CHUNK)
        torch.matmul(q, keys[:, :, part].transpose(-1, -2), out=logits[..., part])
    return logits


def window_attention(view: LayerView, window: int) -> torch.Tensor:
    """Softmax attention of the last ``window`` queries over all keys, float32: (b, h_kv, G, w, t).

    Causal inside the window, padding keys masked, computed per KV head without repeating the keys; with the
    model's soft cap and attention sinks where it has them (``criticalkv.logits``).
    """
    b, h_kv, t, d = view.keys.shape
    g = view.groups
    w = min(window, t)
    if view.query.shape[2] < w:
        raise ValueError(f"the window's {w} queries are needed, the view holds the last {view.query.shape[2]}")
    # The last w query rows are the last w positions (a deferred layer keeps only its last rows of the query).
    # one copy: float32 laid out as (b, h_q, w, d), so the group's rows join without a second one (the attention's
    # queries arrive as a transposed (b, t, h_q, d) layout)
    q = view.query[:, :, -w:, :].to(torch.float32, memory_format=torch.contiguous_format)
    q = q.reshape(b, h_kv, g * w, d) * view.scaling  # (b, h_kv, G*w, d): a view, unless the queries were float32
    logits = window_logits(q, view.keys.float()).view(b, h_kv, g, w, t)  # (b, h_kv, G, w, t)
    soft_cap_(logits, logit_softcap(view.module))  # Gemma 2, before the masks as in the model
    # causal: only the window's own columns can lie ahead of a window query; (w, w): key after query
    ahead = view.remember_for_prefill(
        ("ahead", w), lambda: torch.ones(w, w, dtype=torch.bool, device=q.device).triu_(1)
    )
    logits[..., t - w :].masked_fill_(ahead, float("-inf"))
    if view.padded:
        logits.masked_fill_(~view.valid[:, None, None, None, :], float("-inf"))
    sinks = attention_sinks(view.module)  # gpt-oss: (h_q,) logits sharing each softmax's denominator
    if sinks is not None:
        return softmax_with_sinks_(logits, sinks.float().view(1, h_kv, g, 1, 1))
    if logits.device.type == "cpu":
        return torch.softmax(logits, dim=-1, out=logits)  # in place: no second block to write and read back
    return torch.softmax(logits, dim=-1)
