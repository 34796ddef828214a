"""Launch settings of the rows kernel (kernels/skinny_rows.py), from shapes alone so that calls stay
CUDA-graph capturable: the rows x is padded to, the column block, K tile, split and stages a layer gets,
and those cut to fit the shared memory a block may take."""

import dataclasses

import torch
import triton
import triton.language as tl

from nanovllm.kernels.skinny_gemm import ADD_RMS_NORM, PLAIN, RMS_NORM

# The rows of x the dot takes at once (tl.dot's smallest operand width), and the most a plain launch pads
# to (rows_tile); a norm's launch takes ROWS at most (its [rows, BLOCK_K] sums of squares are registers).
ROWS = 16
MAX_ROWS = 128
# Shared memory the pipelined tiles may take of sm_90's 227 KB a block, Triton keeping a buffer more than its
# stages where the dot chains into its accumulator (32 rows of bf16 in four stages of 256-input tiles asked
# 256 KB on an H100: fit_shared).
SHARED_BUDGET = 208 * 1024
# rows_config's choices, measured on an H200 (132 SMs; commit adbf98d, docs/performance-notes.md, section
# "Decode GEMMs and GEMVs": 28 calls of each Qwen3-0.6B linear at 2, 8 and 16 rows, the best of ~20
# settings a shape). q/k/v (N = 4096) and gate/up (6144) ran fastest in 64-row column blocks (64 and 96
# programs), o_proj and down_proj (N = 1024) in 16-row ones; down_proj (K = 3072) split in four (211 us
# against 218-231 unsplit or in two), o_proj (K = 2048) unsplit, 5 stages. In the engine (decode graphs
# at 2-16 rows) the norm-folded launches without preloaded tiles took 40-70 us a step less than with two.
# At Qwen3-8B's shapes (scripts/rows_sweep.py, 2026-12-04, engine code 91c0e4f) the split lost: o_proj
# (N = 4096, K = 4096) 12.0 us unsplit against 19.1 split in four, down_proj (K = 12288) 28-29 against 35
# at 5-16 rows; the float32 partials' reduce is a second, plain launch. So only outputs narrower than
# SPLIT_BELOW_N, whose column blocks leave SMs idle, split.
MIN_COLUMN_BLOCKS = 64
SPLIT_ABOVE_TILES = 8
SPLIT_BELOW_N = 2048
SPLIT_K = 4


@dataclasses.dataclass(frozen=True, slots=True)
class RowsConfig:
    block_n: int = 16  # weight rows (output columns) per program
    block_k: int = 256  # K elements per weight tile
    split_k: int = 1  # programs per column block, each summing a contiguous range of K
    num_warps: int = 2
    num_stages: int = 4
    preload: int = 2  # weight tiles loaded before the PDL wait (0-2)


def fit_shared(config: RowsConfig, rows: int, x: torch.Tensor, weight: torch.Tensor) -> RowsConfig:
    """config with stages (two at least), then tiles, cut where the tiles (x at `rows`) pass SHARED_BUDGET."""
    per_input = rows * x.element_size() + config.block_n * weight.element_size()
    block_k = config.block_k
    while block_k > 16 and 3 * per_input * block_k > SHARED_BUDGET:
        block_k //= 2
    stages = max(2, min(config.num_stages, SHARED_BUDGET // (per_input * block_k) - 1))  # stages + 1 buffers
    if (block_k, stages) == (config.block_k, config.num_stages):
        return config  # the usual case: no copy a launch
    return dataclasses.replace(config, block_k=block_k, num_stages=stages)


def rows_tile(m: int) -> int:
    """The rows a launch for m rows pads x to: the dot's operand width, a power of two from ROWS."""
    return max(ROWS, triton.next_power_of_2(m))


def rows_config(n: int, k: int, prologue: tl.constexpr = PLAIN) -> RowsConfig:
    """Launch settings from shapes alone: a column block of 64 weight rows at 4 warps (16 a warp, the dot's
    whole layout) where that still gives MIN_COLUMN_BLOCKS programs, else 16 rows at 2 warps; split-K for a
    plain launch narrower than SPLIT_BELOW_N over more than SPLIT_ABOVE_TILES tiles."""
    block_n, num_warps = (64, 4) if triton.cdiv(n, 64) >= MIN_COLUMN_BLOCKS else (16, 2)
    block_k = max(16, min(256, triton.next_power_of_2(k)))
    split = prologue == PLAIN and n < SPLIT_BELOW_N and triton.cdiv(k, block_k) > SPLIT_ABOVE_TILES
    split_k = SPLIT_K if split else 1
    num_stages = 5 if block_n == 16 else 4
    # Two preloaded 64-row tiles are 128 registers a thread held across the norm's prologue.
    preload = 0 if prologue in (RMS_NORM, ADD_RMS_NORM) else 2
    return RowsConfig(block_n, block_k, split_k, num_warps, num_stages, preload)
