"""Stage 2 of CriticalKV with float32 value norms, computed in full only where they decide the choice.

The projected value norm ``N_i = ||V_i W_O||_1`` is the costly part of CriticalKV's selection: a (t, d) x (d, G*hidden)
product per KV head. A screen brackets every norm between cheap bounds, settles every entry whose interval lies
clearly above or below the budget's threshold, and computes the float32 norm only for the entries it cannot settle.
The chosen set is the float32 selection's. Two brackets:

* ``"bfloat16"``: the norms from bfloat16 products, within a bound of the float32 ones. In bfloat16 products the
  norms cost less than half as much as in float32 where a device multiplies bfloat16 natively (CPUs with AVX512-BF16 or
  AMX, GPUs), and the bound (about 2^-6 of the norm) settles all but a few entries.
* ``"l2"`` (a CPU elsewhere): ``||x||_1 <= sqrt(hidden) ||x||_2``, and ``||V_i W^g||_2 = ||V_i F_g||_2`` for any
  ``F_g F_g^T = W^g W^g^T`` (from an eigendecomposition, once per weight): an upper bound from a (t, d) x (d, d)
  product per query head, hidden/d times cheaper than the norm, about 1.3 times the norm on real models. An upper
  bound alone settles nothing until some norms are known: the screen first computes the float32 norm of each head's
  ``ceil(L2_FIRST_ROUND * need)`` entries of highest upper bound, whose need-th largest score then rules out every
  entry whose upper bound lies below it, and computes the rest (about a third of the candidates at budget 0.2 on
  SmolLM2 and Qwen2.5-0.5B; ``benchmarks/norm_screen.py``).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable

import torch

from criticalkv.core.device import cpu_multiplies_bfloat16
from criticalkv.selectors import value_norm_amx
from criticalkv.selectors.base import add_top, largest, open_places
from criticalkv.selectors.value_norm import fused_kernel, projected_value_norm

# |N_bf16 - N_fp32| <= REL * N_bf16 + ABS_PER_DIM * d * M, with M = sum_j sum_k |V_k| |W_kj| (averaged over the group).
# bfloat16 rounds each product's result to within 2^-8 of it (its unit roundoff: 8 significant bits), so the L1 sums
# differ by at most about 2^-8 of N; the bracket's L1 sums are bfloat16 sums (``rounded_sums``: accumulated in float32,
# within hidden * 2^-24 of exact, far below 2^-8 for hidden < 2^13, then rounded once, within another 2^-8); both
# products accumulate d terms in float32 (each within d * 2^-24 * M of exact). So about 2^-7 of N in all, and the
# constants hold a margin of 2 and 8.
REL = 2.0**-6
ABS_PER_DIM = 2.0**-20
# cuBLAS may round partial sums of a bfloat16 product to bfloat16 unless told not to
# (torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction, on by default): each such rounding is within
# 2^-8 * M, and the constant covers two (a split of the d products in two; more splits are not bounded here).
ABS_REDUCED = 2.0**-7
# The l2 bracket's first round: each head's float32 norms for this many times its need, highest upper bounds first
# (1.5 computed the fewest norms in all on SmolLM2 2k and Qwen2.5-0.5B 4k needle prompts, against 1, 2 and 3).
L2_FIRST_ROUND = 1.5
# The l2 bracket pays off only when its first round leaves most candidates out (budget 0.2: about 15% of them).
L2_MOST_IN_FIRST_ROUND = 1 / 3
_UNIT = 2.0**-24  # float32's unit roundoff


def screen_kind(values: torch.Tensor, o_proj_weight: torch.Tensor) -> str | None:
    """Which bracket pays off for these values: ``"bfloat16"`` (bfloat16 values on a device with native bfloat16
    products), ``"l2"`` (any other values on a CPU whose float32 products are exact float32 ones), or None. None on
    a GPU with Triton and for bfloat16 values on a CPU with AMX: their fused kernels compute every float32 norm from
    the same bfloat16 products the bfloat16 bracket would (``value_norm_triton``, ``value_norm_amx``), so no bracket
    can save anything there."""
    on_cpu = values.device.type == "cpu"
    if (values.is_cuda and fused_kernel() is not None) or value_norm_amx.handles(values, o_proj_weight):
        return None
    if values.dtype == torch.bfloat16 and (values.is_cuda or (on_cpu and cpu_multiplies_bfloat16())):
        return "bfloat16"
    if on_cpu and cpu_multiplies_float32_exactly():
        return "l2"
    return None


def cpu_multiplies_float32_exactly() -> bool:
    """Whether torch multiplies float32 matrices on a CPU in float32 itself: oneDNN's matmul precision, from its most
    specific setting that is not "none" (``torch.backends.mkldnn.matmul.fp32_precision``, then ``mkldnn``'s, then
    ``torch.backends``'), is "ieee" or unset. "bf16" or "tf32" (also what ``set_float32_matmul_precision("high" /
    "medium")`` sets) round the products: no bound holds then. A torch without these settings reads the older one."""
    backends = torch.backends
    if not hasattr(backends.mkldnn, "matmul"):  # torch before the fp32_precision settings
        return torch.get_float32_matmul_precision() == "highest"
    for setting in (backends.mkldnn.matmul, backends.mkldnn, backends):
        value = getattr(setting, "fp32_precision", "none")
        if value != "none":
            return value == "ieee"
    return True


def norm_bounds(values: torch.Tensor, o_proj_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bfloat16 bracket: ``low <= N <= high`` for the float32 norms N, (b, h_kv, t) float32 each, from the
    bfloat16 norms N' and a bound on their distance to N (``|N' - N| <= slack``). values (b, h_kv, t, d) bfloat16;
    o_proj_weight (hidden, h_q * d)."""
    rough = projected_value_norm(values, o_proj_weight, compute_dtype=None, rounded_sums=True)
    slack = REL * rough + _abs_coefficient(values) * _abs_product_sum(values, o_proj_weight)
    return rough - slack, rough + slack


def l2_norm_bounds(values: torch.Tensor, o_proj_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The l2 bracket: ``0 <= N <= high`` for the norms N that ``projected_value_norm`` computes in float32,
    (b, h_kv, t) float32 each. values (b, h_kv, t, d); o_proj_weight (hidden, h_q * d).

    With ``y = V_i F_g`` and ``p = sum_k |V_ik| ||W^g_k||_2 <= ||V_i||_2 ||W^g||_F`` (F's rows have the norms of
    W^g's), float32 products put ``y`` within ``(d + 1) u p`` of exact (u = 2^-24; F rounded to float32 adds the 1,
    its float64 errors far less), its norm within ``d u`` of its own, and the float32 norm within
    ``hidden u N + d u sqrt(hidden) p`` of exact (``sum_j |V_i W^g_j|`` <= ``sqrt(hidden) p``), so
    ``N <= sqrt(hidden) mean_g (||y|| (1 + rel) + abs ||V_i||_2 ||W^g||_F)`` with ``rel = (d + hidden) u`` and
    ``abs = (2d + 1) u``, both taken 4 times over. Each row of V and each head's F are scaled to a largest entry
    of 1 first (the scales multiply back in float64), so nothing underflows in the bound; the norm's own products
    may (values near 1e-20 and below): each is then within 2^-126 of exact, and ``floor`` adds that for all of them.
    """
    b, h_kv, t, d = values.shape
    hidden = o_proj_weight.shape[0]
    # (h_kv, d, G * d) with largest entry 1 per KV head, that scale (h_kv,) float64, (h_kv,) mean_g ||W^g||_F / scale
    factors, factor_scale, frobenius = _l2_factors(o_proj_weight, h_kv, d)
    g = o_proj_weight.shape[1] // (h_kv * d)
    rel, abs_ = 4 * (d + hidden) * _UNIT, 4 * (2 * d + 1) * _UNIT
    floor = 4 * hidden * (2 * d + 1) * torch.finfo(torch.float32).tiny
    high = values.new_empty((b, h_kv, t), dtype=torch.float32)
    chunk = max(1, _L2_CHUNK_ELEMENTS // max(1, b * h_kv * factors.shape[-1]))
    for start in range(0, t, chunk):
        v = values[:, :, start : start + chunk].float()  # (b, h_kv, c, d)
        scale = v.abs().amax(-1)  # (b, h_kv, c)
        unit = v / scale.clamp(min=torch.finfo(torch.float32).tiny)[..., None]  # largest entry of each row: 1 (or 0)
        l2 = torch.matmul(unit, factors).view(b, h_kv, v.shape[2], g, -1).square().sum(-1).sqrt()  # (b, h_kv, c, G)
        bound = l2.mean(-1) * (1 + rel) + abs_ * unit.square().sum(-1).sqrt() * frobenius[:, None]  # (b, h_kv, c)
        scaled = bound.double() * scale.double() * factor_scale[:, None] * math.sqrt(hidden) + floor
        high[:, :, start : start + chunk] = scaled.float()
    return torch.zeros_like(high), high


BRACKETS: dict[str, Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]] = {
    "bfloat16": norm_bounds,
    "l2": l2_norm_bounds,
}
_L2_CHUNK_ELEMENTS = 512 * 1024  # as value_norm's CPU chunks: the (b, h_kv, c, G * d) product stays in cache


def first_round(kind: str, k: int, t: int) -> int | None:
    """How many norms per head the bracket ``kind`` computes before it settles anything (0 for the bfloat16 one),
    or None when the l2 bracket would compute most of the ``t`` norms anyway (a large need ``k``)."""
    if kind == "bfloat16":
        return 0
    first = math.ceil(L2_FIRST_ROUND * k)
    return first if first <= L2_MOST_IN_FIRST_ROUND * t else None


def take_top_by_value_norm(
    weights: torch.Tensor,
    bounds: tuple[torch.Tensor, torch.Tensor],
    values: torch.Tensor,
    o_proj_weight: torch.Tensor,
    keep: torch.Tensor,
    valid: torch.Tensor,
    need: torch.Tensor,
    k: int | None = None,
    first: int = 0,
) -> torch.Tensor:
    """``take_top(weights * N, keep, valid, need, k)`` with N the float32 ``projected_value_norm``, screened.

    weights (b, h_kv, t) float32, >= 0 on the candidates (stage 2's ``A + eps``); bounds: ``(low, high)`` norms
    (b, h_kv, t) float32 bracketing N (``BRACKETS``); values (b, h_kv, t, d); o_proj_weight (hidden, h_q * d);
    keep (b, h_kv, t) bool; valid (b, t) bool; need (b, h_kv) long; ``first``: each head's entries of highest
    upper bound whose norm is computed before anything is settled (``first_round``). Returns the new keep mask
    (b, h_kv, t) bool.
    """
    candidates, need = open_places(keep, valid, need)  # (b, h_kv, t), (b, h_kv)
    k = int(largest(need)) if k is None else k
    if k == 0:
        return keep
    low = (weights * bounds[0]).masked_fill(~candidates, float("-inf"))  # (b, h_kv, t)
    high = (weights * bounds[1]).masked_fill(~candidates, float("-inf"))
    ranking = torch.full_like(weights, float("-inf"))  # the float32 scores where computed
    computed = torch.zeros_like(candidates)
    if first:
        top = high.topk(min(first, high.shape[-1]), dim=-1).indices  # (b, h_kv, first)
        _rank_exactly(
            ranking,
            computed,
            torch.zeros_like(candidates).scatter_(-1, top, True) & candidates,
            weights,
            values,
            o_proj_weight,
        )
        low, high = torch.where(computed, ranking, low), torch.where(computed, ranking, high)
    sure_in, sure_out = _settled(low, high, need, k)
    ranking.masked_fill_(sure_in & ~computed, float("inf"))
    unsure = candidates & ~sure_in & ~sure_out & ~computed  # (b, h_kv, t)
    _rank_exactly(ranking, computed, unsure, weights, values, o_proj_weight)
    return add_top(ranking, keep, candidates, need, k)


def _rank_exactly(
    ranking: torch.Tensor,
    computed: torch.Tensor,
    wanted: torch.Tensor,
    weights: torch.Tensor,
    values: torch.Tensor,
    o_proj_weight: torch.Tensor,
) -> None:
    """Write ``weights * N`` (float32 N) into ``ranking`` and mark ``computed`` where ``wanted``; ranking
    (b, h_kv, t) float32, computed and wanted (b, h_kv, t) bool, in place."""
    h_kv = values.shape[1]
    if values.device.type == "cpu":  # head by head: none computes more norms than it wants
        heads = o_proj_weight.view(o_proj_weight.shape[0], h_kv, -1)  # (hidden, h_kv, G * d)
        for i, j in wanted.any(-1).nonzero().tolist():
            where = wanted[i, j].nonzero().squeeze(-1)  # (m,)
            norms = projected_value_norm(values[i, j, where][None, None], heads[:, j])  # (1, 1, m) float32
            ranking[i, j, where] = norms[0, 0] * weights[i, j, where]
    else:  # one product for every head (no loop of launches), each padded to the most any head wants
        m = int(wanted.sum(-1).max())
        if m:
            index = wanted.float().topk(m, dim=-1).indices  # (b, h_kv, m): each head's wanted positions first
            picked = torch.take_along_dim(values, index[..., None], dim=2)  # (b, h_kv, m, d)
            exact = projected_value_norm(picked, o_proj_weight) * weights.gather(-1, index)  # (b, h_kv, m)
            ranking.scatter_(-1, index, torch.where(wanted.gather(-1, index), exact, ranking.gather(-1, index)))
    computed |= wanted


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


def _abs_row_sums(o_proj_weight: torch.Tensor, h_kv: int, d: int) -> torch.Tensor:
    """sum_j |W^g_kj| averaged over the group's query heads g: (h_kv, d) float32, from o_proj_weight
    (hidden, h_q * d); kept per weight (``_per_weight``)."""

    def compute() -> torch.Tensor:
        hidden, g = o_proj_weight.shape[0], o_proj_weight.shape[1] // (h_kv * d)
        return o_proj_weight.float().abs().view(hidden, h_kv, g, d).sum(0).mean(1)  # (h_kv, d)

    return _per_weight(o_proj_weight, ("abs_row_sums", h_kv, d), compute)


def _l2_factors(o_proj_weight: torch.Tensor, h_kv: int, d: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For the l2 bracket, from o_proj_weight (hidden, h_q * d): each query head's F_g with ``F_g F_g^T = W^g W^g^T``
    (``U sqrt(L)`` from the Gram matrix's eigendecomposition in float64), side by side per KV head and scaled to a
    largest entry of 1, (h_kv, d, G * d) float32; that scale, (h_kv,) float64; and the group's mean Frobenius norm
    ``mean_g ||W^g||_F`` over the scale, (h_kv,) float32. Kept per weight (``_per_weight``)."""

    def compute() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden, g = o_proj_weight.shape[0], o_proj_weight.shape[1] // (h_kv * d)
        heads = o_proj_weight.double().view(hidden, h_kv, g, d).permute(1, 2, 3, 0)  # (h_kv, G, d, hidden): W^g
        gram = heads @ heads.transpose(-1, -2)  # (h_kv, G, d, d): W^g W^g^T, positive semi-definite
        eigenvalues, eigenvectors = torch.linalg.eigh(gram)  # (h_kv, G, d), (h_kv, G, d, d)
        factor = eigenvectors * eigenvalues.clamp(min=0).sqrt()[..., None, :]  # F F^T = gram: ||V F|| = ||V W^g||
        factors = factor.permute(0, 2, 1, 3).reshape(h_kv, d, g * d)  # (h_kv, d, G * d)
        scale = factors.abs().amax((1, 2)).clamp(min=torch.finfo(torch.float64).tiny)  # (h_kv,)
        frobenius = heads.square().sum((2, 3)).sqrt().mean(1) / scale  # (h_kv,)
        return (factors / scale[:, None, None]).float(), scale, frobenius.float()

    return _per_weight(o_proj_weight, ("l2_factors", h_kv, d), compute)


# id(weight) -> (a weak reference to it, what it was computed from, {what: derived tensors}): a model's o_proj
# weights do not change between prefills, so what the brackets derive from them is computed once, not in every
# prefill (each time a float32 copy of the weight: 64 MiB a layer for Llama-3-8B). A tensor as a dict key would
# compare elementwise.
_DERIVED: dict[int, tuple[weakref.ref, tuple, dict]] = {}


def _per_weight(weight: torch.Tensor, what: tuple, compute: Callable[[], object]):
    """``compute()``'s result for ``weight`` and ``what``, kept while the weight lives unchanged; computed again
    when it changes in place (its version) or is given other storage, dtype or device (``module.to``). An inference
    tensor has no version to tell, and ``torch.compile`` cannot trace the memo's bookkeeping (its weak finalizer):
    computed every time then."""
    if weight.is_inference() or torch.compiler.is_compiling():
        return compute()
    stamp = (weight._version, weight.data_ptr(), weight.dtype, weight.device)
    cached = _DERIVED.get(id(weight))
    if cached is None or cached[0]() is not weight or cached[1] != stamp:
        if cached is None:  # the entry goes with the weight
            weakref.finalize(weight, _DERIVED.pop, id(weight), None)
        cached = _DERIVED[id(weight)] = (weakref.ref(weight), stamp, {})
    if what not in cached[2]:
        with torch.no_grad():  # no graph: a kept graph would hold the weight alive
            cached[2][what] = compute()
    return cached[2][what]
