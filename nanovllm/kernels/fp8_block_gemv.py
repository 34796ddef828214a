"""One row of a block-scaled e4m3 weight (Qwen's FP8 checkpoints: one float32 scale a block of `rows` x
`inputs`, 128 x 128) in one kernel: out[1, N] = sum over k of x[k] * w[n, k] * scale[n // rows, k // inputs].

kernels/skinny_gemm.py's GEMV with its tiles shaped [BLOCK_N, GROUPS, WIDTH]: a K tile of BLOCK_K inputs
is GROUPS runs of WIDTH inputs, each inside one scale block (WIDTH = min(inputs, BLOCK_K)), so a tile
needs GROUPS scales, loaded as one small vector and broadcast over their runs: no gather of a scale an
input, no tile narrowed to one group (both took 1.5-2x the per-channel GEMV's time on an H200,
docs/performance-notes.md, "fp8 weights"), and no [N / rows, K] copy of x scaled a block row at a time
(the form before this kernel: 1.4-1.6x its time). A program's
BLOCK_N columns lie in one block row, so its scales are one row of the compact table. The products and
sums are float32, x unrounded: the weight-only reference's sum, reassociated.

Launch settings are skinny_gemm's for a one-byte weight (skinny_launch.skinny_config); split-K, PDL,
preloaded tiles and the SiLU-mul epilogue of a gated MLP's gate/up (GATED) as there; a gated program's gate
and up rows lie in two block rows, so it reads a row of scales for each of its columns. Sizes come from
shapes, so calls are CUDA-graph capturable."""

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from nanovllm.kernels.skinny_gemm import store_gated
from nanovllm.kernels.skinny_launch import PDL_PRELOAD_TILES, SkinnyConfig
from nanovllm.kernels.split_k import plan_split_k, reduce_split_k, split_k_workspace


@triton.jit
def _weight_tile(w_rows, k, K, offs):
    """The [rows, GROUPS, WIDTH] weight tile at K offset k; inputs from K on read as 0."""
    return tl.load(w_rows + (k + offs)[None, :, :], mask=(k + offs < K)[None, :, :], other=0.0)


@triton.jit
def _block_tile(partial, w, k, K, x_ptr, scale_row, offs, INPUTS: tl.constexpr, GROUPS: tl.constexpr,
                WIDTH: tl.constexpr, GATED: tl.constexpr):
    """partial += w * x[k : k + BLOCK_K] * each run's scale (scale_row: the program's row of scales, or
    GATED a [BLOCK_N, 1] pointer a column)."""
    k_mask = k + offs < K
    x = tl.load(x_ptr + k + offs, mask=k_mask, other=0.0).to(tl.float32)  # [GROUPS, WIDTH]
    starts = k + tl.arange(0, GROUPS) * WIDTH
    if GATED:  # (no early return: the compiler would still build what follows a static branch's return)
        scales = tl.load(scale_row + (starts // INPUTS)[None, :], mask=(starts < K)[None, :], other=0.0)
        partial = partial + w.to(tl.float32) * (x[None, :, :] * scales[:, :, None])  # [BLOCK_N, GROUPS]
    else:
        scales = tl.load(scale_row + starts // INPUTS, mask=starts < K, other=0.0)  # [GROUPS]
        partial = partial + w.to(tl.float32) * (x * scales[:, None])[None, :, :]
    return partial


@triton.jit
def _block_gemv_kernel(
    x_ptr,  # [K], contiguous
    w_ptr,  # [N, K] e4m3, last dim contiguous
    bias_ptr,
    out_ptr,  # [N] in x's dtype ([N / 2] GATED), or with WRITE_PARTIAL a [split_k, N] float32 workspace
    scale_ptr,  # [N / ROWS, >= K / INPUTS] float32, rows scale_stride apart
    N,
    K,
    stride_wn,
    scale_stride,
    tiles_per_split,
    BLOCK_N: tl.constexpr,  # divides ROWS: a program's columns share one row of scales
    GROUPS: tl.constexpr,  # runs of WIDTH inputs a tile
    WIDTH: tl.constexpr,  # divides INPUTS, or is INPUTS
    ROWS: tl.constexpr,
    INPUTS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    WRITE_PARTIAL: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    PDL: tl.constexpr = False,
    PRELOAD: tl.constexpr = 0,  # weight tiles (0-2) loaded first: before the wait under PDL
    GATED: tl.constexpr = False,  # weight [gate; up]: silu(gate) * up out (skinny_gemm's GATED)
):
    BLOCK_K: tl.constexpr = GROUPS * WIDTH
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    # Columns past N read the last real weight row (their sums are never stored): K masks only.
    real_n = tl.minimum(offs_n, N - 1)
    scale_row = scale_ptr + (pid_n * BLOCK_N // ROWS) * scale_stride
    if GATED:  # BLOCK_N / 2 outputs j: gate row j and up row N / 2 + j side by side, each its block row
        lane = tl.arange(0, BLOCK_N)
        real_n = tl.minimum(pid_n * (BLOCK_N // 2) + lane // 2, N // 2 - 1) + (lane % 2) * (N // 2)
        scale_row = scale_ptr + (real_n // ROWS)[:, None] * scale_stride
    w_rows = w_ptr + real_n.to(tl.int64)[:, None, None] * stride_wn
    offs = tl.arange(0, GROUPS)[:, None] * WIDTH + tl.arange(0, WIDTH)[None, :]  # [GROUPS, WIDTH]
    k_start = pid_k * tiles_per_split * BLOCK_K
    k_end = tl.minimum(k_start + tiles_per_split * BLOCK_K, K)
    partial = tl.zeros([BLOCK_N, GROUPS, WIDTH], dtype=tl.float32)
    if PRELOAD >= 1:
        w0 = _weight_tile(w_rows, k_start, k_end, offs)
    if PRELOAD >= 2:
        w1 = _weight_tile(w_rows, k_start + BLOCK_K, k_end, offs)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    if PRELOAD >= 1:
        partial = _block_tile(partial, w0, k_start, k_end, x_ptr, scale_row, offs, INPUTS, GROUPS, WIDTH,
                              GATED)
    if PRELOAD >= 2:
        partial = _block_tile(partial, w1, k_start + BLOCK_K, k_end, x_ptr, scale_row, offs, INPUTS, GROUPS,
                              WIDTH, GATED)
    for k in tl.range(k_start + PRELOAD * BLOCK_K, k_end, BLOCK_K, num_stages=NUM_STAGES):
        w = _weight_tile(w_rows, k, k_end, offs)
        partial = _block_tile(partial, w, k, k_end, x_ptr, scale_row, offs, INPUTS, GROUPS, WIDTH, GATED)
    acc = tl.sum(tl.sum(partial, axis=2), axis=1)  # [BLOCK_N]
    if WRITE_PARTIAL:
        tl.store(out_ptr + pid_k * N + offs_n, acc, mask=n_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + real_n).to(tl.float32)
        if GATED:
            store_gated(acc, out_ptr, pid_n, N // 2, BLOCK_N)
        else:
            tl.store(out_ptr + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_mask)


def launch_block_gemv(x: torch.Tensor, weight: torch.Tensor, block_scale: torch.Tensor,
                      block: tuple[int, int], bias: torch.Tensor | None, out: torch.Tensor,
                      config: SkinnyConfig, pdl: bool, gated: bool = False) -> torch.Tensor:
    """The kernel's launch (config: skinny_launch.skinny_config's for a one-byte weight), arguments
    unchecked (kernels/fp8_skinny.fp8_block_gemv_linear checks them): config.block_n divides `rows`, and
    `inputs` and config.block_k are powers of two. gated: out = silu(gate) * up, [1, N / 2] (no split-K)."""
    n, k = weight.shape
    rows, inputs = block
    width = min(inputs, config.block_k)
    split = plan_split_k(k, config.block_k, config.split_k)
    write_partial = split.splits > 1
    target = split_k_workspace(split, 1, n, x.device) if write_partial else out
    if gated and write_partial:
        raise ValueError("the SiLU-mul epilogue needs the whole sums: a gated launch cannot split K")
    _block_gemv_kernel[(triton.cdiv(n, config.block_n), split.splits)](
        x, weight, bias if bias is not None else x, target, block_scale, n, k, weight.stride(0),
        block_scale.stride(0), split.tiles_per_split,
        BLOCK_N=config.block_n, GROUPS=config.block_k // width, WIDTH=width, ROWS=rows, INPUTS=inputs,
        HAS_BIAS=bias is not None, WRITE_PARTIAL=write_partial, NUM_STAGES=config.num_stages, PDL=pdl,
        PRELOAD=min(PDL_PRELOAD_TILES * pdl if config.preload is None else config.preload,
                    split.tiles_per_split),
        num_warps=config.num_warps, launch_pdl=pdl, GATED=gated,
    )
    return reduce_split_k(target, bias, out) if write_partial else out
