"""The RMSNorm and the SiLU-mul before an fp8 (W8A8) matmul, each with its output quantized to e4m3 in the
same kernel: what norm_act's kernel and then fp8_gemm.quantize_rows compute, without writing the
model-dtype activations out and reading them back, and one launch instead of two.

The bits are those of the two kernels in a row: the norm's or the SiLU-mul's output is rounded to the
model's dtype first (norm_act's rounding), then scaled per row, or per row and group of `group` inputs
(scale = max(amax, MIN_AMAX) / 448), and rounded to nearest-even e4m3 as quantize_rows does. One scale a
row feeds torch._scaled_mm's row-wise scaling (per-channel weights); 128-wide groups feed torch's
block-scaled GEMM (128 x 128 weight blocks), which takes its rows padded to a multiple of 4 and the
scales column-major: `pad_rows` and the scale layout here are that GEMM's, the padding rows copies of
the last real row. With `float16` they write float16 rows times a power of two a row instead
(kernels/float16_rows.py), for W8A16 over float16 rows (kernels/fp8_skinny.py)."""

import torch
import triton
import triton.language as tl

from nanovllm.kernels.float16_rows import float16_row_scale
from nanovllm.kernels.fp8_gemm import FP8_DTYPE, FP8_MAX, MIN_AMAX, quantized
from nanovllm.kernels.norm_act import rms_norm_row, rows_view

# Elements of a [gate | up] half a SiLU-mul program reads at once where it quantizes in groups (a multiple
# of any group), looping over the row.
ACT_BLOCK = 2048
# The widest row whose one scale a SiLU-mul program finds with the row held whole, read once (Qwen3-8B's
# 12,288); wider rows are read twice, in ACT_BLOCK pieces: once for the amax, once to quantize. Two passes
# over 8B's rows took 22 us a call at 256 rows (H100), 4.7x their bytes' time.
ROW_BLOCK = 16384


def silu_mul_warps(block: int) -> int:
    """Warps of a SiLU-mul program over `block` elements at once: a whole row past 8,192 takes 16 (32
    values a thread: 84 registers in the sm_90 build, against 188 at 8 warps, which left one program an
    SM). Measured on an H100 at Qwen3-8B's 12,288: 462 against 558 us for 16,384 rows, 7.7 against 8.0
    at 256. (rms_norm_quant keeps its 8: its sum's order is norm_act's, and so are its bits.)"""
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


@triton.jit
def _scale_of(amax):
    return tl.maximum(amax, MIN_AMAX) / FP8_MAX


@triton.jit
def _store_groups(y, start, n_cols, q_row, scale_row, stride_sg, GROUP: tl.constexpr, BLOCK: tl.constexpr):
    """y [BLOCK] (float32, the model dtype's values) of inputs start.. as e4m3, a scale a GROUP of them
    (BLOCK a multiple of GROUP; the row's groups from start // GROUP on)."""
    groups = tl.reshape(y, [BLOCK // GROUP, GROUP])
    scale = _scale_of(tl.max(tl.abs(groups), axis=1))
    q = quantized(groups, scale[:, None])
    index = start // GROUP + tl.arange(0, BLOCK // GROUP)
    tl.store(scale_row + index * stride_sg, scale, mask=index * GROUP < n_cols)
    cols = start + tl.arange(0, BLOCK)
    tl.store(q_row + cols, tl.reshape(q, [BLOCK]).to(q_row.dtype.element_ty), mask=cols < n_cols)


@triton.jit
def _rms_norm_quant_kernel(x_ptr, residual_ptr, weight_ptr, q_ptr, scale_ptr, sum_ptr, M, n_cols, stride_x,
                           stride_r, stride_sum, stride_sm, stride_sg, eps, HAS_RESIDUAL: tl.constexpr,
                           GROUP: tl.constexpr, BLOCK: tl.constexpr, FLOAT16: tl.constexpr = False):
    """One program a row of q; rows past M (padding) repeat row M - 1. GROUP 0: one scale a row."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    y = rms_norm_row(x_ptr, residual_ptr, weight_ptr, sum_ptr, tl.minimum(row, M - 1), cols, mask,
                     cols < tl.where(row < M, n_cols, 0), n_cols, stride_x, stride_r, stride_sum, eps,
                     HAS_RESIDUAL)  # the sum stored from real rows only
    y = y.to(x_ptr.dtype.element_ty).to(tl.float32)  # the norm's output, as norm_act rounds it
    q_row, scale_row = q_ptr + row * n_cols, scale_ptr + row * stride_sm
    if GROUP:
        _store_groups(y, 0, n_cols, q_row, scale_row, stride_sg, GROUP, BLOCK)
    elif FLOAT16:
        scale, inverse = float16_row_scale(tl.max(tl.abs(y), axis=0))
        tl.store(scale_row, scale)
        tl.store(q_row + cols, (y * inverse).to(q_ptr.dtype.element_ty), mask=mask)
    else:
        scale = _scale_of(tl.max(tl.abs(y), axis=0))
        tl.store(scale_row, scale)
        tl.store(q_row + cols, quantized(y, scale).to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul(x_row, n_cols, cols):
    mask = cols < n_cols
    gate = tl.load(x_row + cols, mask=mask, other=0.0)
    up = tl.load(x_row + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    gate_f = gate.to(tl.float32)
    return (gate_f / (1.0 + tl.exp(-gate_f)) * up).to(gate.dtype).to(tl.float32)  # norm_act's rounding


@triton.jit
def _silu_mul_quant_kernel(x_ptr, q_ptr, scale_ptr, M, n_cols, stride_x, stride_sm, stride_sg,
                           GROUP: tl.constexpr, BLOCK: tl.constexpr, WHOLE_ROW: tl.constexpr,
                           FLOAT16: tl.constexpr = False):
    """One program a row of q (rows past M repeat row M - 1). With groups (BLOCK a multiple of GROUP) each
    block of the row is quantized as it is computed; with one scale a row and BLOCK >= n_cols the row is
    computed once and held; with a longer row, a first pass finds the row's amax and a second quantizes
    (the SiLU-mul recomputed, its inputs read again, mostly from L2)."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + tl.minimum(row, M - 1) * stride_x
    q_row = q_ptr + row * n_cols
    scale_row = scale_ptr + row * stride_sm
    offs = tl.arange(0, BLOCK)
    if GROUP:
        for start in range(0, n_cols, BLOCK):
            y = _silu_mul(x_row, n_cols, start + offs)
            _store_groups(y, start, n_cols, q_row, scale_row, stride_sg, GROUP, BLOCK)
    elif WHOLE_ROW:
        y = _silu_mul(x_row, n_cols, offs)
        scale, inverse = _row_scale(tl.max(tl.abs(y), axis=0), FLOAT16)
        tl.store(scale_row, scale)
        _store_row(y, scale, inverse, offs, n_cols, q_row, FLOAT16)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            amax = tl.maximum(amax, tl.abs(_silu_mul(x_row, n_cols, start + offs)))
        scale, inverse = _row_scale(tl.max(amax, axis=0), FLOAT16)
        tl.store(scale_row, scale)
        for start in range(0, n_cols, BLOCK):
            _store_row(_silu_mul(x_row, n_cols, start + offs), scale, inverse, start + offs, n_cols, q_row,
                       FLOAT16)


@triton.jit
def _row_scale(amax, FLOAT16: tl.constexpr):
    """(scale, 1 / scale) of a row whose largest magnitude is amax: float16 rows' power of two, or e4m3's
    scale (its inverse unread: `quantized` takes the scale)."""
    if FLOAT16:
        return float16_row_scale(amax)
    return _scale_of(amax), 0.0


@triton.jit
def _store_row(y, scale, inverse, cols, n_cols, q_row, FLOAT16: tl.constexpr):
    """y's values at cols of the row, quantized with the row's one scale."""
    if FLOAT16:
        q = y * inverse
    else:
        q = quantized(y, scale)
    tl.store(q_row + cols, q.to(q_row.dtype.element_ty), mask=cols < n_cols)


def _outputs(m: int, k: int, group: int, pad_rows: int, device: torch.device, dtype: torch.dtype = FP8_DTYPE
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [M', k] and its scales for M' = m padded to a multiple of pad_rows: [M', 1], or with groups
    column-major [M', k / group] (strides (1, M'): torch's block-scaled GEMM's layout)."""
    if group and (k % group or group & (group - 1)):
        raise ValueError(f"groups of {group} inputs: a power of two dividing the {k} inputs is needed")
    rows = -(-m // pad_rows) * pad_rows
    q = torch.empty((rows, k), dtype=dtype, device=device)
    if not group:
        return q, torch.empty((rows, 1), dtype=torch.float32, device=device)
    return q, torch.empty((k // group, rows), dtype=torch.float32, device=device).t()


def rms_norm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                   group: int = 0, pad_rows: int = 1, float16: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 q, float32 scales, s) for s = x + residual (or x), [M, K]: rms_norm(s) in x's dtype
    (norm_act's rounding), quantized as fp8_gemm.quantize_rows(y, group or K) would; q and the scales
    have M rounded up to a multiple of pad_rows (see the module docstring for the layout). float16: q as
    float16 rows and their power-of-two scales instead, as float16_rows.float16_rows(y) writes them."""
    if weight.dtype != x.dtype or weight.shape != (x.shape[-1],):
        raise ValueError(f"weight {weight.dtype} {tuple(weight.shape)} must be x's dtype {x.dtype} and shape "
                         f"({x.shape[-1]},)")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual {residual.dtype} {tuple(residual.shape)} must match x {x.dtype} "
                         f"{tuple(x.shape)}")
    rows = rows_view(x)
    m, k = rows.shape
    q, scale = _outputs(m, k, group, pad_rows, x.device, torch.float16 if float16 else FP8_DTYPE)
    summed = torch.empty_like(rows) if residual is not None else rows
    if m:
        res = rows_view(residual) if residual is not None else rows
        block = triton.next_power_of_2(k)
        _rms_norm_quant_kernel[(q.shape[0],)](
            rows, res, weight, q, scale, summed, m, k, rows.stride(0), res.stride(0), summed.stride(0),
            scale.stride(0), scale.stride(1), eps, HAS_RESIDUAL=residual is not None, GROUP=group,
            BLOCK=block, FLOAT16=float16, num_warps=4 if block <= 2048 else 8)
    return q, scale, summed


def silu_mul_quant(x: torch.Tensor, group: int = 0, pad_rows: int = 1, float16: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 q, float32 scales) of silu(gate) * up for x = [gate | up] [M, 2I], in x's dtype first
    (norm_act's rounding), quantized as fp8_gemm.quantize_rows(y, group or I) would; rows padded and scales
    laid out as rms_norm_quant's; float16 as rms_norm_quant's."""
    if x.shape[-1] % 2:
        raise ValueError(f"the last dim holds [gate | up] halves; got an odd size {x.shape[-1]}")
    rows = rows_view(x)
    m, n = rows.shape[0], rows.shape[1] // 2
    q, scale = _outputs(m, n, group, pad_rows, x.device, torch.float16 if float16 else FP8_DTYPE)
    if m and n:
        whole = not group and triton.next_power_of_2(n) <= ROW_BLOCK
        block = triton.next_power_of_2(n) if whole else max(min(ACT_BLOCK, triton.next_power_of_2(n)), group)
        _silu_mul_quant_kernel[(q.shape[0],)](rows, q, scale, m, n, rows.stride(0), scale.stride(0),
                                              scale.stride(1), GROUP=group, BLOCK=block, WHOLE_ROW=whole,
                                              FLOAT16=float16, num_warps=silu_mul_warps(block))
    return q, scale
