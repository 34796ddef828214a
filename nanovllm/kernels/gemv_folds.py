"""The one-row GEMV (kernels/skinny_gemm.py) with the small kernel before or after a decoder layer's
projection folded in, so that its launch is saved:

- the RMSNorm before q/k/v and gate/up (after a residual add or not), in the GEMV's pass over x
  (skinny_norm_linear);
- the SiLU-mul before down_proj, the same way (skinny_silu_linear): every program computes it over the
  whole [gate | up] row it reads;
- the SiLU-mul after gate/up, as the GEMV's epilogue (skinny_gated_linear, skinny_norm_linear(gated=True)):
  each program sums matching gate and up rows and writes silu(gate) * up once, nothing recomputed.

Each result has the bits of the kernels it replaces except where the norm's 1/rms multiplies finished sums
(see skinny_norm_linear)."""

import torch

from nanovllm.kernels.common import sm_count
from nanovllm.kernels.norm_act import add_rms_norm, rms_norm, silu_and_mul
from nanovllm.kernels.skinny_gemm import (
    ADD_RMS_NORM,
    RMS_NORM,
    SILU_MUL,
    check_one_row,
    launch_gemv,
    skinny_linear,
)
from nanovllm.kernels.skinny_launch import skinny_config


def check_gated(weight: torch.Tensor) -> None:
    """A gated MLP's merged [gate; up] weight: an even number of rows, gate's first."""
    if weight.shape[0] % 2:
        raise ValueError(f"a gated weight stacks gate and up rows; {weight.shape[0]} rows do not halve")


def skinny_norm_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                       bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                       pdl: bool = False, gated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(s) @ weight.T (+ bias), s) for one row, s = x + residual (or x), in one kernel: the
    norm's kernel before the GEMV is saved. s is rounded to x's dtype as a stored residual stream is;
    the norm's 1/rms multiplies the float32 sums instead of each element, so the output can differ
    from norm-then-linear by the rounding of the normed row. Where the shapes ask for split-K (which
    would cut the norm's sum of squares), the norm runs on its own first. gated: weight is a gated MLP's
    [gate; up] and the first result silu(gate) * up of the product ([1, N / 2]), the SiLU-mul's kernel
    after it saved too."""
    k = weight.shape[1]
    check_one_row(x, k, "x")
    if residual is not None:
        check_one_row(residual, k, "residual")
    if norm_weight.shape != (k,) or norm_weight.dtype != x.dtype or weight.dtype != x.dtype:
        raise ValueError(f"norm_weight {tuple(norm_weight.shape)} {norm_weight.dtype} and weight "
                         f"{weight.dtype} must be ({k},) and x's dtype {x.dtype}")
    if gated:
        check_gated(weight)
    config = skinny_config(weight.shape[0], k, x.element_size(), sm_count(x.device))
    if config.split_k > 1:
        normed, summed = (rms_norm(x, norm_weight, eps), x) if residual is None else add_rms_norm(
            x, residual, norm_weight, eps)
        out = skinny_linear(normed, weight, bias, config=config, pdl=pdl)
        return (silu_and_mul(out, pdl) if gated else out), summed
    out = torch.empty((1, weight.shape[0] // (2 if gated else 1)), dtype=x.dtype, device=x.device)
    if residual is None:
        return launch_gemv(x, weight, bias, out, config, pdl, RMS_NORM, norm_weight=norm_weight, eps=eps,
                           gated=gated), x
    summed = torch.empty_like(x)
    launch_gemv(x, weight, bias, out, config, pdl, ADD_RMS_NORM, residual, summed, norm_weight, eps,
                gated=gated)
    return out, summed


def skinny_silu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                       pdl: bool = False) -> torch.Tensor:
    """(silu(gate) * up) @ weight.T (+ bias) for one row x = [gate | up] ([1, 2K]), in one kernel: the
    SiLU-mul kernel before the GEMV is saved. The product is rounded to x's dtype as that kernel's
    output is, so the result equals SiLU-mul-then-GEMV."""
    k = weight.shape[1]
    check_one_row(x, 2 * k, "x")
    if weight.dtype != x.dtype:
        raise ValueError(f"weight {weight.dtype} must be x's dtype {x.dtype}")
    config = skinny_config(weight.shape[0], k, x.element_size(), sm_count(x.device))
    out = torch.empty((1, weight.shape[0]), dtype=x.dtype, device=x.device)
    return launch_gemv(x, weight, bias, out, config, pdl, SILU_MUL)


def skinny_gated_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                        pdl: bool = False) -> torch.Tensor:
    """silu(gate) * up of x @ weight.T (+ bias) for one row, weight a gated MLP's [gate; up] ([2I, K]):
    [1, I] in one kernel with the bits of the GEMV and then the SiLU-mul kernel: each program sums
    matching gate and up rows, rounds both to x's dtype as the GEMV stores them, then multiplies. Where
    the shapes ask for split-K, the two kernels run."""
    n, k = weight.shape
    check_one_row(x, k, "x")
    if weight.dtype != x.dtype or weight.stride(-1) != 1:
        raise ValueError(f"weight {weight.dtype} must be x's dtype {x.dtype} with a contiguous last dim")
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype or not bias.is_contiguous()):
        raise ValueError(f"bias must be contiguous ({n},) {x.dtype}")
    check_gated(weight)
    config = skinny_config(n, k, x.element_size(), sm_count(x.device))
    if config.split_k > 1:
        return silu_and_mul(skinny_linear(x, weight, bias, config=config, pdl=pdl), pdl)
    out = torch.empty((1, n // 2), dtype=x.dtype, device=x.device)
    return launch_gemv(x, weight, bias, out, config, pdl, gated=True)
