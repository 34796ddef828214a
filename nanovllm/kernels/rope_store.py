"""Per-head q/k RMSNorm, rotary embedding and the KV-cache store, fused into one Triton kernel.

In a decode step each of these is a tiny kernel whose cost is its launch, and a layer runs them back to
back: norm+rotary of q and k (two kernels under torch.compile), then the store of k and v. Here one
program per token does all of it for all of the token's heads at once (one program per (token, head),
as before, ran 24 one-warp programs a token, and took ~15 us a layer at 500 decode rows on the H200):

    query head:  q_out = rotate(norm(q) * q_weight)
    key head:    k_out = rotate(norm(k) * k_weight); k_cache[slot] = k_out; v_cache[slot] = v

with rotate(x) = x * cos[pos] + rotate_half(x) * sin[pos] (neox style, cos/sin tables in float32) and
the norm skipped for models without q/k norm (HAS_NORM=False). Everything is computed in float32 and
rounded once. Slot -1 (padding) stores nothing; k_out is still written, for backends that attend over
the step's own keys. The cache layout is nanovllm.kernels.common's.

An fp8 (e4m3) cache stores k / k_scale and v / v_scale, clamped to e4m3's range; the attention kernels
multiply the scales back in (nanovllm.kernels.common.FP8_MAX). An int8 cache stores each (token, KV head)
row quantized with a scale of its own, into the cache and its scales (common.quantize_int8_rows).
"""

import torch
import triton
import triton.language as tl

from nanovllm.kernels.common import FP8_MAX, check_cache_dtype, check_cache_scales, quantize_int8_rows

# A program's warps: enough that its query tile is ~ELEMENTS_PER_WARP float32 values a warp.
ELEMENTS_PER_WARP = 512
MAX_NUM_WARPS = 8


@triton.jit
def normed_rotated_rows(row_ptrs, row_mask, weight_ptr, cos_row_ptr, sin_row_ptr, eps, HEAD_DIM: tl.constexpr,
                        BLOCK_D: tl.constexpr, HAS_NORM: tl.constexpr):
    """Several heads (rows at row_ptrs, masked by row_mask) after the optional RMSNorm and the rotation:
    [rows, BLOCK_D] in float32, BLOCK_D >= HEAD_DIM a power of two (columns past HEAD_DIM are zero).
    Element d takes its rotate_half partner (d + HEAD_DIM/2 modulo HEAD_DIM) from a second load, so the
    rows stay whole."""
    half: tl.constexpr = HEAD_DIM // 2
    offs = tl.arange(0, BLOCK_D)
    d_mask = offs < HEAD_DIM
    partner = tl.where(offs < half, offs + half, offs - half)
    mask = row_mask[:, None] & d_mask[None, :]
    x = tl.load(row_ptrs[:, None] + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(row_ptrs[:, None] + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        rstd = tl.rsqrt(tl.sum(x * x, 1) / HEAD_DIM + eps)[:, None]
        x = x * rstd * tl.load(weight_ptr + offs, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        xp = xp * rstd * tl.load(weight_ptr + partner, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    cos = tl.load(cos_row_ptr + offs, mask=d_mask, other=0.0)[None, :]
    sin = tl.load(sin_row_ptr + offs, mask=d_mask, other=0.0)[None, :]
    # rotate_half(x) = [-x2, x1]: the first half takes minus its partner.
    return x * cos + tl.where((offs < half)[None, :], -xp, xp) * sin


@triton.jit
def _norm_rope_store_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    q_out_ptr,  # [T, NUM_HEADS, HEAD_DIM], contiguous
    k_out_ptr,  # [T, NUM_KV_HEADS, HEAD_DIM], contiguous
    k_cache_ptr,
    v_cache_ptr,
    k_scales_ptr,  # an int8 cache's per-token scales (unread for other caches)
    v_scales_ptr,
    positions_ptr,
    slot_mapping_ptr,
    cos_ptr,  # [max_position, HEAD_DIM] float32, contiguous
    sin_ptr,
    q_weight_ptr,
    k_weight_ptr,
    q_eps,
    k_eps,
    k_scale_inv,  # 1 / k_scale: only with QUANT
    v_scale_inv,
    q_stride_t,
    q_stride_h,
    k_stride_t,
    k_stride_h,
    v_stride_t,
    v_stride_h,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,  # powers of two >= NUM_HEADS, NUM_KV_HEADS, HEAD_DIM
    BLOCK_KV: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_NORM: tl.constexpr,
    QUANT: tl.constexpr,  # the cache is fp8 (store scaled and clamped) or int8 (store quantized per row)
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    cos_row, sin_row = cos_ptr + pos * HEAD_DIM, sin_ptr + pos * HEAD_DIM
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM

    heads = tl.arange(0, BLOCK_H)
    h_mask = heads < NUM_HEADS
    q = normed_rotated_rows(q_ptr + token * q_stride_t + heads * q_stride_h, h_mask, q_weight_ptr, cos_row,
                            sin_row, q_eps, HEAD_DIM, BLOCK_D, HAS_NORM)
    q_dst = q_out_ptr + (token * NUM_HEADS + heads[:, None]) * HEAD_DIM + offs_d[None, :]
    tl.store(q_dst, q.to(q_out_ptr.dtype.element_ty), mask=h_mask[:, None] & d_mask[None, :])

    kv_heads = tl.arange(0, BLOCK_KV)
    kv_mask = (kv_heads < NUM_KV_HEADS)[:, None] & d_mask[None, :]
    key = normed_rotated_rows(k_ptr + token * k_stride_t + kv_heads * k_stride_h, kv_heads < NUM_KV_HEADS,
                              k_weight_ptr, cos_row, sin_row, k_eps, HEAD_DIM, BLOCK_D, HAS_NORM)
    k_rounded = key.to(k_out_ptr.dtype.element_ty)
    k_dst = k_out_ptr + (token * NUM_KV_HEADS + kv_heads[:, None]) * HEAD_DIM + offs_d[None, :]
    tl.store(k_dst, k_rounded, mask=kv_mask)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:
        cache = slot * (NUM_KV_HEADS * HEAD_DIM) + kv_heads[:, None] * HEAD_DIM + offs_d[None, :]
        value = tl.load(v_ptr + token * v_stride_t + kv_heads[:, None] * v_stride_h + offs_d[None, :],
                        mask=kv_mask, other=0.0)
        cache_ty = k_cache_ptr.dtype.element_ty
        if QUANT and cache_ty == tl.int8:
            # The float32 key, as fp8's below: rounded once, to int8 (masked lanes are 0: no amax).
            k_values, k_scales = quantize_int8_rows(key)
            v_values, v_scales = quantize_int8_rows(value.to(tl.float32))
            tl.store(k_cache_ptr + cache, k_values, mask=kv_mask)
            tl.store(v_cache_ptr + cache, v_values, mask=kv_mask)
            scale_offs = slot * NUM_KV_HEADS + kv_heads
            tl.store(k_scales_ptr + scale_offs, k_scales, mask=kv_heads < NUM_KV_HEADS)
            tl.store(v_scales_ptr + scale_offs, v_scales, mask=kv_heads < NUM_KV_HEADS)
        elif QUANT:
            tl.store(k_cache_ptr + cache, tl.clamp(key * k_scale_inv, -FP8_MAX, FP8_MAX).to(cache_ty),
                     mask=kv_mask)
            scaled_v = tl.clamp(value.to(tl.float32) * v_scale_inv, -FP8_MAX, FP8_MAX)
            tl.store(v_cache_ptr + cache, scaled_v.to(cache_ty), mask=kv_mask)
        else:
            tl.store(k_cache_ptr + cache, k_rounded, mask=kv_mask)
            tl.store(v_cache_ptr + cache, value, mask=kv_mask)


def check_rope_args(q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping, norm_weights) -> None:
    num_tokens, _, head_dim = q.shape
    if k.dim() != 3 or k.shape != v.shape or k.shape[0] != num_tokens or k.shape[2] != head_dim:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} must be "
                         "[num_tokens, heads, head_dim] with k and v alike")
    if head_dim % 2:
        raise ValueError(f"rotary embedding needs an even head_dim; got {head_dim}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("q, k and v need a contiguous last (head_dim) dimension; other dims may be strided")
    if positions.shape != (num_tokens,) or slot_mapping.shape != (num_tokens,):
        raise ValueError(f"positions {tuple(positions.shape)} and slot_mapping {tuple(slot_mapping.shape)} "
                         f"must have one entry per token ({num_tokens})")
    tables_ok = cos.shape == sin.shape and cos.dim() == 2 and cos.shape[1] == head_dim
    tables_ok = tables_ok and cos.dtype == sin.dtype == torch.float32
    if not (tables_ok and cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError(f"cos/sin tables must be contiguous float32 [max_position, {head_dim}]")
    caches_ok = k_cache.shape == v_cache.shape and k_cache.dim() == 4 and k_cache.shape[2:] == k.shape[1:]
    if not (caches_ok and k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(f"caches {tuple(k_cache.shape)}/{tuple(v_cache.shape)} must both be contiguous "
                         f"[num_blocks, block_size, {k.shape[1]}, {head_dim}]")
    if len({q.dtype, k.dtype, v.dtype}) != 1:
        raise ValueError(f"q, k and v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    check_cache_dtype(q.dtype, k_cache, v_cache)
    if any(w is not None and w.shape != (head_dim,) for w in norm_weights):
        raise ValueError(f"q/k norm weights must be [{head_dim}]")


def norm_rope_store(
    q: torch.Tensor,  # [T, num_heads, head_dim]; may be a strided slice of a fused qkv output
    k: torch.Tensor,  # [T, num_kv_heads, head_dim]
    v: torch.Tensor,  # [T, num_kv_heads, head_dim]
    positions: torch.Tensor,  # [T]
    cos: torch.Tensor,  # [max_position, head_dim] float32
    sin: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T], -1 = padding (not stored)
    q_norm: tuple[torch.Tensor, float] | None = None,  # (weight [head_dim], eps); both norms or neither
    k_norm: tuple[torch.Tensor, float] | None = None,
    k_scale: float = 1.0,  # an fp8 cache holds k / k_scale and v / v_scale
    v_scale: float = 1.0,
    k_scales: torch.Tensor | None = None,  # an int8 cache's [num_blocks, block_size, num_kv_heads] float32
    v_scales: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns the rotated (q, k), both contiguous, and writes k and v into the cache at slot_mapping.
    No host sync, so it can run inside a captured CUDA graph."""
    if (q_norm is None) != (k_norm is None):
        raise ValueError("pass both q_norm and k_norm, or neither")
    q_weight, q_eps = q_norm if q_norm is not None else (None, 0.0)
    k_weight, k_eps = k_norm if k_norm is not None else (None, 0.0)
    check_rope_args(q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping, (q_weight, k_weight))
    k_scales, v_scales = check_cache_scales(k_cache, k_scales, v_scales)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    q_out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty((num_tokens, num_kv_heads, head_dim), dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    has_norm = q_weight is not None
    block_h, block_d = triton.next_power_of_2(num_heads), triton.next_power_of_2(head_dim)
    _norm_rope_store_kernel[(num_tokens,)](
        q, k, v, q_out, k_out, k_cache, v_cache, k_scales, v_scales, positions, slot_mapping, cos, sin,
        q_weight if has_norm else cos, k_weight if has_norm else cos,  # unread without the norm
        q_eps, k_eps, 1.0 / k_scale, 1.0 / v_scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=block_h,
        BLOCK_KV=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=block_d,
        HAS_NORM=has_norm,
        QUANT=k_cache.dtype != q.dtype,
        # The query tile (and its rotate_half partners) in float32: ~32 values a thread for each.
        num_warps=min(MAX_NUM_WARPS, max(1, block_h * block_d // ELEMENTS_PER_WARP)),
    )
    return q_out, k_out
