"""Decode attention with the step's q/k RMSNorm, rotary embedding and KV-cache store folded in: one
kernel a layer where a decode step otherwise runs two (kernels/rope_store.py, then
kernels/decode_attention.py).

Every program of the split-KV decode kernel computes its GQA group's query heads from the raw q (norm,
rotation, rounded to q's dtype as rope_store rounds them), so no normed q is written and read back. The
one program whose chunk holds the new position (seqlens_k - 1) also norms and rotates the new key, and
stores it and the new value into the cache at slot_mapping (fp8-scaled or int8-quantized as rope_store
does) before it reads its chunk: a barrier orders the store before its own loads, and no other program
reads that position. What follows is decode_attention's chunk and combine, shared code.

At one row a decode step is latency-bound, ~183 kernels of a few microseconds (docs/performance-notes.md,
section "Decode attention at one row"): one fewer a layer is 28 fewer. At large batches the extra work per
program
(the rotation of its group's q) is repeated by every chunk, so the Triton backend uses this only for small
batches (TritonBackend.DECODE_BUCKETS)."""

import math

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from nanovllm.kernels.common import FP8_MAX, check_cache_scales, float16_dot_operands, quantize_int8_rows
from nanovllm.kernels.decode_attention import attend_chunk, chunk_bounds
from nanovllm.kernels.decode_launch import DecodeCall
from nanovllm.kernels.rope_store import check_rope_args, normed_rotated_rows


@triton.jit(do_not_specialize=["block_tables_stride", "num_splits"])
def _decode_rope_split_kernel(
    q_ptr,  # [B, num_heads, HEAD_DIM], before norm and rotation
    k_ptr,  # [B, NUM_KV_HEADS, HEAD_DIM], the step's keys before norm and rotation
    v_ptr,  # [B, NUM_KV_HEADS, HEAD_DIM], the step's values
    k_cache_ptr,
    v_cache_ptr,
    k_scales_ptr,  # an int8 cache's per-token scales (unread for other caches)
    v_scales_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    out_ptr,
    counters_ptr,
    seqlens_k_ptr,
    block_tables_ptr,
    positions_ptr,
    slot_mapping_ptr,
    cos_ptr,  # [max_position, HEAD_DIM] float32
    sin_ptr,
    q_weight_ptr,
    k_weight_ptr,
    q_eps,
    k_eps,
    k_scale_inv,
    v_scale_inv,
    q_stride_b,
    q_stride_h,
    k_stride_b,
    k_stride_h,
    v_stride_b,
    v_stride_h,
    out_stride_b,
    out_stride_h,
    block_tables_stride,
    num_splits,
    scale_log2,
    v_scale,
    NUM_HEADS_PER_KV: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    COMBINE_HEADS: tl.constexpr,
    COMBINE_ROWS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    TILES: tl.constexpr,  # decode_words.tile_form's
    HAS_NORM: tl.constexpr,
    QUANT: tl.constexpr,  # the cache is fp8 (store scaled and clamped) or int8 (store quantized)
    PDL: tl.constexpr = False,  # launched as a programmatic dependent: wait for q, k, v
    LATE_TRIGGER: tl.constexpr = False,  # under PDL: the next kernel launches after the K/V loop
    ONE_SPLIT: tl.constexpr = False,  # num_splits == 1: each program writes its rows' output itself
    KV_PER_PROG: tl.constexpr = 1,  # DecodeCall's: always 1 here (prepared without packs)
):
    tl.static_assert(KV_PER_PROG == 1)  # the rotary and the KV store below take one KV head a program
    kv_head = tl.program_id(0)  # the grid is DecodeCall's: KV heads fastest
    seq = tl.program_id(1)
    split = tl.program_id(2)
    kv_len = tl.load(seqlens_k_ptr + seq)
    split_len, split_start, split_end = chunk_bounds(kv_len, split, num_splits, BLOCK_N)
    pos = tl.load(positions_ptr + seq).to(tl.int64)
    cos_row, sin_row = cos_ptr + pos * HEAD_DIM, sin_ptr + pos * HEAD_DIM
    row = seq.to(tl.int64)
    if PDL:
        # Above: host-built inputs only. q, k, v are the previous kernel's output.
        gdc_wait()
        if not LATE_TRIGGER:
            gdc_launch_dependents()

    offs_g = tl.arange(0, BLOCK_G)
    g_mask = offs_g < NUM_HEADS_PER_KV
    heads = kv_head * NUM_HEADS_PER_KV + offs_g
    q = normed_rotated_rows(q_ptr + row * q_stride_b + heads * q_stride_h, g_mask, q_weight_ptr, cos_row,
                            sin_row, q_eps, HEAD_DIM, HEAD_DIM, HAS_NORM)
    q = q.to(q_ptr.dtype.element_ty)  # rounded where rope_store would store it

    # The new key's position is kv_len - 1: the chunk holding it stores it (and its value) first.
    if (kv_len > 0) & (split_start <= kv_len - 1) & (kv_len - 1 < split_end):
        slot = tl.load(slot_mapping_ptr + seq).to(tl.int64)
        if slot >= 0:
            one = tl.arange(0, 1)
            key = normed_rotated_rows(k_ptr + row * k_stride_b + kv_head * k_stride_h + one, one == 0,
                                      k_weight_ptr, cos_row, sin_row, k_eps, HEAD_DIM, HEAD_DIM, HAS_NORM)
            offs_d = tl.arange(0, HEAD_DIM)
            value = tl.load(v_ptr + row * v_stride_b + kv_head * v_stride_h + offs_d)[None, :]
            cache = slot * (NUM_KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM + offs_d[None, :]
            if QUANT and k_cache_ptr.dtype.element_ty == tl.int8:
                k_values, k_scales = quantize_int8_rows(key)
                v_values, v_scales = quantize_int8_rows(value.to(tl.float32))
                tl.store(k_cache_ptr + cache, k_values)
                tl.store(v_cache_ptr + cache, v_values)
                tl.store(k_scales_ptr + slot * NUM_KV_HEADS + kv_head + one, k_scales)
                tl.store(v_scales_ptr + slot * NUM_KV_HEADS + kv_head + one, v_scales)
            elif QUANT:
                cache_ty = k_cache_ptr.dtype.element_ty
                tl.store(k_cache_ptr + cache, tl.clamp(key * k_scale_inv, -FP8_MAX, FP8_MAX).to(cache_ty))
                tl.store(v_cache_ptr + cache,
                         tl.clamp(value.to(tl.float32) * v_scale_inv, -FP8_MAX, FP8_MAX).to(cache_ty))
            else:
                tl.store(k_cache_ptr + cache, key.to(k_cache_ptr.dtype.element_ty))
                tl.store(v_cache_ptr + cache, value)
        # Every thread's store before any thread's load of the chunk (global memory is coherent within
        # a program after a barrier).
        tl.debug_barrier()

    TILES_FLOAT16: tl.constexpr = k_cache_ptr.dtype.element_ty == tl.float8e4nv or TILES == "words"
    q, qk_scale = float16_dot_operands(q, scale_log2, TILES_FLOAT16)
    attend_chunk(q, qk_scale, seq, kv_head, split, kv_len, split_start, split_end, split_len, k_cache_ptr,
                 v_cache_ptr, k_scales_ptr, v_scales_ptr, partial_out_ptr, partial_lse_ptr, out_ptr,
                 counters_ptr, block_tables_ptr, out_stride_b, out_stride_h, block_tables_stride, num_splits,
                 v_scale, NUM_HEADS_PER_KV, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_G, BLOCK_N,
                 COMBINE_HEADS, COMBINE_ROWS, DOT_PRECISION, TILES, PDL and LATE_TRIGGER, ONE_SPLIT, 1)


def paged_decode_rope_attention(
    q: torch.Tensor,  # [B, num_heads, head_dim] before norm and rotation; may be a strided slice of qkv
    k: torch.Tensor,  # [B, num_kv_heads, head_dim] the step's keys, before norm and rotation
    v: torch.Tensor,  # [B, num_kv_heads, head_dim] the step's values
    positions: torch.Tensor,  # [B], each row's position (its context length - 1)
    cos: torch.Tensor,  # [max_position, head_dim] float32
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [B], -1 = padding (not stored)
    seqlens_k: torch.Tensor,  # [B] int32, including the new token; 0 = padding
    block_tables: torch.Tensor,
    softmax_scale: float,
    *,
    q_norm: tuple[torch.Tensor, float] | None = None,  # (weight [head_dim], eps); both norms or neither
    k_norm: tuple[torch.Tensor, float] | None = None,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    k_scales: torch.Tensor | None = None,  # an int8 cache's [num_blocks, block_size, num_kv_heads] float32
    v_scales: torch.Tensor | None = None,
    pdl: bool = False,  # a programmatic dependent launch (supports_pdl(q.device) must hold)
    late_trigger: bool = False,  # under PDL: let the next kernel launch after the K/V loop, not the wait
) -> torch.Tensor:
    """norm_rope_store(q, k, v, ...) then paged_decode_attention(...) in one kernel: returns the
    attention output [B, num_heads, head_dim] and writes the step's k (normed, rotated) and v into the
    cache. The same arguments and the same results as the two calls (up to float32 rounding in the
    norm's sum); CUDA-graph capturable. Under PDL the kernel may start while the one before it (the
    q/k/v projection) runs; it reads only the step's host-built inputs (seqlens_k, positions) and the
    rotary tables before it waits for that kernel's output, and lets the next kernel launch right after
that wait or, with late_trigger, after its K/V loop (the backend's choice, by the rows)."""
    if (q_norm is None) != (k_norm is None):
        raise ValueError("pass both q_norm and k_norm, or neither")
    q_weight, q_eps = q_norm if q_norm is not None else (None, 0.0)
    k_weight, k_eps = k_norm if k_norm is not None else (None, 0.0)
    check_rope_args(q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping, (q_weight, k_weight))
    call = DecodeCall.prepare(q, k_cache, v_cache, seqlens_k, block_tables, None, out, workspace, counters)
    k_scales, v_scales = check_cache_scales(k_cache, k_scales, v_scales)
    if q.shape[0] == 0:
        return call.out
    has_norm = q_weight is not None
    _decode_rope_split_kernel[call.grid](
        q, k, v, k_cache, v_cache, k_scales, v_scales, call.partial_out, call.partial_lse, call.out,
        call.counters, seqlens_k, block_tables, positions, slot_mapping, cos, sin,
        q_weight if has_norm else cos, k_weight if has_norm else cos,  # unread without the norm
        q_eps, k_eps, 1.0 / k_scale, 1.0 / v_scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        call.out.stride(0), call.out.stride(1), block_tables.stride(0), call.num_splits,
        softmax_scale * k_scale * math.log2(math.e), v_scale,
        HAS_NORM=has_norm, QUANT=k_cache.dtype != q.dtype, **call.constexprs(q.dtype, k_cache.dtype),
        PDL=pdl, LATE_TRIGGER=pdl and late_trigger, launch_pdl=pdl,
    )
    return call.out
