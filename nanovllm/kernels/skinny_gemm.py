"""Skinny GEMM in Triton: out[M, N] = x[M, K] @ weight[N, K]^T (+ bias) for decode-sized M <= 16.

At M <= 16 a linear layer costs one read of its weight (N * K * 2 bytes in bf16); FLOPs are free. So each
program owns BLOCK_N output columns for all M rows and streams its [BLOCK_N, K] slab of the weight in
[BLOCK_N, BLOCK_K] tiles, pipelined num_stages deep (cp.async into shared memory) so that enough bytes are
in flight to cover HBM latency; x is tiny and stays in L2. Two inner products, chosen by M:

    M == 1 (GEMV):  acc[BLOCK_N, BLOCK_K] += w * x elementwise in float32, summed across lanes once at
                    the end (no per-tile shuffles);
    M in 2..16:     tl.dot(x[16, BLOCK_K], w^T) on tensor cores, x padded to 16 masked rows: the padding
                    costs tensor-core FLOPs, not bytes.

Split-K (grid axis 1) is used only when too few column blocks exist to keep the SMs busy. It stays
deterministic: float32 partials go to a [split_k, M, N] workspace that a second kernel sums in a fixed order.
All sizes come from shapes (no host sync, no data-dependent allocation), so calls are CUDA-graph capturable.
Accumulation is float32; the result is in x's dtype.
"""

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nanovllm.kernels.kv_cache import dot_precision

# Decode batches up to this many rows: one tl.dot tile of rows. Beyond that each weight byte feeds enough
# FLOPs that cuBLAS's tiled GEMMs are the right tool.
MAX_SKINNY_M = 16
# M == 1 is a GEMV on CUDA cores; larger M goes to tensor cores, whose tl.dot needs at least 16 rows.
MAX_GEMV_M = 1
DOT_BLOCK_M = 16
# Bytes of weight the whole GPU should have requested but not yet received: H200 HBM (~4.8 TB/s) times a
# loaded-memory latency of ~0.8 us (Little's law). The pipeline depth is chosen so that the resident
# programs' prefetched tiles add up to this; fewer leave bandwidth idle, more only cost shared memory.
TARGET_BYTES_IN_FLIGHT = 4 << 20
# Programs per SM wanted before a narrower BLOCK_N (more column blocks) is preferred: two let one
# program's loads overlap another's epilogue and soften the tail of the grid.
PROGRAMS_PER_SM = 2
# Split K only when the column blocks would leave more than 3/4 of the SMs idle: then one SM's own
# load bandwidth (~100-200 GB/s), not latency, caps the kernel, and the extra reduce launch is worth it.
MIN_BLOCKS_PER_SM_NO_SPLIT = 0.25
# GEMV tile: 4096 weights (8 KB of bf16) is 32 float32 partial sums per thread at 4 warps (~70 registers
# in all on sm_90), leaving room for several resident programs per SM.
GEMV_TILE_ELEMENTS = 4096
GEMV_NUM_WARPS = 4
GEMV_WIDTHS = (16, 8, 4)
# Dot tile: mma.sync takes both operands from registers, so a thread holds (16 + BLOCK_N) * BLOCK_K / threads
# 16-bit values per tile; 128 of them (64 registers) compiles without spills on sm_90 (16 x 1024 spilled).
DOT_OPERANDS_PER_THREAD = 128
DOT_WIDTHS = (64, 32, 16)
# An mma.sync tile is 8 columns wide: one warp per 8 columns means no warp repeats another's loads of the
# weight from shared memory.
DOT_COLUMNS_PER_WARP = 8
MAX_DOT_NUM_WARPS = 4
# Pipeline depth bounds (num_stages - 1 tiles are in flight). The shared-memory bound counts x and w
# staged for every stage, an overestimate (8 stages of a 16 x 256 bf16 dot tile compile to 64 KB on sm_90,
# not 128 KB), and stays well under the 227 KB one Hopper program may use.
MIN_NUM_STAGES = 3
MAX_NUM_STAGES = 8
SMEM_BUDGET = 160 << 10
# tl.dot's smallest K.
MIN_BLOCK_K = 16
# The split-K reduce: one program sums this many columns of one row.
REDUCE_BLOCK_N = 256
# SM count assumed off-GPU (the Triton interpreter): an H100/H200 has 132.
DEFAULT_NUM_SMS = 132


@dataclass(frozen=True, slots=True)
class SkinnyConfig:
    """Launch parameters of one call; `skinny_config` picks them from shapes, benchmarks may pass others."""

    use_dot: bool  # False: the M == 1 GEMV path
    block_n: int  # output columns per program (a power of two; >= 16 with use_dot)
    block_k: int  # K elements per weight tile (a power of two)
    split_k: int = 1  # programs per column block, each summing a contiguous range of K
    num_warps: int = 4
    num_stages: int = 3  # software-pipeline depth of the K loop: num_stages - 1 tiles in flight


@triton.jit
def _skinny_gemm_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,  # [M, N] in x's dtype, or with WRITE_PARTIAL a [split_k, M, N] float32 workspace
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    tiles_per_split,  # K tiles per split (a tile count, so the compiler sees k is a multiple of BLOCK_K)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    WRITE_PARTIAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    # Columns past N read the last real weight row instead of being masked (their sums are never
    # stored), so the weight load needs only the K mask, which is uniform along each row.
    w_rows = w_ptr + tl.minimum(offs_n, N - 1).to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    k_start = pid_k * tiles_per_split * BLOCK_K
    k_end = tl.minimum(k_start + tiles_per_split * BLOCK_K, K)

    if USE_DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    else:
        partial = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    # num_stages on the loop itself: Triton pipelines loads that feed no tl.dot (the GEMV path) only then.
    for k in tl.range(k_start, k_end, BLOCK_K, num_stages=NUM_STAGES):
        offs_k = k + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        w = tl.load(w_rows + offs_k[None, :], mask=k_mask[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
        if USE_DOT:
            x = tl.load(
                x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                mask=m_mask[:, None] & k_mask[None, :],
                other=0.0,
            )  # [BLOCK_M, BLOCK_K]
            acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
        else:
            x = tl.load(x_ptr + offs_k, mask=k_mask, other=0.0)  # row 0 only: M == 1
            partial += w.to(tl.float32) * x.to(tl.float32)[None, :]
    if not USE_DOT:
        acc = tl.sum(partial, axis=1)[None, :]  # [1, BLOCK_N]

    mask = m_mask[:, None] & n_mask[None, :]
    if WRITE_PARTIAL:
        partial_rows = pid_k * M + offs_m
        tl.store(out_ptr + partial_rows[:, None] * N + offs_n[None, :], acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _split_k_reduce_kernel(
    partial_ptr,  # [SPLIT_K, M, N] float32
    bias_ptr,
    out_ptr,
    M,
    N,
    stride_om,
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    # A fixed summation order: the same inputs give the same bits on every run.
    for split in tl.static_range(SPLIT_K):
        acc += tl.load(partial_ptr + (split * M + row) * N + offs_n, mask=n_mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_mask)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_NUM_SMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_properties(index).multi_processor_count


def skinny_config(m: int, n: int, k: int, element_size: int, num_sms: int = DEFAULT_NUM_SMS) -> SkinnyConfig:
    """Launch parameters for x[m, k] @ weight[n, k]^T from shapes alone (no autotuning, so a graph capture
    never compiles or times anything). BLOCK_N: the widest that still gives PROGRAMS_PER_SM programs per
    SM. BLOCK_K: a register budget. num_stages: enough prefetched tiles over the resident programs to
    reach TARGET_BYTES_IN_FLIGHT. Qwen3-0.6B at M == 1: 4 x 1024 tiles for N = 1024, 8 x 512 for N = 4096,
    16 x 256 for N = 6144; at M > 1: 16 x 256 tiles, 8 stages for N = 1024 and 3 for N >= 4096."""
    use_dot = m > MAX_GEMV_M
    wanted_blocks = PROGRAMS_PER_SM * num_sms
    widths = DOT_WIDTHS if use_dot else GEMV_WIDTHS
    block_n = next((w for w in widths if triton.cdiv(n, w) >= wanted_blocks), widths[-1])
    if use_dot:
        num_warps = max(1, min(MAX_DOT_NUM_WARPS, block_n // DOT_COLUMNS_PER_WARP))
        block_k = DOT_OPERANDS_PER_THREAD * 32 * num_warps // (DOT_BLOCK_M + block_n)
        stage_rows = DOT_BLOCK_M + block_n  # x is staged in shared memory next to each weight tile
    else:
        num_warps = GEMV_NUM_WARPS
        block_k = GEMV_TILE_ELEMENTS // block_n
        stage_rows = 1 + block_n
    # Round down to a power of two, and no wider than K itself.
    block_k = max(MIN_BLOCK_K, min(1 << (block_k.bit_length() - 1), triton.next_power_of_2(k)))
    num_tiles = triton.cdiv(k, block_k)

    num_blocks = triton.cdiv(n, block_n)
    split_k = 1
    if num_blocks < MIN_BLOCKS_PER_SM_NO_SPLIT * num_sms:
        split_k = max(1, min(triton.cdiv(num_sms, num_blocks), num_tiles))
    # Only programs resident at the same time have bytes in flight.
    resident = min(num_blocks * split_k, wanted_blocks)
    tiles_in_flight = triton.cdiv(TARGET_BYTES_IN_FLIGHT, resident * block_n * block_k * element_size)
    max_stages = min(MAX_NUM_STAGES, SMEM_BUDGET // (stage_rows * block_k * element_size))
    # A loop of num_tiles tiles gains nothing from more than num_tiles tiles in flight.
    num_stages = max(MIN_NUM_STAGES, min(tiles_in_flight, triton.cdiv(num_tiles, split_k)) + 1)
    num_stages = max(2, min(num_stages, max_stages))
    return SkinnyConfig(use_dot, block_n, block_k, split_k, num_warps, num_stages)


def skinny_linear(
    x: torch.Tensor,  # [M, K], M <= MAX_SKINNY_M, last dim contiguous (may be a column slice)
    weight: torch.Tensor,  # [N, K], last dim contiguous (an nn.Linear weight)
    bias: torch.Tensor | None = None,  # [N]
    out: torch.Tensor | None = None,  # [M, N] in x's dtype, last dim contiguous
    *,
    config: SkinnyConfig | None = None,  # default: skinny_config(...) from the shapes
) -> torch.Tensor:
    """x @ weight.T (+ bias) in x's dtype with float32 accumulation, for M <= MAX_SKINNY_M rows.
    No host sync and only shape-sized allocations, so it can run inside a captured CUDA graph."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} must be [M, K] and [N, K]")
    (m, k), n = x.shape, weight.shape[0]
    if m > MAX_SKINNY_M:
        raise ValueError(f"skinny_linear handles at most {MAX_SKINNY_M} rows; got {m}: use F.linear")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x dtype {x.dtype} is not float16, bfloat16 or float32")
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(
            f"weight {weight.dtype} and bias {None if bias is None else bias.dtype} must match x's {x.dtype}"
        )
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias has shape {tuple(bias.shape)}; expected ({n},)")
    if x.stride(-1) != 1 or weight.stride(-1) != 1 or (bias is not None and not bias.is_contiguous()):
        raise ValueError("x and weight need a contiguous last (K) dimension and bias must be contiguous")
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or out.dtype != x.dtype or out.stride(-1) != 1:
        raise ValueError(
            f"out must be ({m}, {n}) {x.dtype} with a contiguous last dim; got {tuple(out.shape)} {out.dtype}"
        )
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.copy_(bias.expand(m, n)) if bias is not None else out.zero_()
    if config is None:
        config = skinny_config(m, n, k, x.element_size(), _num_sms(x.device))
    elif not config.use_dot and m > MAX_GEMV_M:
        raise ValueError(f"the GEMV path (use_dot=False) handles {MAX_GEMV_M} row; got {m}")

    # Each split covers whole tiles, so none but the last sees the ragged end of K.
    num_tiles = triton.cdiv(k, config.block_k)
    split_k = max(1, min(config.split_k, num_tiles))
    tiles_per_split = triton.cdiv(num_tiles, split_k)
    split_k = triton.cdiv(num_tiles, tiles_per_split)  # drop splits that would get no tile
    write_partial = split_k > 1
    target = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device) if write_partial else out
    _skinny_gemm_kernel[(triton.cdiv(n, config.block_n), split_k)](
        x,
        weight,
        bias if bias is not None else x,  # never read without HAS_BIAS
        target,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        tiles_per_split,
        BLOCK_M=DOT_BLOCK_M if config.use_dot else 1,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        USE_DOT=config.use_dot,
        HAS_BIAS=bias is not None,
        WRITE_PARTIAL=write_partial,
        DOT_PRECISION=dot_precision(x.dtype),
        NUM_STAGES=config.num_stages,
        num_warps=config.num_warps,
    )
    if write_partial:
        _split_k_reduce_kernel[(m, triton.cdiv(n, REDUCE_BLOCK_N))](
            target,
            bias if bias is not None else x,
            out,
            m,
            n,
            out.stride(0),
            SPLIT_K=split_k,
            HAS_BIAS=bias is not None,
            BLOCK_N=REDUCE_BLOCK_N,
        )
    return out
