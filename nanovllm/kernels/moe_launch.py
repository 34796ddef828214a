"""How the fused MoE's grouped GEMMs (kernels/fused_moe.py) are launched: tile sizes, warps and pipeline
depth, picked from the number of slots (token x top-k pairs) per expert and the weights' dtype alone (no
autotuning, so a CUDA-graph capture never compiles or times anything), then shrunk where the device's
shared memory cannot hold their pipeline (`fit_shared_memory`: the choices are Hopper's)."""

import math
from dataclasses import dataclass, replace

import torch

from nanovllm.kernels.fp8_gemm import MIN_FP8_DOT_K


@dataclass(frozen=True, slots=True)
class MoeConfig:
    """Launch parameters of the grouped GEMMs; `moe_config` picks them from shapes alone (no autotuning,
    so a CUDA-graph capture never compiles or times anything)."""

    block_m: int  # sorted rows per block: every expert's slot count is padded to a multiple
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    # Products as w @ a^T: on sm_90 a block of 16-32 rows is too narrow for wgmma's 64-row side, so
    # Triton falls back to mma.sync (and W8A8 to widening both operands); the weight tile fits it.
    swap_ab: bool = False
    # fp8 experts only: x and the intermediate quantized per row and scale group too, e4m3 by e4m3 on
    # the fp8 tensor cores (W8A8, what the checkpoints' "dynamic" activation scheme and the CPU's
    # reference compute); otherwise the e4m3 weight tiles are widened in registers (W8A16).
    w8a8: bool = False
    # fp8 experts with bf16 activations, W8A16: x and the intermediate as float16 rows times a power of two
    # (exact), so the weight tiles widen to float16, the cheap conversion on sm_90.
    f16: bool = False
    # W8A8 with one scale a row: the e4m3 dots chain their sums in the fp8 tensor cores' accumulator over
    # the whole K (~14 bits kept while they sum, as torch._scaled_mm's use_fast_accum, which the dense fp8
    # GEMMs run: kernels/fp8_scaled_mm.FAST_ACCUM), rather than a fresh dot a K tile added in float32.
    fast_accum: bool = False


# Slots per expert (on average) below which the GEMMs take 16-row, then 32-row blocks; above, 64.
FEW_SLOTS_PER_EXPERT = 8
SOME_SLOTS_PER_EXPERT = 32
# Below this many slots (decode batch < 8 at top-8) few experts are hit: 32-column tiles make twice
# as many programs as 64-column ones, to keep every SM streaming weights.
NARROW_TILE_MAX_SLOTS = 64
# Column tiles of the many-slot (prefill) GEMMs, and W8A8's K tiles there (_prefill_tiles).
PREFILL_BLOCK_N = 256
W8A8_PREFILL_BLOCK_K = 128
# fit_shared_memory: what a program's shared memory holds beyond the pipelined tiles (the sm_90 builds
# show 1 KB), and the narrowest column tile it goes down to.
SHARED_MEMORY_HEADROOM = 4 * 1024
MIN_BLOCK_N = 32
# Whether fp8 experts run W8A8 (MoeConfig.w8a8, with swap_ab below 64-row blocks): x and the intermediate
# rounded to e4m3 with a scale a row (or a 128-group), as vLLM's fp8 experts and the dense fp8 GEMMs from 17
# rows do. Its sm_90 builds (wgmma e4m3) issue a quarter to a third of the widening builds' instructions a K
# tile; bench.py on Qwen3-30B-A3B with fp8 weights 7,990 tok/s against 6,487 widening to bf16 and 6,927
# widening to float16 (H200, 2026-12-05; docs/performance-notes.md, "Mixture of experts").
W8A8_EXPERTS = True
# Whether fp8 experts that stay W8A16 (static activation scales, K tiles too narrow for an e4m3 dot)
# widen to float16 over float16 rows (MoeConfig.f16, with swap_ab below 64-row blocks) rather than to
# bf16: 315 instructions a warp a gate/up K tile against 507 (sm_90, Triton 3.6), the F2F and PRMT of
# bf16's widening gone; bench.py as above 6,927 tok/s against 6,487. A float16-rows launch
# (kernels/float16_rows.py) comes before each of the two GEMMs.
F16_EXPERTS = True
# Whether W8A8 experts with one scale a row chain their dots (MoeConfig.fast_accum). The prefill config's
# gate/up K loop issues 140 instructions a warp instead of 276 (sm_90, Triton 3.6: the 128 float32 adds of
# the fresh products gone, and one warpgroup wait fewer). Qwen3-30B-A3B's layer on an H100 (moe_bench.py
# --fp8 channel --batches ..., 2026-12-05): 16,384 tokens 2,526 -> 2,277 us, 4,096 tokens 746 -> 696, 256
# and 64 rows within 0.5%; bench.py with fp8 weights 6,911 -> 6,957 tok/s. The sums keep the tensor cores'
# ~14 bits over the whole K, as the dense fp8 GEMMs' fast accumulation does (fp8_scaled_mm.FAST_ACCUM, which
# moved fp8-weight prompt logprobs by nothing measurable); the fused MoE's GPU tests hold them to W8A8's
# bounds.
FAST_ACCUM_EXPERTS = True


def moe_config(num_slots: int, num_experts: int, dtype: torch.dtype, fp8_weights: bool = False,
               k_group: int = 0, w8a8: bool = True) -> MoeConfig:
    """Few slots per expert (decode): 16-row blocks, so padding wastes little, and narrow column tiles,
    so that the few experts hit still spread over every SM. Many (prefill): larger tiles reuse each
    weight tile over more rows. Guesses for Hopper, timed by scripts/moe_bench.py (bf16 and fp8 experts).
    k_group: fp8 scales' group along K (0: none, or one a row); K tiles are narrowed to split it. fp8
    experts run W8A8 where W8A8_EXPERTS says so, w8a8 allows it (False: the activations stay unrounded) and
    the K tiles are wide enough for an e4m3 dot; else with bf16 activations over float16 rows where
    F16_EXPERTS says so."""
    per_expert = num_slots / num_experts
    small_k = 64 if dtype == torch.float32 else 128  # same bytes per tile
    if per_expert < FEW_SLOTS_PER_EXPERT:
        block_n = 32 if num_slots < NARROW_TILE_MAX_SLOTS else 64
        config = MoeConfig(16, block_n, small_k, num_warps=4, num_stages=4)
    elif per_expert < SOME_SLOTS_PER_EXPERT:
        # fp8 weights: K tiles as many bytes wide as bf16's (moe_bench --fp8 at 256 rows: 285 -> 261 us
        # a layer per channel, 292 -> 266 per 128-block; at 64 rows and fewer, wider tiles were slower)
        config = MoeConfig(32, 64, small_k if fp8_weights else small_k // 2, num_warps=4, num_stages=4)
    else:
        config = MoeConfig(64, 128, small_k // 2, num_warps=8, num_stages=3)
    if k_group and k_group % config.block_k:
        config = replace(config, block_k=math.gcd(config.block_k, k_group))
    if fp8_weights and w8a8 and W8A8_EXPERTS and config.block_k >= MIN_FP8_DOT_K:
        config = replace(config, w8a8=True, swap_ab=config.block_m < 64)
    elif fp8_weights and F16_EXPERTS and dtype == torch.bfloat16:
        config = replace(config, f16=True, swap_ab=config.block_m < 64)
    if per_expert >= SOME_SLOTS_PER_EXPERT:
        config = _prefill_tiles(config, fp8_weights, k_group)
    if config.w8a8 and not k_group and FAST_ACCUM_EXPERTS:
        config = replace(config, fast_accum=True)
    return config


def _prefill_tiles(config: MoeConfig, fp8_weights: bool, k_group: int) -> MoeConfig:
    """Many slots an expert: 256-column tiles for bf16 experts and W8A8 ones with one scale a row, W8A8's K
    tiles as many bytes wide as bf16's (128 inputs where the scale group allows it). At a 16,384-token
    prefill of Qwen3-30B-A3B's layer, against 64 x 128 tiles 64 inputs wide: W8A8 3,734 -> 2,518 us, bf16
    4,007 -> 3,292 (4,096 tokens: 1,071 -> 749, 1,214 -> 1,041; `moe_bench.py --batches 16384 4096`, H100,
    2026-12-05). W8A8 with scale groups along K keeps 128 columns (at 256 its fresh product a tile spills
    registers in the sm_90 build; 64 x 128 x 128 tiles took 2,844 us per channel); widened fp8 (W8A16)
    keeps its tiles (256 columns of them overflow Hopper's shared memory at 3 stages; not timed)."""
    if config.w8a8:
        split = not k_group or k_group % W8A8_PREFILL_BLOCK_K == 0
        return replace(config, block_n=PREFILL_BLOCK_N // 2 if k_group else PREFILL_BLOCK_N,
                       block_k=W8A8_PREFILL_BLOCK_K if split else config.block_k)
    if fp8_weights:
        return config
    return replace(config, block_n=PREFILL_BLOCK_N)


def fit_shared_memory(config: MoeConfig, a_bytes: int, w_bytes: int, limit: int) -> MoeConfig:
    """config with fewer pipeline stages (down to 2), then narrower column tiles, until the gate/up GEMM's
    tiles (the larger GEMM's: a block of activation rows and the gate's and the up's weight tiles, every
    stage) fit `limit` bytes of shared memory a program (Hopper 227 KB; A100 163 KB; Ada 99 KB). a_bytes:
    an activation element as the GEMM reads it (1 for W8A8, 2 for float16 rows)."""
    while True:
        stage = config.block_m * config.block_k * a_bytes + 2 * config.block_n * config.block_k * w_bytes
        if config.num_stages * stage + SHARED_MEMORY_HEADROOM <= limit or config.block_n <= MIN_BLOCK_N:
            return config
        if config.num_stages > 2:
            config = replace(config, num_stages=config.num_stages - 1)
        else:
            config = replace(config, block_n=config.block_n // 2)
