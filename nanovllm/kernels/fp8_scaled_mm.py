"""fp8 GEMMs through torch, fed by kernels/fp8_gemm.quantize_rows (or activations quantized already, as
kernels/norm_quant.py writes them): torch._scaled_mm with row-wise scales (one a weight row, one a token:
cuBLASLt's outer-vector-scaled kernels on sm_90 with torch 2.11, CUTLASS in older torch), and torch's
block-scaled GEMM (torch.nn.functional.scaled_mm with 1 x 128 activation and 128 x 128 weight scales,
cuBLASLt). Each has the `*_quantized` form for activations quantized already; what row-wise scaling cannot
take goes to the Triton W8A8 GEMM."""

import torch
import torch.nn.functional as F

from nanovllm.kernels.fp8_gemm import quantize_rows, w8a8_linear

# Row-wise products accumulate in the fp8 tensor cores' own accumulator over the whole K loop
# (torch._scaled_mm's use_fast_accum: ~14 bits kept while they sum, as the Triton W8A8 GEMM's K tiles),
# not promoted to float32 every few MMAs: bench.py on Qwen3-8B with fp8 weights and cache 11,166 -> 11,735
# tok/s (H100, 2026-12-05), and prompt logprobs of fp8 weights as far from bf16's as before (0.586 -> 0.584
# nats; scripts/fp8_quality.py). Against the float32 sum of the e4m3 operands its mean error is 1.8-2.6e-3
# of the mean output where bf16's output rounding alone gives 1.4e-3 (scripts/scaled_mm_modes.py, Qwen3-8B's
# shapes): small beside e4m3's rounding of the operands (~3% a value).
FAST_ACCUM = True


def scaled_mm_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, group: int,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ (weight [N, K] e4m3 * weight_scale [N, 1])^T (+ bias), x's dtype out, through
    torch._scaled_mm with row-wise scales (cuBLASLt / CUTLASS's fp8 GEMM): one scale a weight row, one a
    token from quantize_rows, the rounding of w8a8_linear's one-group case. What row-wise scaling cannot
    take (K or N not a multiple of 16, scales in groups, or on a GPU an output other than bf16) goes to
    w8a8_linear."""
    if not scaled_mm_takes(x, weight, group):
        return w8a8_linear(x, weight, weight_scale, group, bias)
    return scaled_mm_quantized(*quantize_rows(x, weight.shape[1]), weight, weight_scale, bias, x.dtype)


def scaled_mm_takes(x: torch.Tensor, weight: torch.Tensor, group: int) -> bool:
    """Whether torch._scaled_mm's row-wise scaling takes x [M, K] @ weight [N, K]^T with scale groups of
    `group`: K and N multiples of 16, one group a row, and on a GPU a bfloat16 output."""
    n, k = weight.shape
    return not (k % 16 or n % 16 or group < k or (x.is_cuda and x.dtype != torch.bfloat16))


def scaled_mm_quantized(q: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor,
                        weight_scale: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype
                        ) -> torch.Tensor:
    """scaled_mm_linear's product of activations quantized already: e4m3 q [M, K] with scale [M, 1]."""
    return torch._scaled_mm(q, weight.t(), scale_a=scale, scale_b=weight_scale.view(1, weight.shape[0]),
                            bias=bias, out_dtype=out_dtype, use_fast_accum=FAST_ACCUM)


def padded_block_scales(block_scale: torch.Tensor) -> torch.Tensor:
    """block_scale [N / 128, K / 128] with its K blocks padded to a multiple of 4 (zeros, never read):
    cuBLASLt reads the weight's scales K-block-major with a 16-byte leading dimension, and torch checks
    that shape (K = 384 is 3 blocks, taken as 4)."""
    return F.pad(block_scale, (0, -block_scale.shape[1] % 4)).contiguous()


def block_scaled_mm_linear(x: torch.Tensor, weight: torch.Tensor, block_scale: torch.Tensor,
                           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ (weight [N, K] e4m3 * block_scale [N / 128, K / 128], one scale a 128 x 128 block)^T
    (+ bias), x quantized per token and 128 inputs first (quantize_rows: the rounding of w8a8_linear with
    128-wide groups), through torch's block-scaled GEMM (torch.nn.functional.scaled_mm, cuBLASLt on sm_90):
    at Qwen3-8B's shapes and 256-4,096 rows about half the Triton GEMM's time (docs/performance-notes.md,
    "torch's block-scaled GEMM"). Rows are padded to a multiple of 4, its scales' alignment; block_scale
    may come padded already (padded_block_scales: what the linear method keeps, so no call pads it)."""
    m = x.shape[0]
    padded = F.pad(x, (0, 0, 0, -m % 4)) if m % 4 else x
    q, scale = quantize_rows(padded, 128)
    return block_scaled_mm_quantized(q, scale.t().contiguous().t(), weight, block_scale, bias, x.dtype)[:m]


def block_scaled_mm_quantized(q: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor,
                              block_scale: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype
                              ) -> torch.Tensor:
    """block_scaled_mm_linear's product of activations quantized already: e4m3 q [M', K] (M' a multiple of
    4) with its scales a row and 128 inputs, column-major [M', K / 128] (strides (1, M'))."""
    if block_scale.shape[1] % 4:
        block_scale = padded_block_scales(block_scale)
    out = F.scaled_mm(q, weight.t(), scale, F.ScalingType.BlockWise1x128, block_scale.t(),
                      F.ScalingType.BlockWise128x128, output_dtype=out_dtype)
    return out if bias is None else out + bias
