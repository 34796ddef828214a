"""Decode matmuls of 1 to 16 rows with e4m3 weights and one scale a row (per-channel fp8,
`quantization="fp8"`), W8A16: bf16's few-row kernels streaming the fp8 weight, each tile widened in
registers (exactly), the row's scale multiplying the finished sums, the activations unrounded:

    out[m, n] = (sum over k of x[m, k] * w_fp8[n, k]) * w_scale[n] (+ bias)

One row runs kernels/skinny_gemm.py's GEMV with bf16's launch plan for one byte an element
(skinny_launch.skinny_config: the same bytes in flight). Graph-timed on an H200 at Qwen3-8B's shapes it
took 9.0 / 7.0 / 27.3 / 14.6 us (q/k/v, o, gate/up, down) where bf16's GEMV took 14.1 / 10.0 / 49.7 / 25.1
and kernels/fp8_gemv.py 49.1 / 34.2 / 62.6 / 87.0 (scripts/fp8_gemm_bench.py, 2026-12-03). bf16's RMSNorm
and SiLU-mul folds are not offered: over an e4m3 weight they took 15.7 / 42.4 us (norm fold, q/k/v and
gate/up) and 42.1 us (SiLU fold, down), as slow as bf16's, where the norm's or SiLU-mul's own kernel first
costs a few microseconds (the prologue's work a tile is the same as bf16's while the weight's bytes halve:
it no longer hides under them).

2 to 16 rows run kernels/skinny_rows.py's tensor-core kernel (each tile widened to x's dtype for the dot)
with bf16's launch settings, not yet timed over e4m3 on a GPU: at 16 rows kernels/fp8_gemv.py took
20.8 / 16.6 / 44.2 / 43.7 us at Qwen3-8B's shapes against bf16 cuBLAS's 15.7 / 13.2 / 50.3 / 29.0.

Scales in groups along K (block-scaled checkpoints) are not taken: a variant scaling each
tile passed in Triton's interpreter and failed on the GPU, not yet understood
(docs/performance-notes.md, "fp8 weights"). The weight layout is layers/fp8.py's."""

import torch

from nanovllm.kernels.common import sm_count
from nanovllm.kernels.skinny_gemm import check_one_row, launch_gemv
from nanovllm.kernels.skinny_launch import SkinnyConfig, skinny_config
from nanovllm.kernels.skinny_rows import MAX_ROWS, PLAIN, launch_rows, rows_config

FP8_DTYPE = torch.float8_e4m3fn


def _check(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, group: int,
           bias: torch.Tensor | None) -> None:
    n, k = weight.shape
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


def _checked(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, group: int,
             bias: torch.Tensor | None, width: int) -> SkinnyConfig:
    check_one_row(x, width, "x")
    _check(x, weight, weight_scale, group, bias)
    return skinny_config(*weight.shape, 1, sm_count(x.device))


def fp8_skinny_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, group: int,
                      bias: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """x [1, K] @ (weight [N, K] e4m3 * weight_scale [N, 1])^T (+ bias) in x's dtype, float32 sums;
    group: the inputs a scale covers (K or more: one a row)."""
    config = _checked(x, weight, weight_scale, group, bias, weight.shape[1])
    out = torch.empty((1, weight.shape[0]), dtype=x.dtype, device=x.device)
    return launch_gemv(x, weight, bias, out, config, pdl, weight_scale=weight_scale)


def fp8_rows_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, group: int,
                    bias: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """x [M, K] @ (weight [N, K] e4m3 * weight_scale [N, 1])^T (+ bias) for 1 to 16 rows of float16 or
    bfloat16 (the dot's operands: float32 would run as TF32), float32 sums; group as fp8_skinny_linear's."""
    n, k = weight.shape
    if x.dim() != 2 or not 1 <= x.shape[0] <= MAX_ROWS or x.shape[1] != k or x.stride(-1) != 1:
        raise ValueError(f"x must be 1 to {MAX_ROWS} rows of {k} with a contiguous last dim; got "
                         f"{tuple(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"x dtype {x.dtype} is not float16 or bfloat16")
    _check(x, weight, weight_scale, group, bias)
    out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    return launch_rows(x, weight, bias, out, rows_config(n, k, PLAIN), pdl, weight_scale=weight_scale)
