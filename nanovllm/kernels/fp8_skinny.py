"""Decode matmuls of 1 to 16 rows with e4m3 weights and one scale a row (per-channel fp8,
`quantization="fp8"`), W8A16: bf16's few-row kernels streaming the fp8 weight, each tile widened in
registers (exactly), the row's scale multiplying the finished sums, the activations unrounded (the rows
kernel also takes e4m3 rows with a scale a row, W8A8, for fp8 dots):

    out[m, n] = (sum over k of x[m, k] * w_fp8[n, k]) * w_scale[n] (+ bias)

One row runs kernels/skinny_gemm.py's GEMV with bf16's launch plan for one byte an element
(skinny_launch.skinny_config: the same bytes in flight). Graph-timed on an H200 at Qwen3-8B's shapes it
took 9.0 / 7.0 / 27.3 / 14.6 us (q/k/v, o, gate/up, down) where bf16's GEMV took 14.1 / 10.0 / 49.7 / 25.1
and kernels/fp8_gemv.py 49.1 / 34.2 / 62.6 / 87.0 (scripts/fp8_gemm_bench.py, 2026-12-03). bf16's RMSNorm
and SiLU-mul folds are not offered: over an e4m3 weight they took 15.7 / 42.4 us (norm fold, q/k/v and
gate/up) and 42.1 us (SiLU fold, down), as slow as bf16's, where the norm's or SiLU-mul's own kernel first
costs a few microseconds (the prologue's work a tile is the same as bf16's while the weight's bytes halve:
it no longer hides under them).

Two rows run kernels/gemv_rows.py's CUDA-core GEMV (float32 products, the weight widened like one row's),
3 to 16 kernels/skinny_rows.py's tensor-core kernel (each tile widened to x's dtype for the dot) with
tiles of FP8_ROWS_BLOCK_K inputs. In a sweep on an H200 at Qwen3-8B's shapes (graph-timed, 2026-12-03) the
GEMV took 12.5 / 9.4 / 39.7 / 20.1 us at two rows, where the rows kernel's best took 15.4 / 11.7 / 48.5 /
24.4; at 16 rows the rows kernel took 14.3 / 11.0 / 39.6 / 23.6 with these tiles, 20.8 / 16.7 / 44.2 /
43.8 with bf16's (rows_config), against kernels/fp8_gemv.py's 20.5 / 12.5 / 58.4 / 26.3 and bf16 cuBLAS's
15.7 / 13.1 / 48.8 / 28.4. The GEMV lost from four rows (18.2 / 13.5 / 59.9 / 31.3).

One row of a block-scaled weight (128 x 128 blocks, Qwen's FP8 checkpoints) runs kernels/fp8_block_gemv.py
(fp8_block_gemv_linear): tiles of runs inside one block, a scale a run. Graph-timed on an H200 at
Qwen3-8B's shapes it took 10.5 / 8.2 / 32.5 / 18.1 us, where the same GEMV over x times each block row's
scales (a [N / 128, K] float32 product first) took 16.1 / 13.0 / 44.5 / 24.7; one stream of Qwen3-8B 3.63
ms a token against 4.53 (2026-12-04, docs/performance-notes.md, "fp8 weights"). 2 to 16 rows of one run
the rows kernel with tiles inside one block, each tile's product times its block's scale
(fp8_rows_block_linear): 15.3 / 11.6 / 49.9 / 24.7 us at five rows, where kernels/fp8_gemv.py took 20.8 /
19.3 / 48.0 / 47.3. The weight layout is layers/fp8.py's."""

import dataclasses

import torch

from nanovllm.kernels import gemv_rows
from nanovllm.kernels.common import sm_count
from nanovllm.kernels.fp8_block_gemv import launch_block_gemv
from nanovllm.kernels.gemv_folds import check_gated
from nanovllm.kernels.norm_act import silu_and_mul
from nanovllm.kernels.rows_settings import MAX_ROWS, MIN_COLUMN_BLOCKS, SPLIT_K, RowsConfig
from nanovllm.kernels.skinny_gemm import check_one_row, launch_gemv
from nanovllm.kernels.skinny_launch import SkinnyConfig, skinny_config
from nanovllm.kernels.skinny_rows import launch_rows

FP8_DTYPE = torch.float8_e4m3fn
# The rows kernel's settings over e4m3 (fp8_rows_config), the best of a sweep on an H200 at Qwen3-8B's
# shapes (block_n 32-64, block_k 128-256, split 1-4; 2, 4 and 16 rows; docs/performance-notes.md, "fp8
# weights"): tiles of 128 inputs, and split-K only where the column blocks alone leave SMs idle (gate/up's
# 384 blocks ran fastest unsplit, q/k/v's 96 and o/down's 64 split in four).
FP8_ROWS_BLOCK_K = 128
FP8_SPLIT_BELOW_BLOCKS = 128


def _check(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, group: int,
           bias: torch.Tensor | None, out_dtype: torch.dtype | None = None) -> None:
    """Shapes and dtypes of a call; out_dtype: the output's (and a bias's), x's unless given (e4m3 rows,
    which only the rows kernel takes, checked by _rows_input first)."""
    n, k = weight.shape
    out_dtype = out_dtype or x.dtype
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32) and out_dtype == x.dtype:
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
    if bias is not None and (bias.shape != (n,) or bias.dtype != out_dtype or not bias.is_contiguous()):
        raise ValueError(f"bias must be contiguous ({n},) {out_dtype}")


def _checked(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, group: int,
             bias: torch.Tensor | None, width: int) -> SkinnyConfig:
    check_one_row(x, width, "x")
    _check(x, weight, weight_scale, group, bias)
    return skinny_config(*weight.shape, 1, sm_count(x.device))


def fp8_skinny_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, group: int,
                      bias: torch.Tensor | None = None, pdl: bool = False, gated: bool = False
                      ) -> torch.Tensor:
    """x [1, K] @ (weight [N, K] e4m3 * weight_scale [N, 1])^T (+ bias) in x's dtype, float32 sums;
    group: the inputs a scale covers (K or more: one a row). gated: weight is a gated MLP's [gate; up]
    and the result silu(gate) * up ([1, N / 2]; kernels/gemv_folds.py), the SiLU-mul's kernel saved."""
    config = _checked(x, weight, weight_scale, group, bias, weight.shape[1])
    if gated:
        check_gated(weight)
        if config.split_k > 1:  # the epilogue needs whole sums
            return silu_and_mul(fp8_skinny_linear(x, weight, weight_scale, group, bias, pdl), pdl)
    out = torch.empty((1, weight.shape[0] // (2 if gated else 1)), dtype=x.dtype, device=x.device)
    return launch_gemv(x, weight, bias, out, config, pdl, weight_scale=weight_scale, gated=gated)


def _check_blocks(x: torch.Tensor, weight: torch.Tensor, block_scale: torch.Tensor, block: tuple[int, int],
                  block_n: int, bias: torch.Tensor | None, out_dtype: torch.dtype | None = None) -> int:
    """Check a block-scaled weight, its scales and the bias (in out_dtype, x's unless given) for programs of
    block_n columns; returns the scale groups along K."""
    out_dtype = out_dtype or x.dtype
    (n, k), (rows, inputs) = weight.shape, block
    if weight.dtype != FP8_DTYPE or weight.stride(-1) != 1:
        raise ValueError(f"weight {weight.dtype} must be {FP8_DTYPE} with a contiguous last dim")
    if rows % block_n or n % rows:
        raise ValueError(f"{rows}-row blocks do not tile {n} outputs in programs of {block_n}")
    groups = -(-k // inputs)
    if (block_scale.dtype != torch.float32 or block_scale.shape[0] != n // rows
            or block_scale.shape[1] < groups or block_scale.stride(-1) != 1):
        raise ValueError(f"block_scale {tuple(block_scale.shape)} {block_scale.dtype} must be float32 "
                         f"{(n // rows, groups)} (or wider rows) with a contiguous last dim")
    if bias is not None and (bias.shape != (n,) or bias.dtype != out_dtype or not bias.is_contiguous()):
        raise ValueError(f"bias must be contiguous ({n},) {out_dtype}")
    return groups


def fp8_block_gemv_linear(x: torch.Tensor, weight: torch.Tensor, block_scale: torch.Tensor,
                          block: tuple[int, int], bias: torch.Tensor | None = None, pdl: bool = False,
                          gated: bool = False) -> torch.Tensor:
    """x [1, K] @ (weight [N, K] e4m3 * block_scale [N / rows, K / inputs] a block = (rows, inputs))^T
    (+ bias) in x's dtype, float32 sums, in one kernel (kernels/fp8_block_gemv.py): each K tile runs of
    inputs inside one block, a scale a run; `inputs` a power of two. The scales' rows may be padded past
    K / inputs, as kernels/fp8_scaled_mm.padded_block_scales pads them. gated: as fp8_skinny_linear's."""
    n, k = weight.shape
    rows, inputs = block
    config = skinny_config(n, k, 1, sm_count(x.device))
    check_one_row(x, k, "x")
    if inputs & (inputs - 1):
        raise ValueError(f"blocks of {inputs} inputs: the block GEMV's runs take a power of two")
    _check_blocks(x, weight, block_scale, block, config.block_n, bias)
    if gated:
        check_gated(weight)
        if config.split_k > 1:  # the epilogue needs whole sums
            return silu_and_mul(fp8_block_gemv_linear(x, weight, block_scale, block, bias, pdl), pdl)
    out = torch.empty((1, n // (2 if gated else 1)), dtype=x.dtype, device=x.device)
    return launch_block_gemv(x, weight, block_scale, block, bias, out, config, pdl, gated)


def _rows_input(x: torch.Tensor, k: int, x_scale: torch.Tensor | None, out_dtype: torch.dtype | None
                ) -> torch.dtype:
    """Check the rows kernel's x (and x_scale); the output's dtype."""
    if x.dim() != 2 or not 1 <= x.shape[0] <= MAX_ROWS or x.shape[1] != k or x.stride(-1) != 1:
        raise ValueError(f"x must be 1 to {MAX_ROWS} rows of {k} with a contiguous last dim; got "
                         f"{tuple(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16, FP8_DTYPE):
        raise ValueError(f"x dtype {x.dtype} is not float16 or bfloat16 (or {FP8_DTYPE} rows with scales)")
    if x.dtype == FP8_DTYPE and (x_scale is None or out_dtype is None):
        raise ValueError(f"{FP8_DTYPE} rows need their scales (x_scale) and an out_dtype")
    if x_scale is not None and (x.dtype == torch.bfloat16 or x_scale.shape != (x.shape[0], 1)
                                or x_scale.dtype != torch.float32 or not x_scale.is_contiguous()):
        raise ValueError(f"x with scales must be float16 or {FP8_DTYPE} rows with contiguous float32 scales "
                         f"({x.shape[0]}, 1); got {x.dtype} and {x_scale.dtype} {tuple(x_scale.shape)}")
    return out_dtype or x.dtype


def fp8_rows_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, group: int,
                    bias: torch.Tensor | None = None, pdl: bool = False, x_scale: torch.Tensor | None = None,
                    out_dtype: torch.dtype | None = None, counters: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """x [M, K] @ (weight [N, K] e4m3 * weight_scale [N, 1])^T (+ bias) for 1 to 16 rows of float16 or
    bfloat16 (the dot's operands: float32 would run as TF32), float32 sums; group as fp8_skinny_linear's.
    x_scale: float32 [M, 1], x then float16 rows standing for x * x_scale (kernels/float16_rows.py: bf16
    rows exactly) or e4m3 rows quantized with those scales (W8A8: an fp8 dot), each row's sums times its
    scale; the output in out_dtype (x's unless given; e4m3 rows need it). counters: the layer's split-K
    counters (skinny_rows.launch_rows)."""
    n, k = weight.shape
    out_dtype = _rows_input(x, k, x_scale, out_dtype)
    _check(x, weight, weight_scale, group, bias, out_dtype)
    out = torch.empty((x.shape[0], n), dtype=out_dtype, device=x.device)
    return launch_rows(x, weight, bias, out, fp8_rows_config(n, k), pdl, weight_scale=weight_scale,
                       x_scale=x_scale, counters=counters)


def fp8_rows_block_linear(x: torch.Tensor, weight: torch.Tensor, block_scale: torch.Tensor,
                          block: tuple[int, int], bias: torch.Tensor | None = None, pdl: bool = False,
                          x_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                          counters: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ (weight [N, K] e4m3 * block_scale [N / rows, K / inputs] a block = (rows, inputs))^T
    (+ bias) for 1 to 16 rows of float16 or bfloat16, float32 sums: the rows kernel with tiles inside one
    block, each tile's product times its block's scale (the weight-only reference's sum, reassociated).
    `inputs` a power of two from 16; the scales' rows may be padded past K / inputs. x_scale, out_dtype,
    counters: as fp8_rows_linear's."""
    n, k = weight.shape
    rows, inputs = block
    out_dtype = _rows_input(x, k, x_scale, out_dtype)
    if inputs < 16 or inputs & (inputs - 1):
        raise ValueError(f"blocks of {inputs} inputs: the rows kernel's tiles take a power of two from 16")
    config = fp8_rows_config(n, k)
    config = dataclasses.replace(config, block_k=min(config.block_k, inputs))
    _check_blocks(x, weight, block_scale, block, config.block_n, bias, out_dtype)
    out = torch.empty((x.shape[0], n), dtype=out_dtype, device=x.device)
    return launch_rows(x, weight, bias, out, config, pdl, weight_scale=block_scale, block=block,
                       x_scale=x_scale, counters=counters)


def fp8_rows_config(n: int, k: int) -> RowsConfig:
    """The rows kernel's launch settings for an e4m3 weight [n, k], from shapes alone: bf16's column block
    (rows_settings.rows_config), FP8_ROWS_BLOCK_K inputs a tile, split in SPLIT_K below
    FP8_SPLIT_BELOW_BLOCKS column blocks."""
    block_n, num_warps = (64, 4) if -(-n // 64) >= MIN_COLUMN_BLOCKS else (16, 2)
    block_k = max(16, min(FP8_ROWS_BLOCK_K, 1 << (k - 1).bit_length()))
    split = SPLIT_K if -(-n // block_n) < FP8_SPLIT_BELOW_BLOCKS and -(-k // block_k) > SPLIT_K else 1
    return RowsConfig(block_n, block_k, split, num_warps, num_stages=4, preload=2)


def fp8_gemv_rows_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, group: int,
                         bias: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """x [M, K] @ (weight [N, K] e4m3 * weight_scale [N, 1])^T (+ bias) for 1 to gemv_rows.MAX_ROWS rows on
    CUDA cores (kernels/gemv_rows.py), float32 sums, x unrounded (float32 too); group as
    fp8_skinny_linear's."""
    n, k = weight.shape
    if x.dim() != 2 or not 1 <= x.shape[0] <= gemv_rows.MAX_ROWS or x.shape[1] != k or x.stride(-1) != 1:
        raise ValueError(f"x must be 1 to {gemv_rows.MAX_ROWS} rows of {k} with a contiguous last dim; got "
                         f"{tuple(x.shape)}")
    _check(x, weight, weight_scale, group, bias)
    out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    return gemv_rows.launch_gemv_rows(x, weight, bias, out, pdl, weight_scale=weight_scale)
