"""Decode attention over the paged KV cache with split-KV (flash-decoding), in Triton.

Each sequence has one query, at its last position, attending to all seqlens_k[b] keys. One program per
(sequence, KV head) would leave most SMs idle at small batch and long context, so each context is cut
into num_splits chunks:

    stage 1, grid (num_kv_heads, B, num_splits): one program reads one chunk of one sequence's K/V for
        the whole GQA group of query heads sharing that KV head (each K/V tile is loaded once), and
        writes a float32 partial per head: its output normalised by its own softmax sum, and its
        log-sum-exp (base 2);
    stage 2: out = sum_s 2^(lse_s - max lse) * out_s / sum_s 2^(lse_s - max lse) over the chunks that
        hold keys, for the whole GQA group at once, done by the last program of each (sequence, KV head)
        to finish (an atomic counter says which: one kernel in all). With one chunk a sequence (every
        large batch) there is nothing to combine: each program stores its output itself (ONE_SPLIT, a
        variant of its own), 3-11% faster a call at 128-512 rows (docs/performance-notes.md, "Decode
        attention at large batches"). There an fp8
        cache's programs may take two KV heads each (decode_launch.FP8_PACKED, grid (num_kv_heads / 2, B,
        1)): one softmax for both GQA groups (decode_words.attend_words). An int8 cache's tiles widen
        as a 16-bit cache's do ("cast", common.attend_kv_tile) or, where decode_words.INT8_WORDS says
        so, as fp8's "words" do, their per-token scales beside them either way.

num_splits and the launch settings depend only on static shapes (batch size, KV heads, block_tables
width, cache dtype, SM count; decode_launch.py); each
sequence's chunk length, cdiv(seqlens_k[b], num_splits) rounded up to whole tiles, is computed on the GPU.
So there is no host sync and no data-dependent size: the call is CUDA-graph capturable. Chunks past a
sequence's end write neutral partials (lse = -inf), so seqlens_k[b] == 0 (graph batch padding) gives
zeros without reading the block table or the cache.

Programs start in grid order, KV heads fastest. At large batches there is one chunk per sequence, and a
kernel's end waits for its last-started long contexts; `seq_order` (the rows by context length, longest
first) makes the last programs the short ones (one layer 2.4-4.6% faster in bf16, up to 12% in fp8, at
64-512 rows: docs/performance-notes.md, "Decode attention at large batches").

The chunk's attention and the split-combining epilogue are shared with decode_rope.py (the same kernel
with q/k norm, rotary and the KV store in front); what a call needs besides its inputs (output,
scratch, counters, grid, checked arguments) is decode_launch.DecodeCall, which both prepare.
"""

import math

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from nanovllm.kernels.common import (
    attend_kv_tile,
    check_cache_scales,
    float16_dot_operands,
)
from nanovllm.kernels.decode_launch import DecodeCall
from nanovllm.kernels.decode_words import attend_words


# Triton compiles a variant per integer argument that is 1 or a multiple of 16; these vary from step to
# step (block-table width, split count), and a variant first met mid-run costs a second or two to compile.
@triton.jit(do_not_specialize=["block_tables_stride", "num_splits"])
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scales_ptr,  # an int8 cache's per-token scales (unread for other caches)
    v_scales_ptr,
    partial_out_ptr,  # [B, num_heads, num_splits, HEAD_DIM] float32
    partial_lse_ptr,  # [B, num_heads, num_splits] float32
    out_ptr,  # [B, num_heads, HEAD_DIM]
    counters_ptr,  # [B * NUM_KV_HEADS] int32, zero on entry and on exit
    seqlens_k_ptr,
    block_tables_ptr,
    seq_order_ptr,  # [B] int32, a permutation of the rows: the order they start in (ORDERED only)
    q_stride_b,
    q_stride_h,
    out_stride_b,
    out_stride_h,
    block_tables_stride,
    num_splits,
    scale_log2,  # softmax_scale * k_scale * log2(e): the kernel works in base 2 (exp2 is fast)
    v_scale,  # what the cache's values are multiplied by (1 unless the cache is fp8)
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
    ORDERED: tl.constexpr,
    ONE_SPLIT: tl.constexpr = False,  # num_splits == 1: each program writes its rows' output itself
    KV_PER_PROG: tl.constexpr = 1,  # KV heads a program (packed: decode_words; ONE_SPLIT "words" only)
):
    # KV heads vary fastest in the grid: a sequence's heads run side by side, reading neighbouring bytes
    # of each cached token. With seq_order, the sequences start longest first (see the module docstring).
    group = tl.program_id(0)  # the program's KV heads: group * KV_PER_PROG + (0 .. KV_PER_PROG - 1)
    seq = tl.program_id(1)
    if ORDERED:
        seq = tl.load(seq_order_ptr + seq)
    split = tl.program_id(2)
    kv_len = tl.load(seqlens_k_ptr + seq)
    split_len, split_start, split_end = chunk_bounds(kv_len, split, num_splits, BLOCK_N)

    offs_g = tl.arange(0, BLOCK_G)
    g_mask = offs_g < NUM_HEADS_PER_KV * KV_PER_PROG
    heads = group * (NUM_HEADS_PER_KV * KV_PER_PROG) + offs_g
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(
        q_ptr + seq.to(tl.int64) * q_stride_b + heads[:, None] * q_stride_h + offs_d[None, :],
        mask=g_mask[:, None],
        other=0.0,
    )
    TILES_FLOAT16: tl.constexpr = k_cache_ptr.dtype.element_ty == tl.float8e4nv or TILES == "words"
    q, qk_scale = float16_dot_operands(q, scale_log2, TILES_FLOAT16)
    attend_chunk(q, qk_scale, seq, group, split, kv_len, split_start, split_end, split_len, k_cache_ptr,
                 v_cache_ptr, k_scales_ptr, v_scales_ptr, partial_out_ptr, partial_lse_ptr, out_ptr,
                 counters_ptr, block_tables_ptr, out_stride_b, out_stride_h, block_tables_stride, num_splits,
                 v_scale, NUM_HEADS_PER_KV, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_G, BLOCK_N,
                 COMBINE_HEADS, COMBINE_ROWS, DOT_PRECISION, TILES, False, ONE_SPLIT, KV_PER_PROG)


@triton.jit
def chunk_bounds(kv_len, split, num_splits, BLOCK_N: tl.constexpr):
    """(chunk length, its start, its end) of chunk `split` of a kv_len-key context. Chunks are whole
    tiles, so each starts on a tile boundary as paged_kv_offsets requires; the last ones may be empty."""
    split_len = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
    split_start = split * split_len
    return split_len, split_start, tl.minimum(split_start + split_len, kv_len)


@triton.jit
def attend_chunk(q, qk_scale, seq, group, split, kv_len, split_start, split_end, split_len, k_cache_ptr,
                 v_cache_ptr, k_scales_ptr, v_scales_ptr, partial_out_ptr, partial_lse_ptr, out_ptr,
                 counters_ptr, block_tables_ptr, out_stride_b, out_stride_h, block_tables_stride, num_splits,
                 v_scale,
                 NUM_HEADS_PER_KV: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                 BLOCK_SIZE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
                 COMBINE_HEADS: tl.constexpr, COMBINE_ROWS: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 TILES: tl.constexpr, LAUNCH_AFTER_LOOP: tl.constexpr, ONE_SPLIT: tl.constexpr,
                 KV_PER_PROG: tl.constexpr):
    """One program's chunk [split_start, split_end) of one sequence and KV head `group` (with KV_PER_PROG
    above 1, "words" tiles and ONE_SPLIT only: KV heads group * KV_PER_PROG on, packed): its partial for
    the queries q [BLOCK_G, HEAD_DIM] of their GQA groups (scores times qk_scale), then, in the last chunk
    to finish, the combine; with ONE_SPLIT (the chunk is the whole context) the output itself. Shared by
    the decode kernels (this one, and decode_rope's, which under PDL may let its dependent launch once
    the K/V loop is done: LAUNCH_AFTER_LOOP)."""
    tl.static_assert(KV_PER_PROG == 1 or (TILES == "words" and ONE_SPLIT))
    kv_head = group  # with one KV head a program (every path below but the "words" loop's)
    offs_g = tl.arange(0, BLOCK_G)
    g_mask = offs_g < NUM_HEADS_PER_KV * KV_PER_PROG
    heads = group * (NUM_HEADS_PER_KV * KV_PER_PROG) + offs_g
    offs_d = tl.arange(0, HEAD_DIM)

    block_table_row = block_tables_ptr + seq.to(tl.int64) * block_tables_stride
    if TILES == "words":
        m_i, l_i, acc = attend_words(q, qk_scale, group * KV_PER_PROG, split_start, split_end,
                                     block_table_row, k_cache_ptr, v_cache_ptr, k_scales_ptr, v_scales_ptr,
                                     NUM_HEADS_PER_KV, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_G, BLOCK_N,
                                     KV_PER_PROG)
    else:
        m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
        # An empty chunk (split_start >= split_end) skips the loop and reads nothing.
        for tile_start in range(split_start, split_end, BLOCK_N):
            offs_n = tile_start + tl.arange(0, BLOCK_N)
            n_mask = offs_n < split_end
            # An fp8 cache widens to q's (float16) here; its scales are folded into qk_scale and v_scale.
            # Position tile_start is always valid (the chunk is not empty), so every row sees a key.
            m_i, l_i, acc = attend_kv_tile(q, m_i, l_i, acc, qk_scale, n_mask[None, :], k_cache_ptr,
                                           v_cache_ptr, k_scales_ptr, v_scales_ptr, block_table_row,
                                           tile_start, kv_head, n_mask, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM,
                                           BLOCK_N, DOT_PRECISION)

    if LAUNCH_AFTER_LOOP:
        gdc_launch_dependents()
    # A non-empty chunk has l_i >= 1 (its max term is 2^0); an empty one has l_i == 0 and becomes
    # the neutral partial (out 0, lse -inf) that stage 2 weights by 2^-inf = 0.
    has_keys = l_i > 0
    safe_l = tl.where(has_keys, l_i, 1.0)
    out = acc / safe_l[:, None] * v_scale
    if ONE_SPLIT:
        # What the combine of this one partial gives (its weight is 2^0 = 1, the sum 1), without the
        # partial's store, the counter's fenced atomic and the read back, which held each program's
        # slot on the SM past its K/V loop (at large batches the fp8 kernel is bound by its resident
        # programs' issue, not by bytes: ncu, docs/performance-notes.md, "Decode attention at large batches").
        tl.store(out_ptr + seq.to(tl.int64) * out_stride_b + heads[:, None] * out_stride_h + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
    else:
        lse = tl.where(has_keys, m_i + tl.log2(safe_l), float("-inf"))
        partial_rows = (seq.to(tl.int64) * (NUM_KV_HEADS * NUM_HEADS_PER_KV) + heads) * num_splits + split
        tl.store(partial_lse_ptr + partial_rows, lse, mask=g_mask)
        tl.store(partial_out_ptr + partial_rows[:, None] * HEAD_DIM + offs_d[None, :], out,
                 mask=g_mask[:, None])
        # The last of this (sequence, KV head)'s chunks to finish combines all of them: no second kernel.
        # The barrier puts every thread's partial before the counter's release; the last program's
        # acquire then sees them all, and it reads them past L1 (.cg), which is not coherent across SMs.
        tl.debug_barrier()
        counter = counters_ptr + seq * NUM_KV_HEADS + kv_head
        if tl.atomic_add(counter, 1, sem="acq_rel") == num_splits - 1:
            tl.atomic_xchg(counter, 0)  # ready for the next call (kernel boundaries order the calls)
            # Only the chunks that hold keys are combined: the split count is sized for the longest
            # possible context, so a short one leaves most chunks empty.
            num_used = tl.cdiv(kv_len, tl.maximum(split_len, BLOCK_N))
            first_head = seq.to(tl.int64) * (NUM_KV_HEADS * NUM_HEADS_PER_KV) + kv_head * NUM_HEADS_PER_KV
            first_row = first_head * num_splits
            out_row = out_ptr + seq.to(tl.int64) * out_stride_b + kv_head * NUM_HEADS_PER_KV * out_stride_h
            _combine_splits(partial_out_ptr, partial_lse_ptr, out_row, out_stride_h, first_row, num_splits,
                            num_used, NUM_HEADS_PER_KV, COMBINE_HEADS, HEAD_DIM, COMBINE_ROWS)


@triton.jit
def _combine_splits(partial_out_ptr, partial_lse_ptr, out_ptr, out_stride_h, first_row, num_splits, num_used,
                    NUM_HEADS: tl.constexpr, COMBINE_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                    COMBINE_ROWS: tl.constexpr):
    """For each of the NUM_HEADS heads sharing one KV head (head g's partials are rows first_row +
    g * num_splits + s): out_g = sum_s 2^(lse_gs - m_g) * out_gs / sum_s 2^(lse_gs - m_g) over its first
    num_used partials, m_g their max. All heads at once and COMBINE_ROWS partials per vectorized load,
    the max kept online (rescaling what is summed when it grows): one round of loads for up to
    COMBINE_ROWS chunks, where a pass for the max and one per head would be several. This epilogue is on
    every decode's critical path (at batch 1, most of the kernel's time is such latency)."""
    offs_g = tl.arange(0, COMBINE_HEADS)
    g_mask = offs_g < NUM_HEADS
    offs_r = tl.arange(0, COMBINE_ROWS)
    offs_d = tl.arange(0, HEAD_DIM)
    m = tl.full([COMBINE_HEADS], float("-inf"), dtype=tl.float32)
    total = tl.zeros([COMBINE_HEADS], dtype=tl.float32)
    acc = tl.zeros([COMBINE_HEADS, HEAD_DIM], dtype=tl.float32)
    for start in range(0, num_used, COMBINE_ROWS):
        rows = first_row + offs_g[:, None] * num_splits + start + offs_r[None, :]  # [heads, rows]
        used = g_mask[:, None] & (start + offs_r < num_used)[None, :]
        lse = tl.load(partial_lse_ptr + rows, mask=used, other=float("-inf"), cache_modifier=".cg")
        part = tl.load(partial_out_ptr + rows[:, :, None] * HEAD_DIM + offs_d[None, None, :],
                       mask=used[:, :, None], other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, tl.max(lse, 1))
        # Chunks without keys have lse -inf: shift by 0 rather than -inf so their weight is 2^-inf = 0.
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        rescale = tl.exp2(m - shift)  # 0 on the first round (m = -inf)
        weights = tl.exp2(lse - shift[:, None])
        total = total * rescale + tl.sum(weights, 1)
        acc = acc * rescale[:, None] + tl.sum(weights[:, :, None] * part, 1)
        m = m_new
    out = acc / tl.where(total > 0, total, 1.0)[:, None]  # zeros where no chunk held a key
    tl.store(out_ptr + offs_g[:, None] * out_stride_h + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=g_mask[:, None])


def paged_decode_attention(
    q: torch.Tensor,  # [B, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    seqlens_k: torch.Tensor,  # [B] int32, context length including the token being decoded; 0 = padding
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    softmax_scale: float,
    *,
    num_splits: int | None = None,  # default: decode_launch.choose_launch's, from static shapes
    out: torch.Tensor | None = None,  # [B, num_heads, head_dim], q's dtype
    workspace: torch.Tensor | None = None,  # float32, >= B * num_heads * num_splits * (head_dim + 1)
    counters: torch.Tensor | None = None,  # int32 zeros, >= B * num_kv_heads; left zeroed
    k_scale: float = 1.0,  # an fp8 cache holds k / k_scale and v / v_scale
    v_scale: float = 1.0,
    k_scales: torch.Tensor | None = None,  # an int8 cache's [num_blocks, block_size, num_kv_heads] float32
    v_scales: torch.Tensor | None = None,
    seq_order: torch.Tensor | None = None,  # [B] int32 permutation: rows to start first (longest context)
) -> torch.Tensor:
    """Attention of each sequence's single query over its whole paged context; returns
    [B, num_heads, head_dim] in q's dtype (zeros where seqlens_k is 0). CUDA-graph capturable.

    The last chunk of each (sequence, KV head) to finish combines the partials; it counts finished
    chunks in `counters`, which it leaves zeroed for the next call. Pass a persistent buffer (allocating
    one costs a fill kernel), and never the same buffer to two calls that may run at once."""
    call = DecodeCall.prepare(q, k_cache, v_cache, seqlens_k, block_tables, num_splits, out, workspace,
                              counters, packs=True)
    k_scales, v_scales = check_cache_scales(k_cache, k_scales, v_scales)
    if seq_order is not None and (seq_order.shape != seqlens_k.shape or seq_order.dtype != torch.int32):
        raise ValueError(f"seq_order must be int32 {tuple(seqlens_k.shape)} like seqlens_k; got "
                         f"{seq_order.dtype} {tuple(seq_order.shape)}")
    if q.shape[0] == 0:
        return call.out
    _decode_split_kernel[call.grid](
        q, k_cache, v_cache, k_scales, v_scales,
        call.partial_out,
        call.partial_lse,
        call.out,
        call.counters,
        seqlens_k,
        block_tables,
        seqlens_k if seq_order is None else seq_order,  # unread without an order
        q.stride(0),
        q.stride(1),
        call.out.stride(0),
        call.out.stride(1),
        block_tables.stride(0),
        call.num_splits,
        softmax_scale * k_scale * math.log2(math.e),
        v_scale,
        ORDERED=seq_order is not None,
        **call.constexprs(q.dtype, k_cache.dtype),
    )
    return call.out
