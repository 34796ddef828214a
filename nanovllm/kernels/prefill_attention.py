"""Causal prefill attention over the paged KV cache (varlen batch, cached prefixes, GQA) in Triton.

Sequence b brings q_len_b new query tokens (rows cu_seqlens_q[b]:cu_seqlens_q[b+1] of q); they are the
LAST q_len_b of its seqlens_k[b] context tokens, and all of its keys/values (the cached prefix and the
new tokens, already written by nanovllm.kernels.rope_store) are read from the cache through block_tables[b]:

    |------ num_cached = seqlens_k[b] - q_len_b ------|------ q_len_b new tokens ------|
    query i sits at position p = num_cached + i and attends to keys 0..p

Query head h reads KV head h // (num_heads // num_kv_heads). Softmax is online, accumulated in float32.
An int8 cache's per-token scales are read with its tiles (common.attend_kv_tile).
"""

import math

import torch
import triton
import triton.language as tl

from nanovllm.kernels.common import (
    attend_kv_tile,
    check_cache_scales,
    check_paged_attention_args,
    dot_precision,
    float16_dot_operands,
    output_for,
)

# Query rows and key positions per tile. 64x64 keeps short prompts in a mixed batch from wasting a big
# tile; at head_dim 256 the key tile halves so K, V and their pipeline stages fit in shared memory.
BLOCK_M = 64
BLOCK_N = 64
BLOCK_N_HEAD_DIM_256 = 32
NUM_WARPS = 4
NUM_WARPS_HEAD_DIM_256 = 8
NUM_STAGES = 2


# Triton compiles a variant per integer argument that is 1 or a multiple of 16, and per pointer that is
# 16-byte aligned or not; a variant first met mid-run costs a second or two to compile. These vary from
# step to step: the block-table width, and where a mixed batch's prefill rows start in its metadata (the
# backend passes cu_seqlens_q[d:], seqlens_k[d:], block_tables[d:] after d decoding rows), so their
# alignment is not specialized on (these are scalar loads: alignment buys nothing).
@triton.jit(do_not_specialize=["block_tables_stride"],
            do_not_specialize_on_alignment=["cu_seqlens_q_ptr", "seqlens_k_ptr", "block_tables_ptr"])
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scales_ptr,  # an int8 cache's per-token scales (unread for other caches)
    v_scales_ptr,
    out_ptr,
    cu_seqlens_q_ptr,
    seqlens_k_ptr,
    block_tables_ptr,
    q_stride_n,
    q_stride_h,
    out_stride_n,
    out_stride_h,
    block_tables_stride,
    scale_log2,  # softmax_scale * k_scale * log2(e): the kernel works in base 2 (exp2 is fast)
    v_scale,  # what the cache's values are multiplied by (1 unless the cache is fp8)
    NUM_HEADS_PER_KV: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # Grid: (query tile, sequence, query head).
    pid_m = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    # The grid is sized for the longest sequence; tiles past this one's queries have nothing to do.
    if pid_m * BLOCK_M >= q_len:
        return
    kv_len = tl.load(seqlens_k_ptr + seq)
    num_cached = kv_len - q_len
    kv_head = head // NUM_HEADS_PER_KV

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    m_mask = offs_m < q_len
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + rows[:, None] * q_stride_n + head * q_stride_h + offs_d[None, :],
        mask=m_mask[:, None],
        other=0.0,
    )
    q, qk_scale = float16_dot_operands(q, scale_log2, k_cache_ptr.dtype.element_ty == tl.float8e4nv)
    q_pos = num_cached + offs_m

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    block_table_row = block_tables_ptr + seq.to(tl.int64) * block_tables_stride
    # Key tiles that end at or before the tile's first query position are visible to every row: no mask
    # (3-8% of the kernel's time at 1-2k-token prompts, docs/performance-notes.md, "Prefill and mixed steps").
    masked_start = (num_cached + pid_m * BLOCK_M + 1) // BLOCK_N * BLOCK_N
    for tile_start in range(0, masked_start, BLOCK_N):
        m_i, l_i, acc = attend_kv_tile(q, m_i, l_i, acc, qk_scale, None, k_cache_ptr, v_cache_ptr,
                                       k_scales_ptr, v_scales_ptr, block_table_row, tile_start, kv_head, None,
                                       BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, BLOCK_N, DOT_PRECISION)
    # Keys past the tile's last query position are masked for every row: stop the loop there.
    kv_end = tl.minimum(kv_len, num_cached + (pid_m + 1) * BLOCK_M)
    for tile_start in range(masked_start, kv_end, BLOCK_N):
        offs_n = tile_start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < kv_end
        # Every row (padding rows too: their position is >= kv_len > 0) sees key 0 of the first tile.
        visible = (offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :]
        # An fp8 cache widens to q's (float16) here; its scales are folded into qk_scale and v_scale.
        m_i, l_i, acc = attend_kv_tile(q, m_i, l_i, acc, qk_scale, visible, k_cache_ptr, v_cache_ptr,
                                       k_scales_ptr, v_scales_ptr, block_table_row, tile_start, kv_head,
                                       n_mask, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, BLOCK_N, DOT_PRECISION)

    out = acc / l_i[:, None] * v_scale
    tl.store(
        out_ptr + rows[:, None] * out_stride_n + head * out_stride_h + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None],
    )


def paged_prefill_attention(
    q: torch.Tensor,  # [num_q_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32
    seqlens_k: torch.Tensor,  # [B] int32, context length including the new tokens
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    softmax_scale: float,
    max_seqlen_q: int,
    *,
    out: torch.Tensor | None = None,  # [num_q_tokens, num_heads, head_dim], q's dtype
    k_scale: float = 1.0,  # an fp8 cache holds k / k_scale and v / v_scale
    v_scale: float = 1.0,
    k_scales: torch.Tensor | None = None,  # an int8 cache's [num_blocks, block_size, num_kv_heads] float32
    v_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new query tokens over its whole paged context; returns
    [num_q_tokens, num_heads, head_dim] in q's dtype. max_seqlen_q is the host-side max of q_len_b
    (sizes the grid, so it must not be smaller than the real maximum)."""
    num_heads, num_kv_heads, head_dim, block_size = check_paged_attention_args(
        q, k_cache, v_cache, block_tables
    )
    k_scales, v_scales = check_cache_scales(k_cache, k_scales, v_scales)
    batch_size = seqlens_k.shape[0]
    if cu_seqlens_q.shape != (batch_size + 1,) or block_tables.shape[0] < batch_size:
        raise ValueError(
            f"cu_seqlens_q {tuple(cu_seqlens_q.shape)} must be [B + 1] and block_tables "
            f"{tuple(block_tables.shape)} must have B rows, for B = {batch_size} (len(seqlens_k))"
        )
    out = output_for(q, out)
    if q.shape[0] == 0 or batch_size == 0 or max_seqlen_q <= 0:
        return out
    wide_head = head_dim > 128
    block_n = BLOCK_N_HEAD_DIM_256 if wide_head else BLOCK_N
    grid = (triton.cdiv(max_seqlen_q, BLOCK_M), batch_size, num_heads)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        k_scales,
        v_scales,
        out,
        cu_seqlens_q,
        seqlens_k,
        block_tables,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        softmax_scale * k_scale * math.log2(math.e),
        v_scale,
        NUM_HEADS_PER_KV=num_heads // num_kv_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=BLOCK_M,
        BLOCK_N=block_n,
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=NUM_WARPS_HEAD_DIM_256 if wide_head else NUM_WARPS,
        num_stages=NUM_STAGES,
    )
    return out
