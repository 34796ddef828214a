"""Expert alignment for the fused MoE (kernels/fused_moe.py): the slots of a routing grouped by expert
on the device, each expert's group padded to a multiple of BLOCK_M rows, so that every BLOCK_M-row block
of the sorted order belongs to one expert (fused_moe.py's docstring draws the layout).

Few slots (decode at small batch): one launch, `_scatter_kernel` counting them itself. Otherwise
`_count_kernel` counts each chunk of BLOCK_S slots' experts, and `_scatter_kernel` places every slot
(stable: slot order within an expert, so the result is deterministic), writes the padding and labels the
blocks; each of its programs sums the counts of the chunks before its own where there are few chunks
(decode), else `_chunk_scan_kernel` turns the counts into per-chunk offsets first (prefill). No host sync;
sizes come from (num_slots, num_experts, BLOCK_M) alone, so a CUDA graph replays with any routing."""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# Align kernels: a chunk of BLOCK_S slots (or of sorted rows) is compared with every expert at once, a
# [BLOCK_S, E_PAD] tile; this many elements keeps it in registers (32 per thread at 4 warps).
ALIGN_TILE_ELEMENTS = 4096
MIN_ALIGN_BLOCK_S = 16
# Up to this tile size, one chunk takes every slot and a single launch aligns them (batch <= 8 for
# 128 experts at top-8): decode at small batch is bound by launches, not by this work.
ONE_LAUNCH_TILE_ELEMENTS = 8192
# Up to this many chunks, every scatter program reads all the counts ([chunks, E_PAD], 32 KB at 128
# experts) and sums those before its chunk itself: torch's int cumsum over them took 12.5 us a call on
# an H200, 0.6 ms of a 256-row step of Qwen3-30B-A3B (48 layers).
MAX_SUMMED_CHUNKS = 64
# Chunks a scan program sums at a time. torch.cumsum over the chunks (an outer-dimension scan, parallel only
# over the 128 experts) took 0.7 ms a call at a 16,384-token prefill of Qwen3-30B-A3B, 34 ms of a 266 ms step
# (H100, 2026-12-05); one program an expert scans its column of counts a tile at a time.
SCAN_BLOCK = 1024


@triton.jit
def _count_kernel(topk_ids_ptr, counts_ptr, num_slots, E_PAD: tl.constexpr, BLOCK_S: tl.constexpr):
    """counts[chunk, e] = slots of this chunk routed to expert e."""
    chunk = tl.program_id(0)
    offs = chunk * BLOCK_S + tl.arange(0, BLOCK_S)
    ids = tl.load(topk_ids_ptr + offs, mask=offs < num_slots, other=-1)  # -1 matches no expert
    experts = tl.arange(0, E_PAD)
    hits = (ids[:, None] == experts[None, :]).to(tl.int32)  # [BLOCK_S, E_PAD]
    tl.store(counts_ptr + chunk * E_PAD + experts, tl.sum(hits, axis=0))


@triton.jit
def _chunk_scan_kernel(counts_ptr, cum_counts_ptr, num_chunks, E_PAD: tl.constexpr, BLOCK: tl.constexpr):
    """cum_counts[c, e] = counts[0, e] + ... + counts[c, e]: one program an expert e."""
    expert = tl.program_id(0)
    carry = tl.zeros([], dtype=tl.int32)
    for first in range(0, num_chunks, BLOCK):
        chunks = first + tl.arange(0, BLOCK)
        offs = chunks * E_PAD + expert
        counts = tl.load(counts_ptr + offs, mask=chunks < num_chunks, other=0)
        tl.store(cum_counts_ptr + offs, tl.cumsum(counts, axis=0) + carry, mask=chunks < num_chunks)
        carry += tl.sum(counts, axis=0)


@triton.jit
def _scatter_kernel(
    topk_ids_ptr,
    counts_ptr,  # [num_chunks, E_PAD] int32 (unless COUNT_HERE)
    cum_counts_ptr,  # [num_chunks, E_PAD] int32: inclusive cumsum of counts over chunks (unless COUNT_HERE
    # or SUM_HERE)
    sorted_ids_ptr,  # [num_rows] int32
    expert_ids_ptr,  # [num_rows // BLOCK_M] int32
    num_slots,
    num_chunks,
    num_rows,
    num_experts,
    E_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_S: tl.constexpr,
    LABEL_ROWS: tl.constexpr,
    COUNT_HERE: tl.constexpr,  # one chunk holds every slot: count them here, no count kernel
    SUM_HERE: tl.constexpr,  # sum the counts of the chunks before this one here (no cum_counts)
    CHUNKS_PAD: tl.constexpr,  # num_chunks rounded up to a power of two (SUM_HERE)
):
    pid = tl.program_id(0)  # scatters chunk pid (if there is one), labels rows strided over programs
    experts = tl.arange(0, E_PAD)
    if COUNT_HERE:
        first_ids = tl.load(topk_ids_ptr + tl.arange(0, BLOCK_S), mask=tl.arange(0, BLOCK_S) < num_slots,
                            other=-1)
        totals = tl.sum((first_ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
        before = tl.zeros([E_PAD], dtype=tl.int32)
    elif SUM_HERE:
        chunks = tl.arange(0, CHUNKS_PAD)
        counts = tl.load(counts_ptr + chunks[:, None] * E_PAD + experts[None, :],
                         mask=chunks[:, None] < num_chunks, other=0)  # [CHUNKS_PAD, E_PAD]
        totals = tl.sum(counts, axis=0)
        before = tl.sum(tl.where(chunks[:, None] < pid, counts, 0), axis=0)  # (all, past the chunks)
    else:
        totals = tl.load(cum_counts_ptr + (num_chunks - 1) * E_PAD + experts)
        # Each expert's slots in the chunks before this one (programs past the chunks scatter nothing:
        # any in-bounds row does for them).
        row = tl.minimum(pid, num_chunks - 1) * E_PAD + experts
        before = tl.load(cum_counts_ptr + row) - tl.load(counts_ptr + row)
    padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)  # expert e owns sorted rows [ends[e] - padded[e], ends[e])
    starts = ends - padded

    offs = pid * BLOCK_S + tl.arange(0, BLOCK_S)
    valid = offs < num_slots
    ids = tl.load(topk_ids_ptr + offs, mask=valid, other=-1)  # -1 matches no expert
    hits = (ids[:, None] == experts[None, :]).to(tl.int32)  # [BLOCK_S, E_PAD], one 1 per valid row
    rank = tl.cumsum(hits, axis=0)  # 1 + earlier slots of the same expert in this chunk, on the hits
    pos = tl.sum(hits * (rank - 1 + (starts + before)[None, :]), axis=1)  # its sorted row
    tl.store(sorted_ids_ptr + pos, offs.to(tl.int32), mask=valid)

    # The other rows: a row's expert is the number of experts whose rows end at or before it (empty
    # experts end where they start and are skipped; rows past every expert get E_PAD). Rows past an
    # expert's slots are padding (never the rows scattered above: no two programs write one row);
    # the first row of each block labels the block, -1 past every expert.
    filled_ends = starts + totals
    num_programs = tl.num_programs(0)
    for first in range(pid * LABEL_ROWS, num_rows, num_programs * LABEL_ROWS):
        rows = first + tl.arange(0, LABEL_ROWS)
        in_range = rows < num_rows
        owner = tl.sum((ends[None, :] <= rows[:, None]).to(tl.int32), axis=1)
        filled_end = tl.sum(tl.where(owner[:, None] == experts[None, :], filled_ends[None, :], 0), axis=1)
        pad = tl.zeros([LABEL_ROWS], dtype=tl.int32) + num_slots
        tl.store(sorted_ids_ptr + rows, pad, mask=in_range & (rows >= filled_end))
        label = tl.where(owner < num_experts, owner, -1)
        tl.store(expert_ids_ptr + rows // BLOCK_M, label, mask=in_range & (rows % BLOCK_M == 0))


@dataclass(frozen=True, slots=True)
class MoeAlignment:
    sorted_ids: torch.Tensor  # [num_blocks * block_m] int32: slots grouped by expert, num_slots = pad
    expert_ids: torch.Tensor  # [num_blocks] int32: each block's expert, -1 past the real blocks


def max_num_blocks(num_slots: int, num_experts: int, block_m: int) -> int:
    """Blocks for the worst routing: every expert that receives a slot pads fewer than block_m rows."""
    return triton.cdiv(num_slots + min(num_experts, num_slots) * (block_m - 1), block_m)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int,
              block_s: int | None = None) -> MoeAlignment:
    """Group the slots of topk_ids [T, top_k] (int32 or int64) by expert, in slot order within each
    expert, each expert padded to a multiple of block_m rows. block_s (tests): slots per chunk and
    rows per labelling step, forcing the multi-launch path."""
    num_slots = topk_ids.numel()
    e_pad = triton.next_power_of_2(num_experts)
    one_launch = block_s is None and triton.next_power_of_2(num_slots) * e_pad <= ONE_LAUNCH_TILE_ELEMENTS
    label_rows = block_s or max(MIN_ALIGN_BLOCK_S, ALIGN_TILE_ELEMENTS // e_pad)
    if one_launch:
        block_s = max(MIN_ALIGN_BLOCK_S, triton.next_power_of_2(num_slots))
    block_s = block_s or label_rows
    num_chunks = triton.cdiv(num_slots, block_s)
    num_rows = max_num_blocks(num_slots, num_experts, block_m) * block_m
    device = topk_ids.device
    ids = topk_ids.reshape(-1)
    sorted_ids = torch.empty(num_rows, dtype=torch.int32, device=device)
    expert_ids = torch.empty(num_rows // block_m, dtype=torch.int32, device=device)
    counts = cum_counts = sorted_ids  # not read with COUNT_HERE (cum_counts: nor with SUM_HERE)
    sum_here = not one_launch and num_chunks <= MAX_SUMMED_CHUNKS
    if not one_launch:
        counts = torch.empty(num_chunks, e_pad, dtype=torch.int32, device=device)
        _count_kernel[(num_chunks,)](ids, counts, num_slots, E_PAD=e_pad, BLOCK_S=block_s)
        if not sum_here:
            cum_counts = torch.empty_like(counts)
            _chunk_scan_kernel[(e_pad,)](counts, cum_counts, num_chunks, E_PAD=e_pad,
                                         BLOCK=min(SCAN_BLOCK, triton.next_power_of_2(num_chunks)))
    num_programs = max(num_chunks, triton.cdiv(num_rows, label_rows))
    chunks_pad = triton.next_power_of_2(num_chunks)
    tile = max(block_s, chunks_pad if sum_here else 0) * e_pad
    _scatter_kernel[(num_programs,)](ids, counts, cum_counts, sorted_ids, expert_ids, num_slots, num_chunks,
                                     num_rows, num_experts, E_PAD=e_pad, BLOCK_M=block_m, BLOCK_S=block_s,
                                     LABEL_ROWS=label_rows, COUNT_HERE=one_launch, SUM_HERE=sum_here,
                                     CHUNKS_PAD=chunks_pad,
                                     num_warps=8 if tile > ALIGN_TILE_ELEMENTS else 4)
    return MoeAlignment(sorted_ids, expert_ids)
