"""HeadKV (Fu et al., 2024, arXiv 2410.19258): heads differ in how much they read from the context, so each
KV head gets a budget proportional to an importance profile measured once per model, on top of a base share."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from criticalkv.allocators.balance import cap_rank_imbalance
from criticalkv.allocators.base import Allocator
from criticalkv.allocators.head_profile import HeadProfile, HeadProfileError, config_shape, load_profile
from criticalkv.allocators.pyramid import largest_remainder
from criticalkv.core.heads import every_head, head_shard
from criticalkv.core.view import LayerView
from criticalkv.errors import BudgetError
from criticalkv.models.families import compressed_layer_position, full_attention_layers

SCOPES = ("layer", "model")


def head_shares(weights: torch.Tensor, extra: torch.Tensor, room: torch.Tensor, base_share: float) -> torch.Tensor:
    """Integer budgets (b, n) of ``n`` heads from importances (n,), summing to ``n * extra`` (b,) per row.

    Each head gets ``base_share * E + (1 - base_share) * n * E * w_h / sum(w)``; shares above the ``room``
    (b,) a head can hold are capped there and the excess goes to the uncapped heads in proportion to their
    shares (water filling); then largest-remainder rounding. Higher importance never gets fewer entries.
    """
    n = weights.shape[0]
    extra = extra.double()[:, None]  # (b, 1)
    room = room.double()[:, None]
    w = weights.double().to(extra.device)
    target = base_share * extra + (1.0 - base_share) * extra * n * (w / w.sum())[None, :]  # (b, n)
    x = target
    for _ in range(n):  # each round caps at least one more head; vectorised over rows
        excess = (x - room).clamp(min=0).sum(-1, keepdim=True)  # (b, 1)
        if not bool((excess > 1e-9).any()):
            break
        x = torch.minimum(x, room)
        free = torch.where(x < room - 1e-9, target, torch.zeros_like(target))
        x = x + excess * free / free.sum(-1, keepdim=True).clamp(min=1e-300)
    x = torch.minimum(x, room)
    return largest_remainder(x, extra[:, 0] * n)


@dataclass
class HeadKVAllocator(Allocator):
    """Per-head budgets from a head-importance profile (HeadKV), a base share split equally.

    For a row with budget ``B`` (protected entries included) and ``P`` protected entries, the entries beyond the
    window, ``E = B - P``, are split over the ``n`` KV heads of the layer as

        b_h = P + base_share * E + (1 - base_share) * n * E * w_h / sum_j w_j

    with ``w`` the layer's row of the profile, rounded by largest remainder so the layer keeps exactly
    ``n * B`` entries; a head never exceeds its row's length (the excess goes to the other heads).

    This is HeadKV's scheme (a fixed share per head, the rest of the pool in proportion to importance, the
    window added on top), with two choices of ours: the pool is per layer (``scope="layer"``) so each layer
    keeps ``h_kv * B`` entries like every other allocator, whereas HeadKV pools all heads of the model
    (``scope="model"``: each layer's total then follows its heads' importance, the model total is the same);
    and the base share is 0.2 (HeadKV's ``1 - 1/beta`` is 0.5%-50% depending on its ``beta``).

    Parameters
    ----------
    profile
        A ``HeadProfile`` of this model; ``None`` finds one for the model's config at first use
        (``load_profile``: the user's calibrated profiles, then those shipped with criticalkv).
    base_share
        Share of ``E`` every head gets whatever its importance, in [0, 1] (1 = uniform).
    scope
        ``"layer"`` (the pool is the layer's heads) or ``"model"`` (all heads of the full-attention layers).
    max_rank_imbalance
        Under tensor parallelism, no rank holds more than ``1 + max_rank_imbalance`` times the mean rank's
        entries of a layer (``criticalkv.distributed.cap_rank_imbalance``, which then gathers the scores: one
        ``all_gather`` per layer); None (default) leaves the budgets as they are. No effect on one process.

    Notes
    -----
    Under tensor parallelism each rank computes the budgets of every head of the layer from the profile (no
    communication: the profile, lengths and window are the same on every rank) and keeps its own heads'.

    Raises
    ------
    HeadProfileError
        The profile is for a model of another shape, has another number of KV heads than the layer, or no
        profile exists for this model.
    BudgetError
        A head's budget rounds to zero entries (raise the budget or ``base_share``).
    """

    profile: HeadProfile | None = None
    base_share: float = 0.2
    scope: str = "layer"
    max_rank_imbalance: float | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.base_share <= 1.0:
            raise ValueError(f"base_share must be in [0, 1], got {self.base_share}")
        if self.max_rank_imbalance is not None and not self.max_rank_imbalance >= 0:
            raise ValueError(f"max_rank_imbalance must be >= 0 or None, got {self.max_rank_imbalance}")
        if self.scope not in SCOPES:
            raise ValueError(f"scope must be one of {SCOPES}, got {self.scope!r}")
        self._resolved: dict[tuple, HeadProfile] = {}  # model shape -> checked profile (not a dataclass field)

    def profile_for(self, config: PretrainedConfig) -> HeadProfile:
        """The profile to use for a model config, checked against its shape (found once per shape)."""
        key = tuple(sorted(config_shape(config).items()))
        profile = self._resolved.get(key)
        if profile is None:
            profile = self.profile if self.profile is not None else load_profile(config)
            profile.check(config)
            self._resolved[key] = profile
        return profile

    def allocate(
        self,
        scores: torch.Tensor,
        row_budgets: torch.Tensor,
        view: LayerView,
        protected: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Per-head budgets (b, h_kv) long; scores (b, h_kv, t) are not needed, only their shape."""
        shard = head_shard(view)
        h = scores.shape[1] if shard is None else shard.total_heads  # every KV head of the layer
        module = view.module
        profile = self.profile_for(module.config)
        if h != profile.num_kv_heads:
            raise HeadProfileError(
                f"head profile {profile.name!r} has {profile.num_kv_heads} KV heads per layer, "
                f"layer {module.layer_idx} has {h}"
            )
        lengths = view.lengths
        budgets = torch.minimum(row_budgets.long(), lengths)  # (b,)
        n_protected = (protected & view.valid).sum(-1) if protected is not None else torch.zeros_like(lengths)
        window = torch.minimum(n_protected, budgets)  # P, at most B
        extra, room = budgets - window, lengths - window
        matrix = profile.matrix
        if self.scope == "layer":
            shares = head_shares(matrix[module.layer_idx], extra, room, self.base_share)
        else:
            position, _ = compressed_layer_position(module)
            pooled = matrix[full_attention_layers(module.config)].reshape(-1)  # (layers * h,)
            shares = head_shares(pooled, extra, room, self.base_share)[:, position * h : (position + 1) * h]
        out = window[:, None] + shares.to(window.device)
        starved = (out == 0) & (budgets > 0)[:, None]
        if bool(starved.any()):
            row, head = (int(i) for i in starved.nonzero()[0])
            raise BudgetError(
                f"HeadKV gives KV head {head} of layer {module.layer_idx} zero entries (row budget "
                f"{int(budgets[row])} per head): raise the budget or base_share (now {self.base_share})"
            )
        if shard is None:
            return out
        if self.max_rank_imbalance is not None:
            every = every_head(view, scores)  # (b, h_kv, t)
            out = cap_rank_imbalance(out, every, view.valid, protected, shard.size, self.max_rank_imbalance)
        return shard.local(out)
