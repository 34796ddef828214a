"""Fused mixture-of-experts in Triton: tokens sorted by expert on the device, then one grouped GEMM
per projection.

A "slot" is one (token, k) pair of the routing, slot = token * top_k + k, for num_slots = T * top_k.

1. Align (`moe_align`): the slots are grouped by expert, each expert's group padded to a multiple of
   BLOCK_M rows, so that every BLOCK_M-row block of the sorted order belongs to one expert:

       sorted_ids  |e0 s s s - |e1 s - - - |e3 s s s s |e3 s - - - | - - ...     (- : pad = num_slots)
       expert_ids  |    0      |    1      |    3      |    3      | -1  ...     (one per block)

   Few slots (decode at small batch): one launch, `_scatter_kernel` counting them itself. Otherwise
   `_count_kernel` counts each chunk of BLOCK_S slots' experts, torch.cumsum turns the counts into
   per-chunk offsets, and `_scatter_kernel` places every slot (stable: slot order within an expert,
   so the result is deterministic), writes the padding and labels the blocks. No host sync.
2. Gate+up (`_grouped_gemm_kernel`, GATED): per block, x[token] @ w13[e]^T for the gate and the up
   rows of the same tile at once, silu(gate) * up -> intermediate [num_slots, I].
3. Down (same kernel): intermediate @ w2[e]^T times the slot's routing weight -> [num_slots, H], then
   the top_k slots of each token are summed (in a fixed order).

CUDA graphs: every buffer and grid is sized from (num_tokens, top_k, num_experts) alone. The number of
blocks is bounded by num_slots + min(E, num_slots) * (BLOCK_M - 1) padded rows (each expert that got a
slot pads fewer than BLOCK_M rows); blocks past the real ones get expert -1 and their programs return at
once. So nothing reads the routing on the host, and a decode step replays with any routing.

The file is over 250 lines because the three kernels share one slot/block layout and its sizing."""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nanovllm.kernels.common import dot_precision

# Align kernels: a chunk of BLOCK_S slots (or of sorted rows) is compared with every expert at once, a
# [BLOCK_S, E_PAD] tile; this many elements keeps it in registers (32 per thread at 4 warps).
ALIGN_TILE_ELEMENTS = 4096
MIN_ALIGN_BLOCK_S = 16
# Up to this tile size, one chunk takes every slot and a single launch aligns them (batch <= 8 for
# 128 experts at top-8): decode at small batch is bound by launches, not by this work.
ONE_LAUNCH_TILE_ELEMENTS = 8192


@dataclass(frozen=True, slots=True)
class MoeConfig:
    """Launch parameters of the grouped GEMMs; `moe_config` picks them from shapes alone (no autotuning,
    so a CUDA-graph capture never compiles or times anything)."""

    block_m: int  # sorted rows per block: every expert's slot count is padded to a multiple
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


# Slots per expert (on average) below which the GEMMs take 16-row, then 32-row blocks; above, 64.
FEW_SLOTS_PER_EXPERT = 8
SOME_SLOTS_PER_EXPERT = 32
# Below this many slots (decode batch < 8 at top-8) few experts are hit: 32-column tiles make twice
# as many programs as 64-column ones, to keep every SM streaming weights.
NARROW_TILE_MAX_SLOTS = 64


def moe_config(num_slots: int, num_experts: int, dtype: torch.dtype) -> MoeConfig:
    """Few slots per expert (decode): 16-row blocks, so padding wastes little, and narrow column tiles,
    so that the few experts hit still spread over every SM. Many (prefill): larger tiles reuse each
    weight tile over more rows. Untuned guesses for Hopper; scripts/moe_bench.py times alternatives."""
    per_expert = num_slots / num_experts
    small_k = 64 if dtype == torch.float32 else 128  # same bytes per tile
    if per_expert < FEW_SLOTS_PER_EXPERT:
        block_n = 32 if num_slots < NARROW_TILE_MAX_SLOTS else 64
        return MoeConfig(16, block_n, small_k, num_warps=4, num_stages=4)
    if per_expert < SOME_SLOTS_PER_EXPERT:
        return MoeConfig(32, 64, small_k // 2, num_warps=4, num_stages=4)
    return MoeConfig(64, 128, small_k // 2, num_warps=8, num_stages=3)


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
def _scatter_kernel(
    topk_ids_ptr,
    counts_ptr,  # [num_chunks, E_PAD] int32 (unless COUNT_HERE)
    cum_counts_ptr,  # [num_chunks, E_PAD] int32: inclusive cumsum of counts over chunks (unless COUNT_HERE)
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
):
    pid = tl.program_id(0)  # scatters chunk pid (if there is one), labels rows strided over programs
    experts = tl.arange(0, E_PAD)
    if COUNT_HERE:
        first_ids = tl.load(topk_ids_ptr + tl.arange(0, BLOCK_S), mask=tl.arange(0, BLOCK_S) < num_slots,
                            other=-1)
        totals = tl.sum((first_ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
        before = tl.zeros([E_PAD], dtype=tl.int32)
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


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,  # [rows, K]: x (row = token) for gate+up, the intermediate (row = slot) for down
    w_ptr,  # [E, N or 2N, K]
    out_ptr,  # [num_slots, N]
    sorted_ids_ptr,
    expert_ids_ptr,
    topk_weights_ptr,  # [num_slots] float32
    num_slots,
    N,
    K,
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    A_ROWS_PER_SLOT_DIV: tl.constexpr,  # a row = slot // this: top_k for x, 1 for the intermediate
    GATED: tl.constexpr,  # w rows [0, N) are the gate, [N, 2N) the up: out = silu(a @ gate^T) * (a @ up^T)
    MUL_ROUTED_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)  # fastest: neighbouring blocks of one expert share its weight tiles in L2
    pid_n = tl.program_id(1)
    expert = tl.load(expert_ids_ptr + pid_m)
    if expert < 0:  # a block past the real ones (the grid is sized for the worst routing)
        return
    slots = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = slots < num_slots
    a_rows = a_ptr + (slots // A_ROWS_PER_SLOT_DIV).to(tl.int64)[:, None] * stride_am  # [BLOCK_M, 1]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    # Columns past N read the last real weight row (never stored), so loads need only the K mask.
    w_rows = w_ptr + expert.to(tl.int64) * stride_we + tl.minimum(offs_n, N - 1)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if GATED:
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = tl.load(a_rows + offs_k[None, :], mask=valid[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_rows + offs_k[None, :], mask=k_mask[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
        acc = tl.dot(a, tl.trans(w), acc, input_precision=DOT_PRECISION)
        if GATED:
            w_up = tl.load(w_rows + N * stride_wn + offs_k[None, :], mask=k_mask[None, :], other=0.0)
            acc_up = tl.dot(a, tl.trans(w_up), acc_up, input_precision=DOT_PRECISION)
    if GATED:
        acc = acc * tl.sigmoid(acc) * acc_up
    if MUL_ROUTED_WEIGHT:
        acc *= tl.load(topk_weights_ptr + slots, mask=valid, other=0.0)[:, None]
    out = out_ptr + slots.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


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
    counts = cum_counts = sorted_ids  # not read with COUNT_HERE
    if not one_launch:
        counts = torch.empty(num_chunks, e_pad, dtype=torch.int32, device=device)
        _count_kernel[(num_chunks,)](ids, counts, num_slots, E_PAD=e_pad, BLOCK_S=block_s)
        cum_counts = torch.cumsum(counts, dim=0, dtype=torch.int32)
    num_programs = max(num_chunks, triton.cdiv(num_rows, label_rows))
    _scatter_kernel[(num_programs,)](ids, counts, cum_counts, sorted_ids, expert_ids, num_slots, num_chunks,
                                     num_rows, num_experts, E_PAD=e_pad, BLOCK_M=block_m, BLOCK_S=block_s,
                                     LABEL_ROWS=label_rows, COUNT_HERE=one_launch,
                                     num_warps=8 if block_s * e_pad > ALIGN_TILE_ELEMENTS else 4)
    return MoeAlignment(sorted_ids, expert_ids)


def _grouped_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, align: MoeAlignment,
                  topk_weights: torch.Tensor, top_k: int, gated: bool, config: MoeConfig) -> None:
    n, k = out.shape[1], w.shape[2]
    grid = (align.expert_ids.numel(), triton.cdiv(n, config.block_n))
    _grouped_gemm_kernel[grid](
        a, w, out, align.sorted_ids, align.expert_ids, topk_weights, out.shape[0], n, k,
        a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        A_ROWS_PER_SLOT_DIV=top_k, GATED=gated, MUL_ROUTED_WEIGHT=not gated,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        DOT_PRECISION=dot_precision(a.dtype), num_warps=config.num_warps, num_stages=config.num_stages,
    )


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, config: MoeConfig | None = None) -> torch.Tensor:
    """sum_k topk_weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = topk_ids[t, k], as
    layers.fused_moe.torch_moe. x [T, H]; w13 [E, 2I, H] ([gate; up] rows); w2 [E, H, I];
    topk_weights [T, top_k] (float32 best); topk_ids [T, top_k]. float32 accumulation, x's dtype out."""
    num_tokens, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    top_k = topk_ids.shape[1]
    if w13.shape[2] != hidden or w2.shape != (num_experts, hidden, two_i // 2):
        raise ValueError(f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not fit x {tuple(x.shape)}: "
                         "expected [E, 2I, H] and [E, H, I]")
    if x.stride(-1) != 1 or not (w13.is_contiguous() and w2.is_contiguous()):
        raise ValueError("x needs a contiguous last dim and the expert weights must be contiguous")
    num_slots = num_tokens * top_k
    if num_slots == 0:
        return torch.zeros_like(x)
    config = config or moe_config(num_slots, num_experts, x.dtype)
    align = moe_align(topk_ids, num_experts, config.block_m)
    weights = topk_weights.reshape(-1).float()
    intermediate = torch.empty(num_slots, two_i // 2, dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, intermediate, align, weights, top_k, gated=True, config=config)
    per_slot = torch.empty(num_slots, hidden, dtype=x.dtype, device=x.device)
    _grouped_gemm(intermediate, w2, per_slot, align, weights, 1, gated=False, config=config)
    return per_slot.view(num_tokens, top_k, hidden).sum(dim=1)
