"""The projected value norm on a GPU in one Triton kernel: mean_g ||V_i W_O^g||_1 without the (t, G * hidden) product.

Each program takes a tile of one KV head's tokens, multiplies it by tiles of each query head's W_O^g slice on the
tensor cores (float32 accumulation) and sums the absolute values of each product tile on chip: only the (t,) norms
reach memory, against the G * hidden floats per token that ``value_norm``'s chunked products write and read back.
bfloat16 and float16 values times a weight of the same dtype give float32 products that are exact (8 + 8 or
11 + 11 significant bits fit in float32's 24), so the norms are the float32 reference's up to the order of the
sums; float32 values multiply in full float32 (no TF32). Tested on a CPU through Triton's interpreter
(``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# A tile of 64 tokens by 64 output features: tl.dot wants every side >= 16, and 64 x 64 float32 accumulators plus a
# (64, d) value tile fit one program's registers for head sizes up to 128.
BLOCK_TOKENS = 64
BLOCK_FEATURES = 64
#: Value dtypes the kernel multiplies on the tensor cores with a weight of the same dtype (exact float32 products).
TENSOR_CORE_DTYPES = (torch.bfloat16, torch.float16)


@triton.jit
def _value_norm_kernel(
    values,  # (b, h_kv, t, d)
    weight,  # (hidden, h_q * d)
    out,  # (b, h_kv, t) float32
    t,
    h_kv,
    groups,
    hidden,
    head_dim,
    stride_vb,
    stride_vh,
    stride_vt,
    stride_vd,
    stride_w_out,
    stride_w_in,
    stride_ob,
    stride_oh,
    stride_ot,
    BLOCK_T: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IEEE: tl.constexpr,
):
    tile = tl.program_id(0)
    batch_head = tl.program_id(1)
    b = batch_head // h_kv
    h = batch_head % h_kv
    rows = tile * BLOCK_T + tl.arange(0, BLOCK_T)  # (BLOCK_T,)
    dims = tl.arange(0, BLOCK_D)  # (BLOCK_D,): head_dim rounded up to a power of two, the rest masked to 0
    v_tile = tl.load(
        values + b * stride_vb + h * stride_vh + rows[:, None] * stride_vt + dims[None, :] * stride_vd,
        mask=(rows[:, None] < t) & (dims[None, :] < head_dim),
        other=0.0,
    )  # (BLOCK_T, BLOCK_D)
    if IEEE:
        v_tile = v_tile.to(tl.float32)
    total = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for g in range(groups):
        first_column = (h * groups + g) * head_dim  # query head g's slice W_O^g: columns first .. first + d
        for start in range(0, hidden, BLOCK_J):
            features = start + tl.arange(0, BLOCK_J)  # (BLOCK_J,)
            w_tile = tl.load(
                weight + features[None, :] * stride_w_out + (first_column + dims)[:, None] * stride_w_in,
                mask=(features[None, :] < hidden) & (dims[:, None] < head_dim),
                other=0.0,
            )  # (BLOCK_D, BLOCK_J): W_O^g[:, start : start + BLOCK_J]
            if IEEE:
                product = tl.dot(v_tile, w_tile.to(tl.float32), input_precision="ieee")  # (BLOCK_T, BLOCK_J)
            else:
                product = tl.dot(v_tile, w_tile, out_dtype=tl.float32)
            total += tl.sum(tl.abs(product), axis=1)
    tl.store(out + b * stride_ob + h * stride_oh + rows * stride_ot, total / groups, mask=rows < t)


def fused_projected_value_norm(values: torch.Tensor, o_proj_weight: torch.Tensor) -> torch.Tensor:
    """``value_norm.projected_value_norm(values, o_proj_weight)`` (float32 products, group mean) in one kernel:
    (b, h_kv, t) float32. values (b, h_kv, t, d); o_proj_weight (hidden, h_q * d), on the values' device."""
    b, h_kv, t, d = values.shape
    hidden, in_features = o_proj_weight.shape
    if in_features % (h_kv * d):
        raise ValueError(f"o_proj takes {in_features} inputs, not a multiple of {h_kv} KV heads x head_dim {d}")
    out = torch.empty((b, h_kv, t), dtype=torch.float32, device=values.device)
    if out.numel() == 0:
        return out
    # exact float32 products on the tensor cores only for a 16-bit dtype shared by both operands
    ieee = values.dtype not in TENSOR_CORE_DTYPES or o_proj_weight.dtype != values.dtype
    grid = (triton.cdiv(t, BLOCK_TOKENS), b * h_kv)
    _value_norm_kernel[grid](
        values,
        o_proj_weight,
        out,
        t,
        h_kv,
        in_features // (h_kv * d),
        hidden,
        d,
        *values.stride(),
        *o_proj_weight.stride(),
        *out.stride(),
        BLOCK_T=BLOCK_TOKENS,
        BLOCK_J=BLOCK_FEATURES,
        BLOCK_D=max(16, triton.next_power_of_2(d)),
        IEEE=ieee,
    )
    return out
