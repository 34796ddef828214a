"""Per-head q/k RMSNorm, rotary embedding and the KV-cache store, fused into one Triton kernel.

In a decode step each of these is a tiny kernel whose cost is its launch, and a layer runs them back to
back: norm+rotary of q and k (two kernels under torch.compile), then the store of k and v. Here one
program per (token, head) does all of it for its head:

    query head:  q_out = rotate(norm(q) * q_weight)
    key head:    k_out = rotate(norm(k) * k_weight); k_cache[slot] = k_out; v_cache[slot] = v

with rotate(x) = x * cos[pos] + rotate_half(x) * sin[pos] (neox style, cos/sin tables in float32) and
the norm skipped for models without q/k norm (HAS_NORM=False). Everything is computed in float32 and
rounded once. Slot -1 (padding) stores nothing; k_out is still written, for backends that attend over
the step's own keys. The cache layout is nanovllm.kernels.common's.

An fp8 (e4m3) cache stores k / k_scale and v / v_scale, clamped to e4m3's range; the attention kernels
multiply the scales back in (nanovllm.kernels.common.FP8_MAX).
"""

import torch
import triton
import triton.language as tl

from nanovllm.kernels.common import FP8_MAX, check_cache_dtype


@triton.jit
def _normed_rotated(
    x_ptr,
    weight_ptr,
    cos_row_ptr,
    sin_row_ptr,
    eps,
    HEAD_DIM: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    """The two halves of one head after the optional RMSNorm and the rotation, in float32."""
    half: tl.constexpr = HEAD_DIM // 2
    offs = tl.arange(0, BLOCK_HALF)
    mask = offs < half
    x1 = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + half + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        rstd = tl.rsqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / HEAD_DIM + eps)
        x1 = x1 * rstd * tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        x2 = x2 * rstd * tl.load(weight_ptr + half + offs, mask=mask, other=0.0).to(tl.float32)
    cos1 = tl.load(cos_row_ptr + offs, mask=mask, other=0.0)
    cos2 = tl.load(cos_row_ptr + half + offs, mask=mask, other=0.0)
    sin1 = tl.load(sin_row_ptr + offs, mask=mask, other=0.0)
    sin2 = tl.load(sin_row_ptr + half + offs, mask=mask, other=0.0)
    return x1 * cos1 - x2 * sin1, x2 * cos2 + x1 * sin2


@triton.jit
def normed_rotated_rows(row_ptrs, row_mask, weight_ptr, cos_row_ptr, sin_row_ptr, eps, HEAD_DIM: tl.constexpr,
                        HAS_NORM: tl.constexpr):
    """_normed_rotated for several heads at once (rows at row_ptrs, masked by row_mask; HEAD_DIM a power
    of two): [rows, HEAD_DIM] in float32. Element d takes its rotate_half partner (d + HEAD_DIM/2
    modulo HEAD_DIM) from a second load, so the rows stay whole."""
    half: tl.constexpr = HEAD_DIM // 2
    offs = tl.arange(0, HEAD_DIM)
    partner = (offs + half) % HEAD_DIM
    x = tl.load(row_ptrs[:, None] + offs[None, :], mask=row_mask[:, None], other=0.0).to(tl.float32)
    xp = tl.load(row_ptrs[:, None] + partner[None, :], mask=row_mask[:, None], other=0.0).to(tl.float32)
    if HAS_NORM:
        rstd = tl.rsqrt(tl.sum(x * x, 1) / HEAD_DIM + eps)[:, None]
        x = x * rstd * tl.load(weight_ptr + offs).to(tl.float32)[None, :]
        xp = xp * rstd * tl.load(weight_ptr + partner).to(tl.float32)[None, :]
    cos = tl.load(cos_row_ptr + offs)[None, :]
    sin = tl.load(sin_row_ptr + offs)[None, :]
    # rotate_half(x) = [-x2, x1]: the first half takes minus its partner.
    return x * cos + tl.where(offs < half, -xp, xp) * sin


@triton.jit
def _norm_rope_store_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    q_out_ptr,  # [T, NUM_HEADS, HEAD_DIM], contiguous
    k_out_ptr,  # [T, NUM_KV_HEADS, HEAD_DIM], contiguous
    k_cache_ptr,
    v_cache_ptr,
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
    BLOCK_HALF: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_NORM: tl.constexpr,
    QUANT: tl.constexpr,  # the cache is fp8: store scaled and clamped
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)  # 0 .. NUM_HEADS-1: query heads; then the key/value heads
    pos = tl.load(positions_ptr + token).to(tl.int64)
    cos_row, sin_row = cos_ptr + pos * HEAD_DIM, sin_ptr + pos * HEAD_DIM
    half: tl.constexpr = HEAD_DIM // 2
    offs = tl.arange(0, BLOCK_HALF)
    mask = offs < half
    if head < NUM_HEADS:
        out1, out2 = _normed_rotated(q_ptr + token * q_stride_t + head * q_stride_h, q_weight_ptr, cos_row,
                                     sin_row, q_eps, HEAD_DIM, BLOCK_HALF, HAS_NORM)
        dst = q_out_ptr + (token * NUM_HEADS + head) * HEAD_DIM
        tl.store(dst + offs, out1.to(q_out_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + half + offs, out2.to(q_out_ptr.dtype.element_ty), mask=mask)
    else:
        kv_head = head - NUM_HEADS
        rot1, rot2 = _normed_rotated(k_ptr + token * k_stride_t + kv_head * k_stride_h, k_weight_ptr, cos_row,
                                     sin_row, k_eps, HEAD_DIM, BLOCK_HALF, HAS_NORM)
        # New names: a variable of one branch may not change type (Triton's compiler checks both).
        k1 = rot1.to(k_out_ptr.dtype.element_ty)
        k2 = rot2.to(k_out_ptr.dtype.element_ty)
        dst = k_out_ptr + (token * NUM_KV_HEADS + kv_head) * HEAD_DIM
        tl.store(dst + offs, k1, mask=mask)
        tl.store(dst + half + offs, k2, mask=mask)
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        if slot >= 0:
            cache = slot * (NUM_KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM
            offs_d = tl.arange(0, BLOCK_D)
            d_mask = offs_d < HEAD_DIM
            value = tl.load(v_ptr + token * v_stride_t + kv_head * v_stride_h + offs_d, mask=d_mask)
            if QUANT:
                cache_ty = k_cache_ptr.dtype.element_ty
                q1 = tl.clamp(rot1 * k_scale_inv, -FP8_MAX, FP8_MAX).to(cache_ty)
                q2 = tl.clamp(rot2 * k_scale_inv, -FP8_MAX, FP8_MAX).to(cache_ty)
                qv = tl.clamp(value.to(tl.float32) * v_scale_inv, -FP8_MAX, FP8_MAX).to(cache_ty)
                tl.store(k_cache_ptr + cache + offs, q1, mask=mask)
                tl.store(k_cache_ptr + cache + half + offs, q2, mask=mask)
                tl.store(v_cache_ptr + cache + offs_d, qv, mask=d_mask)
            else:
                tl.store(k_cache_ptr + cache + offs, k1, mask=mask)
                tl.store(k_cache_ptr + cache + half + offs, k2, mask=mask)
                tl.store(v_cache_ptr + cache + offs_d, value, mask=d_mask)


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns the rotated (q, k), both contiguous, and writes k and v into the cache at slot_mapping.
    No host sync, so it can run inside a captured CUDA graph."""
    if (q_norm is None) != (k_norm is None):
        raise ValueError("pass both q_norm and k_norm, or neither")
    q_weight, q_eps = q_norm if q_norm is not None else (None, 0.0)
    k_weight, k_eps = k_norm if k_norm is not None else (None, 0.0)
    check_rope_args(q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping, (q_weight, k_weight))
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    q_out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty((num_tokens, num_kv_heads, head_dim), dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    has_norm = q_weight is not None
    _norm_rope_store_kernel[(num_tokens, num_heads + num_kv_heads)](
        q, k, v, q_out, k_out, k_cache, v_cache, positions, slot_mapping, cos, sin,
        q_weight if has_norm else cos, k_weight if has_norm else cos,  # unread without the norm
        q_eps, k_eps, 1.0 / k_scale, 1.0 / v_scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
        BLOCK_D=triton.next_power_of_2(head_dim),
        HAS_NORM=has_norm,
        QUANT=k_cache.dtype != q.dtype,
        num_warps=1,
    )
    return q_out, k_out
