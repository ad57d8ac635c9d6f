"""The projected value norm of CriticalKV: N_i = ||V_i W_O^h||_1, averaged over the query heads of a GQA group."""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable

import torch
from torch import nn

from criticalkv.errors import UnsupportedModelError
from criticalkv.models.families import attention_modules
from criticalkv.selectors import value_norm_amx

#: The dtypes of an output projection weight that is W_O itself (a quantized one holds codes and scales apart).
PLAIN_WEIGHT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# Largest product built at once, in elements. On a CPU a (rows, hidden) one of 2 MiB in float32: it stays in cache,
# and bounds the memory of long contexts. On a GPU a (b, h_kv, rows, hidden) one of 256 MiB: every chunk costs a few
# kernel launches, and with CPU-sized chunks an 8B model at 32k tokens would launch hundreds of thousands of products.
_CHUNK_ELEMENTS = 512 * 1024
_CHUNK_ELEMENTS_CUDA = 64 * 1024 * 1024
# On a CPU a product per KV head and query head (False: one for all, as on a GPU; benchmarks count a GPU's operators).
_PER_HEAD_PRODUCTS_ON_CPU = True
# Fewest rows a product is computed with: on a CPU the norms of a row then come out the same bits whether the row is
# computed among all of a head's or among a few gathered ones (the value-norm screen; tests/test_norm_screen.py).
_MIN_ROWS = 16


@functools.cache
def fused_kernel() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """The Triton kernel of the float32 norms on a GPU (``value_norm_triton``), None where triton is not installed
    (torch's CUDA wheels ship it): the chunked products below then, the same norms at several times the memory
    traffic."""
    if importlib.util.find_spec("triton") is None:
        return None
    from criticalkv.selectors.value_norm_triton import fused_projected_value_norm

    return fused_projected_value_norm


def check_output_projections(model: nn.Module, who: str) -> None:
    """Refuse a model whose attention output projections do not hold W_O as a plain floating-point weight that ``who``
    (a selector reading ||V W_O||) can multiply: quantized (int8, packed 4-bit, float8 with its scales apart) or
    offloaded (on the meta device). The norms read from it would be wrong, with no error."""
    for module in attention_modules(model):
        weight = getattr(module.o_proj, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dtype in PLAIN_WEIGHT_DTYPES and not weight.is_meta:
            continue
        held = "no weight" if not isinstance(weight, torch.Tensor) else f"a {weight.dtype} weight on {weight.device}"
        raise UnsupportedModelError(
            f"{who} reads the attention output projection W_O (the value norm ||V W_O||_1), and layer "
            f"{module.layer_idx}'s o_proj ({type(module.o_proj).__name__}) holds {held}: a quantized or offloaded "
            "weight is not W_O. Load the model unquantized and on one device, or use a method without value norms "
            "(snapkv, adakv, headkv, ...)"
        )


def projected_value_norm(
    values: torch.Tensor,
    o_proj_weight: torch.Tensor,
    compute_dtype: torch.dtype | None = torch.float32,
    per_head: bool = False,
    rounded_sums: bool = False,
) -> torch.Tensor:
    """||V_i W_O^g||_1 averaged over the G query heads g that share each KV head: (b, h_kv, t) float32.

    With ``per_head`` the G norms are returned unaveraged: (b, h_kv, G, t) float32.

    Parameters
    ----------
    values
        (b, h_kv, t, d) value states of one layer.
    o_proj_weight
        (hidden, h_q * d) weight of the layer's output projection; query head g's slice W_O^g is the d input
        columns g*d .. (g+1)*d, i.e. a (d, hidden) matrix. No bias enters the norm.
    compute_dtype
        dtype of the product V W_O (float32 by default; None uses the values' own dtype, as kvpress does, which
        is about twice as fast in bfloat16 on CPUs with AMX). The L1 sum is always accumulated in float32. On a
        GPU the float32 group mean comes from one Triton kernel (``value_norm_triton``), and bfloat16 values on a
        CPU with AMX give the float32 norms from one C kernel (``value_norm_amx``): neither writes the
        (t, G * hidden) product out.
    rounded_sums
        Sum each query head's L1 norm in the compute dtype: torch accumulates a bfloat16 sum in float32 and rounds
        the result once (to within 2^-8 of it), and on a CPU that sum is much cheaper than a float32 sum of the same
        bfloat16 terms. For the screen's bracket (``norm_screen``), whose bound covers that rounding.
    """
    b, h_kv, t, d = values.shape
    hidden, in_features = o_proj_weight.shape
    if in_features % (h_kv * d):
        raise ValueError(f"o_proj takes {in_features} inputs, not a multiple of {h_kv} KV heads x head_dim {d}")
    if values.is_cuda and compute_dtype == torch.float32 and not per_head and fused_kernel() is not None:
        return fused_kernel()(values, o_proj_weight)
    if compute_dtype == torch.float32 and value_norm_amx.handles(values, o_proj_weight):
        norms = value_norm_amx.amx_kernel()(values, o_proj_weight)  # (b, h_kv, t, G) float32
        return norms.transpose(-1, -2) if per_head else norms.mean(-1)
    g = in_features // (h_kv * d)
    dtype = values.dtype if compute_dtype is None else compute_dtype
    # (hidden, h_kv, G, d) -> (h_kv, G, d, hidden): query head g's W^g, a (d, hidden) matrix
    w = o_proj_weight.to(dtype).view(hidden, h_kv, g, d).permute(1, 2, 3, 0)
    if values.is_cuda or not _PER_HEAD_PRODUCTS_ON_CPU:  # every row and KV head in one product: few launches
        rows = max(1, _CHUNK_ELEMENTS_CUDA // max(1, b * h_kv * hidden))
        heads: list[tuple[int | slice, int | slice]] = [(slice(None), slice(None))]
    else:  # a (rows, d) x (d, hidden) product per row, KV head and query head: on CPUs faster than batched ones
        rows = max(_MIN_ROWS, _CHUNK_ELEMENTS // hidden)
        heads = [(i, j) for i in range(b) for j in range(h_kv)]
    norms = values.new_empty((b, h_kv, t, g), dtype=torch.float32)  # the group's mean over the last dimension
    for i, j in heads:
        for start in range(0, t, rows):
            v = values[i, j, start : start + rows].to(dtype)  # (c, d), or (b, h_kv, c, d) in one product
            c = v.shape[-2]
            if c < _MIN_ROWS:  # a short product may take another kernel (one row: a matrix-vector one) that sums
                # in another order: padded with zero rows, a row is computed as in a long product, whatever its company
                v = torch.cat([v, v.new_zeros(*v.shape[:-2], _MIN_ROWS - c, d)], dim=-2)
            for k in range(g):
                # abs in place + sum: about 3x faster than linalg.vector_norm(ord=1) on CPU; sums accumulate in float32
                terms = torch.matmul(v, w[j, k])[..., :c, :].abs_()  # (c, hidden) or (b, h_kv, c, hidden)
                sums = terms.sum(-1).float() if rounded_sums else terms.sum(-1, dtype=torch.float32)
                norms[i, j, start : start + c, k] = sums
    return norms.transpose(-1, -2) if per_head else norms.mean(-1)
