"""RMSNorm (optionally after the residual add) and SiLU-gated activation as one Triton kernel each, for
CUDA tensors; the layers keep plain PyTorch on the CPU (nanovllm.layers.norm_act).

They replace torch.compile'd versions of the same functions. Inside a CUDA graph the two cost the same;
an eager step (prefill, mixed batches) calls them 85 times, and a plain Triton launch skips
torch.compile's Python wrappers (docs/performance-notes.md, "Compilation and start-up": a mixed step's
launch 20.5 ->
19.4 ms; most of the rest was cuBLAS, see runner/inputs.py), and start-up compiles six frames fewer
(10 before, 4 after). Their rounding matches the PyTorch functions they replace:

    rms_norm:      y = round(w * round(x * rsqrt(mean(x^2) + eps)))   (float32 inside; two roundings,
                   as nanovllm.attention.layer.rms_norm and transformers)
    add_rms_norm:  s = round(x + residual); y = rms_norm(s); returns (y, s)
    silu_and_mul:  y = round(silu(gate) * up)                          (float32 inside, one rounding)

Only the order of the sum of squares can differ from PyTorch's, so outputs agree to float32 rounding
before the last cast."""

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# Elements of one activation row a SiLU-mul program covers.
ACT_BLOCK = 1024


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr, n_cols, stride_x, stride_r,
                     stride_out, stride_sum, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
                     PDL: tl.constexpr = False):
    if PDL:  # a programmatic dependent: wait for the kernel before, and let the next one start loading
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    y = rms_norm_row(x_ptr, residual_ptr, weight_ptr, sum_ptr, row, cols, mask, mask, n_cols, stride_x,
                     stride_r, stride_sum, eps, HAS_RESIDUAL)
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rms_norm_row(x_ptr, residual_ptr, weight_ptr, sum_ptr, row, cols, mask, sum_mask, n_cols, stride_x,
                 stride_r, stride_sum, eps, HAS_RESIDUAL: tl.constexpr):
    """w * round(s * rsqrt(mean(s^2) + eps)) in float32 (the last rounding left to the caller) for row
    `row` of s = round(x + residual) (stored to sum_ptr where sum_mask), or of x; cols [BLOCK] cover it."""
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_sum + cols, x, mask=sum_mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    normed = (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    return tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32) * normed


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, n_cols, stride_x, stride_out, BLOCK: tl.constexpr,
                         PDL: tl.constexpr = False):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rows_view(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, last dim] without a copy (the kernels need a contiguous last dim)."""
    if x.stride(-1) != 1:
        raise ValueError(f"the kernels need a contiguous last dim; got strides {x.stride()}")
    return x.view(-1, x.shape[-1]) if x.dim() != 2 else x


def _launch_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    if weight.dtype != x.dtype or weight.shape != (x.shape[-1],):
        raise ValueError(f"weight {weight.dtype} {tuple(weight.shape)} must be x's dtype {x.dtype} "
                         f"and shape ({x.shape[-1]},)")
    rows = rows_view(x)
    out = torch.empty_like(rows)
    summed = torch.empty_like(rows) if residual is not None else None
    if rows.shape[0]:
        res = rows_view(residual) if residual is not None else rows
        block = triton.next_power_of_2(rows.shape[1])
        target = summed if summed is not None else out  # never written without a residual
        _rms_norm_kernel[(rows.shape[0],)](
            rows, res, weight, out, target, rows.shape[1], rows.stride(0), res.stride(0), out.stride(0),
            target.stride(0), eps, HAS_RESIDUAL=residual is not None, BLOCK=block, PDL=pdl,
            num_warps=4 if block <= 2048 else 8, launch_pdl=pdl)
    return out.view(x.shape), (summed.view(x.shape) if summed is not None else None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, pdl: bool = False) -> torch.Tensor:
    """RMSNorm over the last dim of x (a CUDA tensor, or a CPU one under TRITON_INTERPRET=1). pdl: launched
    as a programmatic dependent (sm_90+), as the one-row decode chain's kernels are."""
    return _launch_norm(x, None, weight, eps, pdl)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual)."""
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"residual {residual.dtype} {tuple(residual.shape)} must match x "
                         f"{x.dtype} {tuple(x.shape)}")
    out, summed = _launch_norm(x, residual, weight, eps, pdl)
    return out, summed


def silu_and_mul(x: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """silu(x[..., :n]) * x[..., n:] for a last dim of 2n."""
    if x.shape[-1] % 2:
        raise ValueError(f"the last dim holds [gate | up] halves; got an odd size {x.shape[-1]}")
    rows = rows_view(x)
    n = rows.shape[1] // 2
    out = torch.empty((rows.shape[0], n), dtype=x.dtype, device=x.device)
    if rows.shape[0] and n:
        _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(n, ACT_BLOCK))](
            rows, out, n, rows.stride(0), out.stride(0), BLOCK=ACT_BLOCK, PDL=pdl, num_warps=4,
            launch_pdl=pdl)
    return out.view(*x.shape[:-1], n)
