"""One-row decode matmuls with e4m3 weights and one scale a row (per-channel fp8, `quantization="fp8"`),
W8A16: kernels/skinny_gemm.py's GEMV streaming the fp8 weight, each tile widened to float32 in registers
(exact), the row's scale multiplying the finished sums, the activations unrounded:

    out[n] = (sum over k of x[k] * w_fp8[n, k]) * w_scale[n] (+ bias)

The launch plan is bf16's for one byte an element (skinny_launch.skinny_config: the same bytes in flight),
and the folds are bf16's: the RMSNorm before q/k/v and gate/up, the SiLU-mul before down. Graph-timed on
an H200 at Qwen3-8B's shapes it took 8.9 / 6.9 / 27.6 / 14.8 us (q/k/v, o, gate/up, down) where bf16's GEMV
took 14.6 / 10.3 / 48.3 / 25.4 and kernels/fp8_gemv.py 49.1 / 34.2 / 62.6 / 87.0 (scripts/fp8_gemm_bench.py,
2026-12-03). Scales in groups along K (block-scaled checkpoints) are not taken: a variant scaling each
tile passed in Triton's interpreter and failed on the GPU, not yet understood
(docs/performance-notes.md, "fp8 weights"). The weight layout is layers/fp8.py's."""

import torch

from nanovllm.kernels.common import sm_count
from nanovllm.kernels.skinny_gemm import ADD_RMS_NORM, RMS_NORM, SILU_MUL, check_one_row, launch_gemv
from nanovllm.kernels.skinny_launch import SkinnyConfig, skinny_config

FP8_DTYPE = torch.float8_e4m3fn


def _checked(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, group: int,
             bias: torch.Tensor | None, width: int) -> SkinnyConfig:
    n, k = weight.shape
    check_one_row(x, width, "x")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x dtype {x.dtype} is not float16, bfloat16 or float32")
    if weight.dtype != FP8_DTYPE or weight.stride(-1) != 1:
        raise ValueError(f"weight {weight.dtype} must be {FP8_DTYPE} with a contiguous last dim")
    if group < k:
        raise ValueError(f"fp8_skinny takes one scale a row; groups of {group} of the {k} inputs take "
                         "kernels/fp8_gemv.py")
    scale = weight_scale
    if scale.shape != (n, 1) or scale.dtype != torch.float32 or not scale.is_contiguous():
        raise ValueError(f"weight_scale {tuple(weight_scale.shape)} {weight_scale.dtype} must be contiguous "
                         f"float32 ({n}, 1)")
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype or not bias.is_contiguous()):
        raise ValueError(f"bias must be contiguous ({n},) {x.dtype}")
    return skinny_config(n, k, 1, sm_count(x.device))


def fp8_skinny_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, group: int,
                      bias: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """x [1, K] @ (weight [N, K] e4m3 * weight_scale [N, 1])^T (+ bias) in x's dtype, float32 sums;
    group: the inputs a scale covers (K or more: one a row)."""
    config = _checked(x, weight, weight_scale, group, bias, weight.shape[1])
    out = torch.empty((1, weight.shape[0]), dtype=x.dtype, device=x.device)
    return launch_gemv(x, weight, bias, out, config, pdl, weight_scale=weight_scale)


def fp8_skinny_norm_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                           weight_scale: torch.Tensor, group: int, bias: torch.Tensor | None = None,
                           residual: torch.Tensor | None = None, pdl: bool = False
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(s) @ dequantize(weight)^T (+ bias), s), s = x + residual (or x): skinny_norm_linear's
    fold (the same rounding of the normed row) over an fp8 weight."""
    k = weight.shape[1]
    config = _checked(x, weight, weight_scale, group, bias, k)
    if residual is not None:
        check_one_row(residual, k, "residual")
    if norm_weight.shape != (k,) or norm_weight.dtype != x.dtype:
        raise ValueError(f"norm_weight {tuple(norm_weight.shape)} {norm_weight.dtype} must be ({k},) "
                         f"{x.dtype}")
    if config.split_k > 1:  # a split would cut the norm's sum of squares: the norm's own kernel first
        from nanovllm.kernels.norm_act import add_rms_norm, rms_norm
        normed, summed = (rms_norm(x, norm_weight, eps), x) if residual is None else \
            add_rms_norm(x, residual, norm_weight, eps)
        return fp8_skinny_linear(normed, weight, weight_scale, group, bias, pdl), summed
    out = torch.empty((1, weight.shape[0]), dtype=x.dtype, device=x.device)
    if residual is None:
        return launch_gemv(x, weight, bias, out, config, pdl, RMS_NORM, norm_weight=norm_weight, eps=eps,
                           weight_scale=weight_scale), x
    summed = torch.empty_like(x)
    launch_gemv(x, weight, bias, out, config, pdl, ADD_RMS_NORM, residual, summed, norm_weight, eps,
                weight_scale)
    return out, summed


def fp8_skinny_silu_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, group: int,
                           bias: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """(silu(gate) * up) @ dequantize(weight)^T (+ bias) for x = [gate | up] ([1, 2K]): skinny_silu_linear's
    fold (the product rounded to x's dtype, as the SiLU-mul kernel stores it) over an fp8 weight."""
    config = _checked(x, weight, weight_scale, group, bias, 2 * weight.shape[1])
    out = torch.empty((1, weight.shape[0]), dtype=x.dtype, device=x.device)
    return launch_gemv(x, weight, bias, out, config, pdl, SILU_MUL, weight_scale=weight_scale)
