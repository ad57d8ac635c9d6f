"""Stage 2 of CriticalKV with float32 value norms, computed in full only where they decide the choice.

The projected value norm ``N_i = ||V_i W_O||_1`` is the costly part of CriticalKV's selection: a (t, d) x (d, G*hidden)
product per KV head. In bfloat16 products it costs about half as much as in float32 (CPUs with AVX512-BF16 or AMX,
GPUs), but rounds every product to 8 significant bits. The screen computes the bfloat16 norms with a bound on their
distance to the float32 ones, settles every entry whose interval lies clearly above or below the budget's threshold,
and recomputes in float32 only the few it cannot settle. The chosen set is the float32 selection's.
"""

from __future__ import annotations

import weakref

import torch

from criticalkv.selectors.base import add_top, largest, open_places
from criticalkv.selectors.value_norm import projected_value_norm

# |N_bf16 - N_fp32| <= REL * N_bf16 + ABS_PER_DIM * d * M, with M = sum_j sum_k |V_k| |W_kj| (averaged over the group).
# bfloat16 rounds each product's result to within 2^-9 of it, so the L1 sums differ by at most about 2^-9 of N;
# both products accumulate d terms in float32 (each within d * 2^-24 * M of exact) and sum `hidden` values in
# float32 (within hidden * 2^-24 of N, far below 2^-9 for hidden < 2^13). The constants hold a margin of 4 and 8.
REL = 2.0**-7
ABS_PER_DIM = 2.0**-20
# cuBLAS may round partial sums of a bfloat16 product to bfloat16 unless told not to
# (torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction): then each is within 2^-9 * M.
ABS_REDUCED = 2.0**-7


def screens(values: torch.Tensor) -> bool:
    """Whether the screen pays off: bfloat16 values on a device with native bfloat16 products."""
    if values.dtype != torch.bfloat16:
        return False
    if values.is_cuda:
        return True
    return values.device.type == "cpu" and cpu_multiplies_bfloat16()


def cpu_multiplies_bfloat16() -> bool:
    """AVX512-BF16 or AMX, as torch reports them (private helpers: a torch without them counts as neither)."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)


def norm_bounds(values: torch.Tensor, o_proj_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The norms from bfloat16 products, N', and a bound on their distance to the float32 norms N:
    (b, h_kv, t) float32 each, with ``|N' - N| <= slack``. values (b, h_kv, t, d); o_proj_weight (hidden, h_q * d)."""
    rough = projected_value_norm(values, o_proj_weight, compute_dtype=None)
    return rough, REL * rough + _abs_coefficient(values) * _abs_product_sum(values, o_proj_weight)


def take_top_by_value_norm(
    weights: torch.Tensor,
    bounds: tuple[torch.Tensor, torch.Tensor],
    values: torch.Tensor,
    o_proj_weight: torch.Tensor,
    keep: torch.Tensor,
    valid: torch.Tensor,
    need: torch.Tensor,
    k: int | None = None,
) -> torch.Tensor:
    """``take_top(weights * N, keep, valid, need, k)`` with N the float32 ``projected_value_norm``, screened.

    weights (b, h_kv, t) float32, >= 0 on the candidates (stage 2's ``A + eps``); bounds: ``norm_bounds(values,
    o_proj_weight)``; values (b, h_kv, t, d) bfloat16; o_proj_weight (hidden, h_q * d); keep (b, h_kv, t) bool;
    valid (b, t) bool; need (b, h_kv) long. Returns the new keep mask (b, h_kv, t) bool.
    """
    candidates, need = open_places(keep, valid, need)  # (b, h_kv, t), (b, h_kv)
    k = int(largest(need)) if k is None else k
    if k == 0:
        return keep
    rough, slack = bounds
    low = (weights * (rough - slack)).masked_fill(~candidates, float("-inf"))  # (b, h_kv, t)
    high = (weights * (rough + slack)).masked_fill(~candidates, float("-inf"))
    sure_in, sure_out = _settled(low, high, need, k)
    unsure = candidates & ~sure_in & ~sure_out  # (b, h_kv, t)
    ranking = torch.full_like(weights, float("-inf")).masked_fill_(sure_in, float("inf"))
    m = int(unsure.sum(-1).max())
    if m:
        # the unsure positions of each head first (padded with settled ones, written back unchanged)
        index = unsure.float().topk(m, dim=-1).indices  # (b, h_kv, m)
        picked = torch.take_along_dim(values, index[..., None], dim=2)  # (b, h_kv, m, d)
        exact = projected_value_norm(picked, o_proj_weight) * weights.gather(-1, index)  # (b, h_kv, m) float32
        exact = torch.where(unsure.gather(-1, index), exact, ranking.gather(-1, index))
        ranking.scatter_(-1, index, exact)
    return add_top(ranking, keep, candidates, need, k)


def _settled(low: torch.Tensor, high: torch.Tensor, need: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Entries certainly among each head's ``need`` best, and certainly not: (b, h_kv, t) bool each.

    An entry whose upper bound lies below the need-th largest lower bound has ``need`` entries above it: out. One
    whose lower bound lies above the (need+1)-th largest upper bound can be passed only by entries whose upper
    bound exceeds that, at most ``need - 1`` others: in.
    """
    t = low.shape[-1]
    top_low = low.topk(min(k, t), dim=-1).values  # (b, h_kv, k) sorted, best first
    top_high = high.topk(min(k + 1, t), dim=-1).values  # (b, h_kv, k+1)
    nth_low = top_low.gather(-1, (need - 1).clamp(min=0)[..., None])  # (b, h_kv, 1)
    nth_low = nth_low.masked_fill((need == 0)[..., None], float("inf"))
    beyond = need[..., None].clamp(max=top_high.shape[-1] - 1)
    next_high = top_high.gather(-1, beyond).masked_fill((need[..., None] >= top_high.shape[-1]), float("-inf"))
    return low > next_high, high < nth_low


def _abs_coefficient(values: torch.Tensor) -> float:
    """The factor of M in the bound on |N_bf16 - N_fp32| (see REL above)."""
    if values.is_cuda and torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction:
        return ABS_REDUCED
    return ABS_PER_DIM * values.shape[-1]


def _abs_product_sum(values: torch.Tensor, o_proj_weight: torch.Tensor) -> torch.Tensor:
    """M_i = mean over the group's query heads g of sum_j sum_k |V_ik| |W^g_kj|: (b, h_kv, t) float32."""
    row_sums = _abs_row_sums(o_proj_weight, values.shape[1], values.shape[3])  # (h_kv, d)
    return torch.matmul(values.float().abs(), row_sums[..., None]).squeeze(-1)  # (b, h_kv, t)


# id(weight) -> (a weak reference to it, what it was computed from, the row sums): a model's o_proj weights
# do not change between prefills, so their absolute row sums are computed once, not in every prefill (each time a
# float32 copy of the weight: 64 MiB a layer for Llama-3-8B). A tensor as a dict key would compare elementwise.
_ROW_SUMS: dict[int, tuple[weakref.ref, tuple, torch.Tensor]] = {}


def _abs_row_sums(o_proj_weight: torch.Tensor, h_kv: int, d: int) -> torch.Tensor:
    """sum_j |W^g_kj| averaged over the group's query heads g: (h_kv, d) float32, from o_proj_weight
    (hidden, h_q * d); computed again when the weight changes in place (its version) or is given other storage,
    dtype or device (``module.to``). An inference tensor has no version to tell: its sums are computed every time."""

    def compute() -> torch.Tensor:
        hidden, g = o_proj_weight.shape[0], o_proj_weight.shape[1] // (h_kv * d)
        with torch.no_grad():  # no graph: a kept graph would hold the weight alive
            return o_proj_weight.float().abs().view(hidden, h_kv, g, d).sum(0).mean(1)  # (h_kv, d)

    if o_proj_weight.is_inference():
        return compute()
    stamp = (o_proj_weight._version, o_proj_weight.data_ptr(), o_proj_weight.dtype, o_proj_weight.device, h_kv, d)
    cached = _ROW_SUMS.get(id(o_proj_weight))
    if cached is not None and cached[0]() is o_proj_weight and cached[1] == stamp:
        return cached[2]
    row_sums = compute()
    if cached is None:  # the entry goes with the weight
        weakref.finalize(o_proj_weight, _ROW_SUMS.pop, id(o_proj_weight), None)
    _ROW_SUMS[id(o_proj_weight)] = (weakref.ref(o_proj_weight), stamp, row_sums)
    return row_sums
