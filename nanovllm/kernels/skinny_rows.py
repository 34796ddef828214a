"""Few-row matmuls on tensor cores: out[M, N] = x[M, K] @ weight[N, K]^T (+ bias) for 2 <= M <= MAX_ROWS,
as decode at a batch of a few sequences runs every linear layer. On an H200 a decode step's graph at 2-16
rows took 9-17% less than with cuBLAS and separate norm kernels (commit adbf98d, 2026-12-01). The LM head
(N = 151,936) stays with cuBLAS, as fast there (commit 2bb6672).

At these M the weight is nearly all the bytes, so like skinny_gemm's GEMV each program streams its
[BLOCK_N, K] slab of the weight once, in pipelined [BLOCK_N, BLOCK_K] tiles. The products run on tensor
cores with the operands swapped ("swap-AB"): a weight tile is the dot's left operand (64 columns meet
wgmma's 64-row side), the rows of x its right one, padded to ROWS = 16 (to a power of two up to 128 in
plain launches) by repeating the last real row (valid addresses, no masks; never stored).

The RMSNorm before a linear layer folds into it as in skinny_gemm, per row (after a residual add or not;
each row's sum stored once by the first column block, rounded to x's dtype), each row's 1/rms applied to
its sums at the end. The dot's operands are in x's dtype, so the normed row enters it rounded after the
norm weight and before 1/rms: the output can differ from norm-then-GEMM by that rounding. SiLU-mul does
not fold in: every column block recomputing it for 16 rows made the down projection slower than the
SiLU-mul kernel and a plain launch (257 against 211 us for 28 calls).

An e4m3 weight with one scale a row (kernels/fp8_skinny.py) streams at one byte an element, each tile
widened to x's dtype for the dot and the row's scale applied to the finished sums; with a scale a block
(block-scaled checkpoints), each tile lies inside one block and its product is scaled before it is added.
Rows of x quantized to e4m3 (W8A8, a scale a row) meet the e4m3 tiles in an fp8 dot, nothing widened;
each tile's sum added in float32 (sm_90's fp8 dots keep fewer bits while they accumulate) or, with
FAST_ACCUM, the dots chained in the tensor cores' accumulator over the whole K.

On sm_90+ it launches as a programmatic dependent, as skinny_gemm does: it loads its first weight tiles,
waits for the kernel before, then lets the next one launch. Split-K (float32 partials summed in a fixed
order: by the last split of each column block to finish, given the layer's counters, else by a second
kernel) is for plain launches only (a split would cut the norm's sum of squares). The launch settings come
from shapes alone (kernels/rows_settings.py), so calls are CUDA-graph capturable."""

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from nanovllm.kernels.rows_settings import MAX_ROWS, ROWS, RowsConfig, fit_shared, rows_config, rows_tile
from nanovllm.kernels.skinny_gemm import ADD_RMS_NORM, PLAIN, RMS_NORM, check_rows, weight_tile
from nanovllm.kernels.split_k import last_split_sums, plan_split_k, reduce_split_k, split_k_workspace

# Whether e4m3 rows chain their dots over the whole K, as torch._scaled_mm does past the rows bucket
# (fp8_scaled_mm.FAST_ACCUM). sm_90 SASS (`sm90_build.py skinny-rows-fp8-e4m3 ROWS_=R FAST_ACCUM=True`): the K
# loop 87 / 121 / 168 -> 83 / 86 / 100 instructions a warp at 16 / 64 / 128 rows, registers 56 / 104 / 183
# -> 40 / 80 / 137 (the wgmma left in flight, no float32 add a tile). Off: on an H100 (2026-12-06) a layer's
# four projections took 90.2 / 89.0 / 101.2 / 136.2 us at 16 / 32 / 64 / 128 rows against 90.9 / 93.3 / 95.8
# / 120.4 with the float32 adds (the buffer more it holds leaves fewer stages), bench.py a tie.
FAST_ACCUM = False


@triton.jit
def _rows_tile(acc, squares, w, k, k_end, x_rows, residual_rows, sum_rows, store_rows, norm_w_ptr, K, pid_n,
               scale_row, PROLOGUE: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_GROUP: tl.constexpr,
               FAST_ACCUM: tl.constexpr):
    """acc += w @ x[:, k : k + BLOCK_K]^T (x through the prologue; with SCALE_GROUP, the tile's product
    times its block's scale in scale_row), and the norm's sums of squares."""
    offs_k = k + tl.arange(0, BLOCK_K)
    k_mask = offs_k < k_end
    x = tl.load(x_rows + offs_k[None, :], mask=k_mask[None, :], other=0.0)  # [ROWS, BLOCK_K]
    if PROLOGUE == ADD_RMS_NORM:
        # Rounded to x's dtype as the residual stream is stored, before the norm reads it.
        x = (x.to(tl.float32) + tl.load(residual_rows + offs_k[None, :], mask=k_mask[None, :],
                                        other=0.0).to(tl.float32)).to(x.dtype)
        if pid_n == 0:
            tl.store(sum_rows + offs_k[None, :], x, mask=store_rows[:, None] & k_mask[None, :])
    if PROLOGUE == RMS_NORM or PROLOGUE == ADD_RMS_NORM:
        xf = x.to(tl.float32)
        squares += xf * xf
        x = (xf * tl.load(norm_w_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)[None, :]).to(x.dtype)
    # An e4m3 weight tile is widened to x's dtype (exactly) for the dot; x's own weight passes as it is.
    if x.dtype.is_fp8() and FAST_ACCUM:  # e4m3 rows (W8A8): an fp8 dot chained over the whole K
        return tl.dot(w, tl.trans(x), acc), squares
    if x.dtype.is_fp8():  # or its tile's sum added in float32, as fp8_gemm's
        return acc + tl.dot(w, tl.trans(x)), squares
    if SCALE_GROUP > 0:  # the tile lies inside one block (k a multiple of BLOCK_K, which divides a group)
        return acc + tl.dot(w.to(x.dtype), tl.trans(x)) * tl.load(scale_row + k // SCALE_GROUP), squares
    return tl.dot(w.to(x.dtype), tl.trans(x), acc), squares


@triton.jit(do_not_specialize=["M"])  # one build for every row count (Triton would give 1 and 16 their own)
def _skinny_rows_kernel(
    x_ptr,  # [M, K], rows stride_xm apart, last dim contiguous
    w_ptr,  # [N, K]
    bias_ptr,
    out_ptr,  # [M, N], rows stride_om apart
    partial_ptr,  # WRITE_PARTIAL: the [split_k, M, N] float32 workspace
    counters_ptr,  # LAST_SPLIT_SUMS: the layer's int32 arrival counters, [N] (a block counts at its first)
    residual_ptr,  # ADD_RMS_NORM: [M, K], rows stride_rm apart, added to x
    sum_ptr,  # ADD_RMS_NORM: [M, K] contiguous, receives x + residual (written by the first column block)
    norm_w_ptr,  # RMS_NORM, ADD_RMS_NORM: [K]
    eps,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    stride_rm,
    tiles_per_split,
    w_scale_ptr,  # SCALED: an fp8 weight's float32 [N] scales, one a row (weight[n, k] * w_scale[n]);
    # SCALE_GROUP: its block scales, [N / SCALE_ROWS, scale_stride] (weight[n, k] * w_scale[n // SCALE_ROWS,
    # k // SCALE_GROUP]), BLOCK_N dividing SCALE_ROWS and BLOCK_K SCALE_GROUP: a tile, one scale
    scale_stride,
    x_scale_ptr,  # X_SCALED: x's float32 [M] scales, one a row (x[m, k] * x_scale[m]: float16 rows)
    ROWS_: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    WRITE_PARTIAL: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    PROLOGUE: tl.constexpr = PLAIN,
    PDL: tl.constexpr = False,
    PRELOAD: tl.constexpr = 0,
    SCALED: tl.constexpr = False,  # fp8 weights: their row's scale multiplies the sums (partials too)
    SCALE_GROUP: tl.constexpr = 0,  # fp8 block-scaled weights: each tile's product times its block's scale
    SCALE_ROWS: tl.constexpr = 128,
    X_SCALED: tl.constexpr = False,  # x as float16 rows times a power of two (kernels/float16_rows.py)
    LAST_SPLIT_SUMS: tl.constexpr = False,  # WRITE_PARTIAL: a column block's last split sums its partials
    FAST_ACCUM: tl.constexpr = False,  # e4m3 rows: the dots chained over the whole K
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_m = tl.arange(0, ROWS_)
    m_mask = offs_m < M
    # Columns past N read the last weight row and padding rows the last row of x: loads need only K masks.
    w_rows = w_ptr + tl.minimum(offs_n, N - 1).to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    real_m = tl.minimum(offs_m, M - 1).to(tl.int64)
    x_rows = x_ptr + real_m[:, None] * stride_xm  # [ROWS, 1]
    residual_rows = residual_ptr + real_m[:, None] * stride_rm
    sum_rows = sum_ptr + real_m[:, None] * K
    k_start = pid_k * tiles_per_split * BLOCK_K
    k_end = tl.minimum(k_start + tiles_per_split * BLOCK_K, K)
    acc = tl.zeros([BLOCK_N, ROWS_], dtype=tl.float32)
    squares = tl.zeros([ROWS_, BLOCK_K], dtype=tl.float32)
    offs = tl.arange(0, BLOCK_K)
    scale_row = w_scale_ptr + (pid_n * BLOCK_N // SCALE_ROWS) * scale_stride  # read with SCALE_GROUP only
    if PRELOAD >= 1:
        w0 = weight_tile(w_rows, k_start, k_end, offs)
    if PRELOAD >= 2:
        w1 = weight_tile(w_rows, k_start + BLOCK_K, k_end, offs)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    if PRELOAD >= 1:
        acc, squares = _rows_tile(acc, squares, w0, k_start, k_end, x_rows, residual_rows, sum_rows, m_mask,
                                  norm_w_ptr, K, pid_n, scale_row, PROLOGUE, BLOCK_K, SCALE_GROUP,
                                  FAST_ACCUM)
    if PRELOAD >= 2:
        acc, squares = _rows_tile(acc, squares, w1, k_start + BLOCK_K, k_end, x_rows, residual_rows, sum_rows,
                                  m_mask, norm_w_ptr, K, pid_n, scale_row, PROLOGUE, BLOCK_K, SCALE_GROUP,
                                  FAST_ACCUM)
    for k in tl.range(k_start + PRELOAD * BLOCK_K, k_end, BLOCK_K, num_stages=NUM_STAGES):
        w = weight_tile(w_rows, k, k_end, offs)
        acc, squares = _rows_tile(acc, squares, w, k, k_end, x_rows, residual_rows, sum_rows, m_mask,
                                  norm_w_ptr, K, pid_n, scale_row, PROLOGUE, BLOCK_K, SCALE_GROUP,
                                  FAST_ACCUM)
    if PROLOGUE == RMS_NORM or PROLOGUE == ADD_RMS_NORM:
        acc = acc * tl.rsqrt(tl.sum(squares, axis=1) / K + eps)[None, :]
    if SCALED:
        acc = acc * tl.load(w_scale_ptr + tl.minimum(offs_n, N - 1))[:, None]
    if X_SCALED:
        acc = acc * tl.load(x_scale_ptr + real_m)[None, :]
    out_mask = n_mask[:, None] & m_mask[None, :]
    if WRITE_PARTIAL:
        offs_out = offs_m[None, :] * N + offs_n[:, None]
        tl.store(partial_ptr + pid_k * M * N + offs_out, acc, mask=out_mask)
        if LAST_SPLIT_SUMS:
            counter = counters_ptr + pid_n * BLOCK_N  # the block's: its first column's
            last, acc = last_split_sums(acc, partial_ptr, M * N, counter, offs_out, out_mask)
            if last:
                _store_out(acc, bias_ptr, out_ptr, offs_m, offs_n, n_mask, out_mask, stride_om, HAS_BIAS)
    else:
        _store_out(acc, bias_ptr, out_ptr, offs_m, offs_n, n_mask, out_mask, stride_om, HAS_BIAS)


@triton.jit
def _store_out(acc, bias_ptr, out_ptr, offs_m, offs_n, n_mask, out_mask, stride_om, HAS_BIAS: tl.constexpr):
    """out[m, n] = acc[n, m] (+ bias[n]) in out's dtype."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + offs_m[None, :] * stride_om + offs_n[:, None], acc.to(out_ptr.dtype.element_ty),
             mask=out_mask)


def launch_rows(x, weight, bias, out, config: RowsConfig, pdl: bool = False, prologue: tl.constexpr = PLAIN,
                residual=None, summed=None, norm_weight=None, eps: float = 0.0, weight_scale=None,
                block: tuple[int, int] | None = None, x_scale=None, counters=None) -> torch.Tensor:
    """out[:M] = prologue(x) @ weight.T (+ bias); the callers check shapes and dtypes. weight_scale: an e4m3
    weight's float32 scales, one a row ([N] or [N, 1], contiguous), or with block = (rows, inputs) one a
    block ([N / rows, >= K / inputs], last dim contiguous; config.block_n dividing rows, config.block_k
    inputs). x_scale: x's float32 scales, one a row ([M] or [M, 1], contiguous; a plain prologue).
    counters: the layer's split-K arrival counters (int32 zeros [N], kernels/split_k.py): a split's
    partials are then summed by its last program, not by a second launch."""
    m, (n, k) = x.shape[0], weight.shape
    if not 1 <= m <= (MAX_ROWS if prologue == PLAIN else ROWS):
        raise ValueError(f"the rows kernel takes 1 to {MAX_ROWS} rows ({ROWS} with a norm), not {m}")
    config = fit_shared(config, rows_tile(m), x, weight)
    split = plan_split_k(k, config.block_k, 1 if prologue in (RMS_NORM, ADD_RMS_NORM) else config.split_k)
    write_partial = split.splits > 1
    last_sums = write_partial and counters is not None
    if last_sums and (counters.dtype != torch.int32 or counters.numel() < n):
        raise ValueError(f"counters must be int32 zeros, one for each of the {n} outputs; got "
                         f"{counters.dtype} [{counters.numel()}]")
    partials = split_k_workspace(split, m, n, x.device) if write_partial else out
    _skinny_rows_kernel[(triton.cdiv(n, config.block_n), split.splits)](
        x, weight, bias if bias is not None else x, out, partials, counters if last_sums else x,
        residual if residual is not None else x, summed if summed is not None else x,
        norm_weight if norm_weight is not None else x, eps, m, n, k,
        x.stride(0), weight.stride(0), out.stride(0), residual.stride(0) if residual is not None else 0,
        split.tiles_per_split, weight_scale if weight_scale is not None else x,  # never read unless scaled
        0 if block is None else weight_scale.stride(0), x_scale if x_scale is not None else x,
        ROWS_=rows_tile(m), BLOCK_N=config.block_n, BLOCK_K=config.block_k, HAS_BIAS=bias is not None,
        WRITE_PARTIAL=write_partial, NUM_STAGES=config.num_stages, PROLOGUE=prologue.value, PDL=pdl,
        PRELOAD=min(config.preload if pdl else 0, split.tiles_per_split),
        num_warps=config.num_warps, launch_pdl=pdl, SCALED=weight_scale is not None and block is None,
        SCALE_GROUP=0 if block is None else block[1], SCALE_ROWS=128 if block is None else block[0],
        X_SCALED=x_scale is not None, LAST_SPLIT_SUMS=last_sums,
        FAST_ACCUM=FAST_ACCUM and x.element_size() == 1,  # e4m3 rows only: no second build of the rest
    )
    return reduce_split_k(partials, bias, out) if write_partial and not last_sums else out


def rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                pdl: bool = False, counters: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) for 1 to MAX_ROWS rows, in x's dtype with float32 accumulation; counters: the
    layer's split-K counters (launch_rows)."""
    (n, k) = weight.shape
    check_rows(x, k, weight, bias, MAX_ROWS)
    out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    return launch_rows(x, weight, bias, out, rows_config(n, k, PLAIN), pdl, counters=counters)


def rows_norm_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                     bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                     pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(s) @ weight.T (+ bias), s) for 1 to ROWS rows, s = x + residual (or x), in one kernel
    (see the module docstring for the rounding)."""
    (n, k) = weight.shape
    check_rows(x, k, weight, bias, ROWS)
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                 or residual.stride(-1) != 1):
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must match x's shape and dtype")
    if norm_weight.shape != (k,) or norm_weight.dtype != x.dtype:
        raise ValueError(f"norm_weight {tuple(norm_weight.shape)} {norm_weight.dtype} must be ({k},) "
                         f"{x.dtype}")
    out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    prologue = RMS_NORM if residual is None else ADD_RMS_NORM
    config = rows_config(n, k, prologue)
    summed = torch.empty((x.shape[0], k), dtype=x.dtype, device=x.device) if residual is not None else None
    launch_rows(x, weight, bias, out, config, pdl, prologue, residual, summed, norm_weight, eps)
    return out, (x if summed is None else summed)

