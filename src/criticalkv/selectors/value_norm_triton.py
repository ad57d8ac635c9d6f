"""The projected value norm on a GPU in one Triton kernel: mean_g ||V_i W_O^g||_1 without the (t, G * hidden) product.

Each program takes a tile of one KV head's tokens and walks over (query head g, feature tile) pairs in one flat loop
(so Triton pipelines the weight loads): it multiplies the value tile by the tile of W_O^g on the tensor cores with
float32 accumulation, adds the absolute values of the product to a register accumulator of the tile's shape, and
reduces that accumulator once at the end: only the (t,) norms reach memory, against the G * hidden floats per token
that ``value_norm``'s chunked products write and read back. bfloat16 and float16 values times a weight of the same
dtype give float32 products that are exact (8 + 8 or 11 + 11 significant bits fit in float32's 24), so the norms
are the float32 reference's up to the order of the sums; float32 values multiply in full float32 (no TF32).

The tile sizes are tuned per (hidden, head_dim, groups, dtype) on the first call, among ``CONFIGS``, and the choice
is kept in Triton's cache. Every config is tested on a CPU through Triton's interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Value dtypes the kernel multiplies on the tensor cores with a weight of the same dtype (exact float32 products).
TENSOR_CORE_DTYPES = (torch.bfloat16, torch.float16)
#: Tile sizes (tokens x output features), warps and pipeline stages tried: tl.dot wants every side >= 16; the
#: float32 accumulator of a tile and the product being added to it share one program's registers.
CONFIGS = [
    triton.Config({"BLOCK_T": 64, "BLOCK_J": 64}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_T": 128, "BLOCK_J": 64}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_T": 128, "BLOCK_J": 64}, num_warps=8, num_stages=4),
    triton.Config({"BLOCK_T": 128, "BLOCK_J": 128}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_T": 256, "BLOCK_J": 64}, num_warps=8, num_stages=3),
]


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
    BLOCK_D: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_J: tl.constexpr,
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
    feature_tiles = tl.cdiv(hidden, BLOCK_J)
    total = tl.zeros((BLOCK_T, BLOCK_J), dtype=tl.float32)
    for step in range(groups * feature_tiles):  # (query head g, feature tile) pairs, flat
        g = step // feature_tiles
        features = (step % feature_tiles) * BLOCK_J + tl.arange(0, BLOCK_J)  # (BLOCK_J,)
        first_column = (h * groups + g) * head_dim  # query head g's slice W_O^g: columns first .. first + d
        w_tile = tl.load(
            weight + features[None, :] * stride_w_out + (first_column + dims)[:, None] * stride_w_in,
            mask=(features[None, :] < hidden) & (dims[:, None] < head_dim),
            other=0.0,
        )  # (BLOCK_D, BLOCK_J): a tile of W_O^g's columns
        if IEEE:
            product = tl.dot(v_tile, w_tile.to(tl.float32), input_precision="ieee")  # (BLOCK_T, BLOCK_J)
        else:
            product = tl.dot(v_tile, w_tile, out_dtype=tl.float32)
        total += tl.abs(product)
    norms = tl.sum(total, axis=1) / groups  # (BLOCK_T,)
    tl.store(out + b * stride_ob + h * stride_oh + rows * stride_ot, norms, mask=rows < t)


_tuned_kernel = triton.autotune(CONFIGS, key=["hidden", "head_dim", "groups", "IEEE"], cache_results=True)(
    _value_norm_kernel
)


def fused_projected_value_norm(
    values: torch.Tensor, o_proj_weight: torch.Tensor, config: triton.Config | None = None
) -> torch.Tensor:
    """``value_norm.projected_value_norm(values, o_proj_weight)`` (float32 products, group mean) in one kernel:
    (b, h_kv, t) float32. values (b, h_kv, t, d); o_proj_weight (hidden, h_q * d), on the values' device. ``config``
    (one of ``CONFIGS``) skips the tuning: the tests run every config, benchmarks time each."""
    b, h_kv, t, d = values.shape
    hidden, in_features = o_proj_weight.shape
    if in_features % (h_kv * d):
        raise ValueError(f"o_proj takes {in_features} inputs, not a multiple of {h_kv} KV heads x head_dim {d}")
    out = torch.empty((b, h_kv, t), dtype=torch.float32, device=values.device)
    if out.numel() == 0:
        return out
    # exact float32 products on the tensor cores only for a 16-bit dtype shared by both operands
    ieee = values.dtype not in TENSOR_CORE_DTYPES or o_proj_weight.dtype != values.dtype
    arguments = (values, o_proj_weight, out, t, h_kv, in_features // (h_kv * d), hidden, d)
    arguments += (*values.stride(), *o_proj_weight.stride(), *out.stride())
    block_d = max(16, triton.next_power_of_2(d))

    def grid(meta: dict) -> tuple[int, int]:  # the tile size is the tuner's choice or the config's
        return (triton.cdiv(t, meta["BLOCK_T"]), b * h_kv)

    if config is None:
        _tuned_kernel[grid](*arguments, BLOCK_D=block_d, IEEE=ieee)
    else:
        options = {"num_warps": config.num_warps, "num_stages": config.num_stages, **config.kwargs}
        _value_norm_kernel[grid](*arguments, BLOCK_D=block_d, IEEE=ieee, **options)
    return out
