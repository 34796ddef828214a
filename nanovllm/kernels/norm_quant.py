"""The RMSNorm and the SiLU-mul before an fp8 (W8A8) matmul, each with its output quantized to e4m3 per
row in the same kernel: what norm_act's kernel and then fp8_gemm.quantize_rows compute, without writing
the model-dtype activations out and reading them back, and one launch instead of two.

The bits are those of the two kernels in a row: the norm's or the SiLU-mul's output is rounded to the
model's dtype first (norm_act's rounding), then scaled per row (scale = max(amax, MIN_AMAX) / 448) and
rounded to nearest-even e4m3 as quantize_rows does. One scale a row (a per-channel or per-tensor weight's
activations); block-scaled weights keep the two kernels."""

import torch
import triton
import triton.language as tl

from nanovllm.kernels.fp8_gemm import FP8_DTYPE, FP8_MAX, MIN_AMAX, round_to_e4m3_grid
from nanovllm.kernels.norm_act import rows_view

# Elements of a [gate | up] half a SiLU-mul program reads at once (it loops over longer rows, twice).
ACT_BLOCK = 2048


@triton.jit
def _quantized(y, amax, q_ptr, scale_ptr, row, cols, mask):
    """Stores y (float32, already in the model dtype's values) as e4m3 with its row's scale."""
    scale = tl.maximum(amax, MIN_AMAX) / FP8_MAX
    tl.store(scale_ptr + row, scale)
    q = round_to_e4m3_grid(tl.clamp(tl.math.div_rn(y, scale), -FP8_MAX, FP8_MAX))
    tl.store(q_ptr + cols, q.to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_quant_kernel(x_ptr, residual_ptr, weight_ptr, q_ptr, scale_ptr, sum_ptr, n_cols, stride_x,
                           stride_r, stride_sum, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_sum + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    normed = (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (w * normed).to(x_ptr.dtype.element_ty).to(tl.float32)  # the norm's output, as norm_act rounds it
    _quantized(y, tl.max(tl.abs(y), axis=0), q_ptr + row * n_cols, scale_ptr, row, cols, mask)


@triton.jit
def _silu_mul(x_ptr, row_start, n_cols, cols, mask):
    gate = tl.load(x_ptr + row_start + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row_start + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    gate_f = gate.to(tl.float32)
    return (gate_f / (1.0 + tl.exp(-gate_f)) * up).to(gate.dtype).to(tl.float32)  # norm_act's rounding


@triton.jit
def _silu_mul_quant_kernel(x_ptr, q_ptr, scale_ptr, n_cols, stride_x, BLOCK: tl.constexpr):
    """One program a row: the row's amax in a first pass, the quantized values in a second (the
    SiLU-mul recomputed, its inputs read again, mostly from L2)."""
    row = tl.program_id(0).to(tl.int64)
    row_start = row * stride_x
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + offs
        amax = tl.maximum(amax, tl.abs(_silu_mul(x_ptr, row_start, n_cols, cols, cols < n_cols)))
    amax_row = tl.max(amax, axis=0)
    for start in range(0, n_cols, BLOCK):
        cols = start + offs
        mask = cols < n_cols
        y = _silu_mul(x_ptr, row_start, n_cols, cols, mask)
        _quantized(y, amax_row, q_ptr + row * n_cols, scale_ptr, row, cols, mask)


def rms_norm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 [M, K], float32 scales [M, 1], s) for s = x + residual (or x), [M, K]: rms_norm(s) in x's
    dtype (norm_act's rounding), quantized per row as fp8_gemm.quantizerows_view(y, K) would."""
    if weight.dtype != x.dtype or weight.shape != (x.shape[-1],):
        raise ValueError(f"weight {weight.dtype} {tuple(weight.shape)} must be x's dtype {x.dtype} and shape "
                         f"({x.shape[-1]},)")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual {residual.dtype} {tuple(residual.shape)} must match x {x.dtype} "
                         f"{tuple(x.shape)}")
    rows = rows_view(x)
    m, k = rows.shape
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    summed = torch.empty_like(rows) if residual is not None else rows
    if m:
        res = rows_view(residual) if residual is not None else rows
        block = triton.next_power_of_2(k)
        _rms_norm_quant_kernel[(m,)](rows, res, weight, q, scale, summed, k, rows.stride(0), res.stride(0),
                                     summed.stride(0), eps, HAS_RESIDUAL=residual is not None, BLOCK=block,
                                     num_warps=4 if block <= 2048 else 8)
    return q, scale, summed


def silu_mul_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [M, I], float32 scales [M, 1]) of silu(gate) * up for x = [gate | up] [M, 2I], in x's dtype
    first (norm_act's rounding), quantized per row as fp8_gemm.quantizerows_view(y, I) would."""
    if x.shape[-1] % 2:
        raise ValueError(f"the last dim holds [gate | up] halves; got an odd size {x.shape[-1]}")
    rows = rows_view(x)
    m, n = rows.shape[0], rows.shape[1] // 2
    q = torch.empty((m, n), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m and n:
        block = min(ACT_BLOCK, triton.next_power_of_2(n))
        _silu_mul_quant_kernel[(m,)](rows, q, scale, n, rows.stride(0), BLOCK=block, num_warps=4)
    return q, scale
