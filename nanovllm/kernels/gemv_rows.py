"""The GEMV of kernels/skinny_gemm.py for a few rows: out[M, N] = x[M, K] @ weight[N, K]^T (+ bias) for
1 <= M <= MAX_ROWS, on CUDA cores, with the SiLU-mul before a down projection folded in or not.

At one row the GEMV streams a layer's weights in ~440 us a step (Qwen3-0.6B, 28 layers), while the
tensor-core rows kernel (kernels/skinny_rows.py) takes ~730 at two rows with its SiLU-mul kernel: its
16-row weight tiles, the dot's smallest, leave the N = 1024 projections 64 programs for 132 SMs, and it
cannot fold the SiLU-mul in. The weight is nearly all the bytes at these M and FLOPs are free, so each
weight tile here multiplies every row of x in turn: the one-row GEMV's programs and tiles, its K tile
cut by the rows so that the float32 partials, [ROWS, BLOCK_N, BLOCK_K], take the registers one row's do.

Measured on an H200 (28 calls of each Qwen3-0.6B linear, us; docs/performance-notes.md, section "Decode
GEMMs and GEMVs"; commit 3b5c364, 2026-12-01):
at two rows o_proj 96 against the rows kernel's 138 and down_proj with its SiLU-mul 146 against ~210-300,
but q/k/v and gate/up with their RMSNorm folded in 199 and 236 against 180 and 198, and from three rows
every shape but o_proj lost. So the layers take it at two rows for o_proj and down_proj alone
(layers/linear_methods.py, SkinnyLinearMethod.BUCKETS); a norm is never folded in here.

An e4m3 weight with one scale a row (kernels/fp8_skinny.py) is widened to float32 like a bf16 one, its
scale multiplying the finished sums; its launch plan counts one byte an element.

Rows past M (ROWS is a power of two) read as zeros and are not stored. PDL and split-K as in
skinny_gemm. Sizes come from shapes alone: CUDA-graph capturable."""

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from nanovllm.kernels.common import sm_count
from nanovllm.kernels.skinny_gemm import PLAIN, SILU_MUL, check_rows, weight_tile
from nanovllm.kernels.skinny_launch import (
    MAX_NUM_STAGES,
    MIN_BLOCK_K,
    PDL_PRELOAD_TILES,
    SkinnyConfig,
    skinny_config,
)
from nanovllm.kernels.split_k import plan_split_k, reduce_split_k, split_k_workspace

MAX_ROWS = 4


@triton.jit
def _rows_tile(partial, w, k, k_end, x_rows, row_mask, K, PROLOGUE: tl.constexpr, BLOCK_K: tl.constexpr):
    """partial[r] += w * x[r, k : k + BLOCK_K] (x through the prologue); x_rows: [ROWS, 1] row pointers."""
    offs_k = k + tl.arange(0, BLOCK_K)
    mask = row_mask & (offs_k < k_end)[None, :]
    xf = tl.load(x_rows + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)  # [ROWS, BLOCK_K]
    if PROLOGUE == SILU_MUL:
        up = tl.load(x_rows + K + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
        # Rounded to x's dtype as the SiLU-mul kernel's output is.
        xf = (xf / (1.0 + tl.exp(-xf)) * up).to(x_rows.dtype.element_ty).to(tl.float32)
    return partial + w.to(tl.float32)[None, :, :] * xf[:, None, :]


@triton.jit
def _gemv_rows_kernel(
    x_ptr,  # [M, K] rows stride_xm apart ([M, 2K] for SILU_MUL: gate then up)
    w_ptr,
    bias_ptr,
    out_ptr,  # [M, N] in x's dtype, rows stride_om apart; WRITE_PARTIAL: a [split_k, M, N] float32 workspace
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    tiles_per_split,
    w_scale_ptr,  # SCALED: an fp8 weight's float32 [N] scales, one a row (weight[n, k] * w_scale[n])
    ROWS: tl.constexpr,  # M rounded up to a power of two
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    WRITE_PARTIAL: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    PROLOGUE: tl.constexpr = PLAIN,
    PDL: tl.constexpr = False,
    PRELOAD: tl.constexpr = 0,
    SCALED: tl.constexpr = False,  # fp8 weights: their row's scale multiplies the sums (partials too)
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows = tl.arange(0, ROWS)
    row_mask = (rows < M)[:, None]
    x_rows = x_ptr + rows[:, None] * stride_xm
    # As in skinny_gemm: columns past N read the last real weight row (never stored), so the weight load
    # needs only the K mask.
    w_rows = w_ptr + tl.minimum(offs_n, N - 1).to(tl.int64)[:, None] * stride_wn
    k_start = pid_k * tiles_per_split * BLOCK_K
    k_end = tl.minimum(k_start + tiles_per_split * BLOCK_K, K)
    partial = tl.zeros([ROWS, BLOCK_N, BLOCK_K], dtype=tl.float32)
    offs = tl.arange(0, BLOCK_K)
    k_loop = k_start
    if PRELOAD >= 1:
        w0 = weight_tile(w_rows, k_start, k_end, offs)
    if PRELOAD >= 2:
        w1 = weight_tile(w_rows, k_start + BLOCK_K, k_end, offs)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    if PRELOAD >= 1:
        partial = _rows_tile(partial, w0, k_start, k_end, x_rows, row_mask, K, PROLOGUE, BLOCK_K)
    if PRELOAD >= 2:
        partial = _rows_tile(partial, w1, k_start + BLOCK_K, k_end, x_rows, row_mask, K, PROLOGUE, BLOCK_K)
    k_loop += PRELOAD * BLOCK_K
    for k in tl.range(k_loop, k_end, BLOCK_K, num_stages=NUM_STAGES):
        w = tl.load(w_rows + (k + offs)[None, :], mask=(k + offs < K)[None, :], other=0.0)
        partial = _rows_tile(partial, w, k, K, x_rows, row_mask, K, PROLOGUE, BLOCK_K)
    acc = tl.sum(partial, axis=2)  # [ROWS, BLOCK_N]
    if SCALED:
        acc = acc * tl.load(w_scale_ptr + tl.minimum(offs_n, N - 1))[None, :]
    out_mask = row_mask & n_mask[None, :]
    if WRITE_PARTIAL:
        tl.store(out_ptr + (pid_k * M + rows[:, None]) * N + offs_n[None, :], acc, mask=out_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rows[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=out_mask)


def gemv_rows_config(n: int, k: int, m: int, element_size: int, num_sms: int) -> SkinnyConfig:
    """The one-row GEMV's settings (skinny_config) with the K tile cut by the rows (a power of two), so
    the partials take the registers one row's do; the pipeline keeps the bytes in flight."""
    rows = triton.next_power_of_2(m)
    one = skinny_config(n, k, element_size, num_sms)
    block_k = max(MIN_BLOCK_K, one.block_k // rows)
    num_stages = min(one.num_stages * (one.block_k // block_k), 2 * one.num_stages, MAX_NUM_STAGES)
    return SkinnyConfig(one.block_n, block_k, one.split_k, one.num_warps, num_stages, one.preload)


def launch_gemv_rows(x, weight, bias, out, pdl: bool = False, prologue: tl.constexpr = PLAIN,
                     config: SkinnyConfig | None = None, weight_scale=None) -> torch.Tensor:
    """out[:M] = prologue(x) @ weight.T (+ bias); the callers check shapes and dtypes. weight_scale: an e4m3
    weight's float32 scales, one a row ([N] or [N, 1], contiguous)."""
    m, (n, k) = x.shape[0], weight.shape
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"the few-row GEMV takes 1 to {MAX_ROWS} rows, not {m}")
    if config is None:
        config = gemv_rows_config(n, k, m, weight.element_size(), sm_count(x.device))
    split = plan_split_k(k, config.block_k, config.split_k)
    write_partial = split.splits > 1
    target = split_k_workspace(split, m, n, x.device) if write_partial else out
    preload = PDL_PRELOAD_TILES * pdl if config.preload is None else config.preload
    _gemv_rows_kernel[(triton.cdiv(n, config.block_n), split.splits)](
        x, weight, bias if bias is not None else x, target, m, n, k,
        x.stride(0), weight.stride(0), out.stride(0), split.tiles_per_split,
        weight_scale if weight_scale is not None else x,  # never read unless SCALED
        ROWS=triton.next_power_of_2(m), BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        HAS_BIAS=bias is not None, WRITE_PARTIAL=write_partial, NUM_STAGES=config.num_stages,
        PROLOGUE=prologue.value, PDL=pdl, PRELOAD=min(preload, split.tiles_per_split),
        num_warps=config.num_warps, launch_pdl=pdl, SCALED=weight_scale is not None,
    )
    return reduce_split_k(target, bias, out) if write_partial else out


def gemv_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     pdl: bool = False) -> torch.Tensor:
    """x @ weight.T (+ bias) for 1 to MAX_ROWS rows, in x's dtype with float32 accumulation."""
    n, k = weight.shape
    check_rows(x, k, weight, bias, MAX_ROWS)
    out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    return launch_gemv_rows(x, weight, bias, out, pdl)


def gemv_rows_silu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                          pdl: bool = False) -> torch.Tensor:
    """(silu(gate) * up) @ weight.T (+ bias) for 1 to MAX_ROWS rows x = [gate | up] ([M, 2K]), in one
    kernel; equal to SiLU-mul-then-GEMV (the product is rounded to x's dtype as that kernel's is)."""
    n, k = weight.shape
    check_rows(x, 2 * k, weight, bias, MAX_ROWS)
    out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    return launch_gemv_rows(x, weight, bias, out, pdl, SILU_MUL)
