"""How the one-row GEMV (kernels/skinny_gemm.py) is launched: tile widths, pipeline depth and split-K,
picked from the matrix shape alone (no autotuning, so a CUDA-graph capture never compiles or times
anything). The constants are facts of the kernel's tiling and of the H200's memory system."""

from dataclasses import dataclass

import triton

from nanovllm.kernels.common import DEFAULT_NUM_SMS

# Bytes of weight the whole GPU should have requested but not yet received: H200 HBM (~4.8 TB/s) times a
# loaded-memory latency of ~0.8 us (Little's law). The pipeline depth is chosen so that the resident
# programs' prefetched tiles add up to this; fewer leave bandwidth idle, more only cost shared memory.
TARGET_BYTES_IN_FLIGHT = 4 << 20
# Programs per SM wanted before a narrower BLOCK_N (more column blocks) is preferred: two let one
# program's loads overlap another's epilogue and soften the tail of the grid.
PROGRAMS_PER_SM = 2
# Split K only when the column blocks would leave more than 3/4 of the SMs idle: then one SM's own
# load bandwidth (~100-200 GB/s), not latency, caps the kernel, and the extra reduce launch is worth it.
MIN_BLOCKS_PER_SM_NO_SPLIT = 0.25
# GEMV tile: 4096 weights (8 KB of bf16) is 32 float32 partial sums per thread at 4 warps (~70 registers
# in all on sm_90), leaving room for several resident programs per SM.
GEMV_TILE_ELEMENTS = 4096
GEMV_NUM_WARPS = 4
GEMV_WIDTHS = (16, 8, 4)
# Pipeline depth bounds (num_stages - 1 tiles are in flight). The shared-memory bound counts x and w
# staged for every stage, an overestimate, and stays well under the 227 KB one Hopper program may use.
MIN_NUM_STAGES = 3
MAX_NUM_STAGES = 8
SMEM_BUDGET = 160 << 10
# The narrowest K tile worth a loop iteration.
MIN_BLOCK_K = 16
# Weight tiles a programmatic dependent launch loads before it waits for the kernel before: single-stream
# decode 0.845-0.862 ms/token with 2, 0.861-0.901 with 4, 0.892-0.920 without PDL (commit 12ea44a).
PDL_PRELOAD_TILES = 2


@dataclass(frozen=True, slots=True)
class SkinnyConfig:
    """Launch parameters of one call; `skinny_config` picks them from shapes, benchmarks may pass others."""

    block_n: int  # output columns per program (a power of two)
    block_k: int  # K elements per weight tile (a power of two)
    split_k: int = 1  # programs per column block, each summing a contiguous range of K
    num_warps: int = 4
    num_stages: int = 3  # software-pipeline depth of the K loop: num_stages - 1 tiles in flight
    preload: int | None = None  # tiles (0-2) loaded ahead of the loop; None: PDL_PRELOAD_TILES under PDL


def skinny_config(n: int, k: int, element_size: int, num_sms: int = DEFAULT_NUM_SMS) -> SkinnyConfig:
    """Launch parameters for x[1, k] @ weight[n, k]^T from shapes alone (no autotuning, so a graph capture
    never compiles or times anything). BLOCK_N: the widest that still gives PROGRAMS_PER_SM programs per
    SM. BLOCK_K: a register budget. num_stages: enough prefetched tiles over the resident programs to
    reach TARGET_BYTES_IN_FLIGHT. Qwen3-0.6B: 4 x 1024 tiles for N = 1024, 8 x 512 for N = 4096,
    16 x 256 for N = 6144."""
    wanted_blocks = PROGRAMS_PER_SM * num_sms
    block_n = next((w for w in GEMV_WIDTHS if triton.cdiv(n, w) >= wanted_blocks), GEMV_WIDTHS[-1])
    block_k = GEMV_TILE_ELEMENTS // block_n
    stage_rows = 1 + block_n
    # Round down to a power of two, and no wider than K itself.
    block_k = max(MIN_BLOCK_K, min(1 << (block_k.bit_length() - 1), triton.next_power_of_2(k)))
    num_tiles = triton.cdiv(k, block_k)

    num_blocks = triton.cdiv(n, block_n)
    split_k = 1
    if num_blocks < MIN_BLOCKS_PER_SM_NO_SPLIT * num_sms:
        split_k = max(1, min(triton.cdiv(num_sms, num_blocks), num_tiles))
    # Only programs resident at the same time have bytes in flight.
    resident = min(num_blocks * split_k, wanted_blocks)
    tiles_in_flight = triton.cdiv(TARGET_BYTES_IN_FLIGHT, resident * block_n * block_k * element_size)
    max_stages = min(MAX_NUM_STAGES, SMEM_BUDGET // (stage_rows * block_k * element_size))
    # A loop of num_tiles tiles gains nothing from more than num_tiles tiles in flight.
    num_stages = max(MIN_NUM_STAGES, min(tiles_in_flight, triton.cdiv(num_tiles, split_k)) + 1)
    num_stages = max(2, min(num_stages, max_stages))
    return SkinnyConfig(block_n, block_k, split_k, GEMV_NUM_WARPS, num_stages)
