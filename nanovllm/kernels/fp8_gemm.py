"""W8A8 block-scaled GEMM for many rows (prefill, large decode batches), fp8 e4m3 on both operands:

    x_fp8, x_scale = quantize per token and group of GROUP inputs      x_scale [M, ceil(K / GROUP)]
    out[m, n] = sum over K tiles kb of (x_fp8 @ w_fp8^T)[m, n] * x_scale[m, kb] * w_scale[n, kb] (+ bias)

in float32, stored in the model's dtype. The weight layout is layers/fp8.py's: w_fp8 [N, K] and w_scale
[N, ceil(K / GROUP)], one scale row per weight row, so a 128x128 block checkpoint (GROUP = 128) and a
per-channel or per-tensor one (GROUP = K, one K-group) run the same kernel; with one group the scales
multiply the finished sums once instead of every tile's.

The activations are quantized by a small kernel first (`quantize_rows`: per token and group, scale =
max(amax, MIN_AMAX) / 448, x / scale rounded to nearest-even e4m3), the rounding layers/fp8.py's
reference does. The products run on fp8 tensor cores (tl.dot of e4m3 operands: wgmma on sm_90, mma on
sm_89) and each K tile's sum is added to a float32 accumulator (within a tile sm_90's fp8 tensor cores
keep ~14 bits: outputs differ from an exact float32 sum by ~1e-3 relative); a K tile never straddles two
scale groups (BLOCK_K divides GROUP, or the whole K is one group). Sizes come from shapes alone (no host
sync), so calls are CUDA-graph capturable.
Seen on an H200: within 1.5e-2 of the float32 reference on O(1) outputs (128-element K tiles). torch's own
fp8 GEMMs, fed by the same quantize_rows, are in kernels/fp8_scaled_mm.py."""

import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nanovllm.kernels.split_k import plan_split_k, reduce_split_k, split_k_workspace

# layers/fp8.py's numerics (a kernel module must not import layers/): the e4m3 range and the smallest
# amax a scale is taken from, so that an all-zero group gets a tiny scale, not a division by zero.
FP8_MAX = tl.constexpr(448.0)
MIN_AMAX = tl.constexpr(1e-10)
FP8_DTYPE = torch.float8_e4m3fn
# Elements of a group the quantizing kernel reads at once; a longer group (per-token: all of K) loops.
QUANT_BLOCK = 1024
# GEMM tiles: 128 columns of K is one scale group of a 128x128 block checkpoint, and a 128-row fp8 tile is
# 16 KB; three stages of both operands (96 KB at 128x128) fit Hopper's shared memory with room to spare.
GEMM_BLOCK_K = 128
GEMM_NUM_STAGES = 3
# The narrowest K tile of an e4m3 dot on sm_90 (16 does not compile there): the W8A8 GEMM takes scale groups
# that tile by 32, 64 or 128 (w8a8_block_k).
MIN_FP8_DOT_K = 32
# float32 values whose units are integers are rounded to nearest-even by adding and subtracting this.
ROUND_MAGIC = tl.constexpr(1.5 * 2**23)
# Triton's interpreter (CPU tensors) fuses no fma and truncates a mantissa carry in its e4m3 cast: there
# `quantized` divides and rounds in plain float32 arithmetic instead.
INTERPRETING = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def round_to_e4m3_grid(v):
    """v (float32, |v| <= 448) rounded to nearest-even e4m3 in float32 arithmetic, so that the cast after
    it is exact: what the GPU's cast does (cvt.rn), for Triton's interpreter, whose cast truncates a
    mantissa carry (127 -> 64, not 128). The e4m3 step of v is 2^(e - 3) for its exponent e, and 2^-9
    below the normal range (e < -6)."""
    bits = v.to(tl.uint32, bitcast=True)
    step_exp = tl.maximum(((bits >> 23) & 0xFF).to(tl.int32), 127 - 6) - 3  # biased exponent of the step
    step = (step_exp << 23).to(tl.float32, bitcast=True)
    inv_step = ((254 - step_exp) << 23).to(tl.float32, bitcast=True)
    rounded = ((tl.abs(v) * inv_step + ROUND_MAGIC) - ROUND_MAGIC) * step
    # v's sign put back: a negative value rounded to zero stays -0, as the cast makes it.
    return (rounded.to(tl.uint32, bitcast=True) | (bits & 0x80000000)).to(tl.float32, bitcast=True)


@triton.jit
def quantized(x, scale):
    """x / scale (float32) clamped to +-448, ready for the e4m3 cast: the quotient rounded as IEEE
    division (torch's x / scale) rounds it, and the cast then rounds to nearest-even e4m3 as torch's does.
    On the GPU the quotient is x times 1 / scale with one residual correction (Markstein's: two fmas)
    instead of a division's subroutine an element, and the cast rounds; x = -0 keeps its sign as the
    division keeps it. The corrected product was checked equal to the division for every quotient of
    2^-11 and up (smaller ones round to a signed zero in e4m3 either way). The interpreter divides and
    rounds in float32 arithmetic (round_to_e4m3_grid), so the cast after it is exact there too."""
    if INTERPRETING:
        return round_to_e4m3_grid(tl.clamp(tl.math.div_rn(x, scale), -FP8_MAX, FP8_MAX))
    inverse = tl.math.div_rn(1.0, scale)
    q = x * inverse
    q = tl.fma(tl.fma(-q, scale, x), inverse, q)
    return tl.clamp(tl.where(x == 0, x, q), -FP8_MAX, FP8_MAX)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, K, stride_xm, num_groups, GROUP, BLOCK: tl.constexpr):
    """One program per (row, group): the group's amax, then its values scaled and rounded to e4m3."""
    m = tl.program_id(0)
    g = tl.program_id(1)
    start = g * GROUP
    end = tl.minimum(start + GROUP, K)
    row = x_ptr + m.to(tl.int64) * stride_xm
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for k in range(start, end, BLOCK):
        offs = k + tl.arange(0, BLOCK)
        amax = tl.maximum(amax, tl.abs(tl.load(row + offs, mask=offs < end, other=0.0).to(tl.float32)))
    scale = tl.maximum(tl.max(amax, axis=0), MIN_AMAX) / FP8_MAX
    tl.store(scale_ptr + m * num_groups + g, scale)
    for k in range(start, end, BLOCK):
        offs = k + tl.arange(0, BLOCK)
        x = tl.load(row + offs, mask=offs < end, other=0.0).to(tl.float32)
        q = quantized(x, scale)
        tl.store(q_ptr + m.to(tl.int64) * K + offs, q.to(q_ptr.dtype.element_ty), mask=offs < end)


def quantize_rows(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (last dim contiguous) -> (e4m3 [M, K] contiguous, float32 scales [M, ceil(K / group)]),
    as layers/fp8.quantize_groups rounds it."""
    m, k = x.shape
    num_groups = triton.cdiv(k, group)
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((m, num_groups), dtype=torch.float32, device=x.device)
    if m and k:
        block = min(QUANT_BLOCK, triton.next_power_of_2(min(group, k)))
        _quantize_rows_kernel[(m, num_groups)](x, q, scale, k, x.stride(0), num_groups, group, BLOCK=block)
    return q, scale


@triton.jit(do_not_specialize=["M"])  # one build for every row count
def _w8a8_gemm_kernel(
    x_ptr,  # [M, K] e4m3, contiguous
    x_scale_ptr,  # [M, num_groups] float32, contiguous
    w_ptr,  # [N, K] e4m3, rows stride_wn apart
    w_scale_ptr,  # [N, num_groups] float32, contiguous
    bias_ptr,  # [N] in the output's dtype
    out_ptr,  # [M, N], rows stride_om apart; with WRITE_PARTIAL a [splits, M, N] float32 workspace
    M,
    N,
    K,
    stride_wn,
    stride_om,
    num_groups,
    GROUP,  # inputs per scale group (a multiple of BLOCK_K, or >= K when ONE_GROUP)
    tiles_per_split,  # K tiles each program along axis 2 sums
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ONE_GROUP: tl.constexpr,  # per-channel / per-tensor: the scales multiply the finished sums
    HAS_BIAS: tl.constexpr,
    WRITE_PARTIAL: tl.constexpr,  # split K: scaled float32 partial sums, bias added by the reduce
    NUM_STAGES: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    # Rows past M and columns past N read the last real ones (never stored): loads need only K masks.
    real_m = tl.minimum(offs_m, M - 1).to(tl.int64)
    real_n = tl.minimum(offs_n, N - 1).to(tl.int64)
    x_rows = x_ptr + real_m[:, None] * K  # [BLOCK_M, 1]
    w_rows = w_ptr + real_n[:, None] * stride_wn  # [BLOCK_N, 1]
    offs_k = tl.arange(0, BLOCK_K)
    if WRITE_PARTIAL:  # this program's share of K
        k_start = pid_k * tiles_per_split * BLOCK_K
        k_end = tl.minimum(k_start + tiles_per_split * BLOCK_K, K)
    else:  # all of it, with bounds the compiler sees as the whole K (a leaner pipelined loop)
        k_start = 0
        k_end = K
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in tl.range(k_start, k_end, BLOCK_K, num_stages=NUM_STAGES):
        k_mask = (k + offs_k < k_end)[None, :]
        a = tl.load(x_rows + (k + offs_k)[None, :], mask=k_mask, other=0.0)  # [BLOCK_M, BLOCK_K] e4m3
        b = tl.load(w_rows + (k + offs_k)[None, :], mask=k_mask, other=0.0)  # [BLOCK_N, BLOCK_K] e4m3
        if ONE_GROUP:
            # A fresh dot per K tile, added in float32: sm_90's fp8 tensor cores accumulate with ~14-bit
            # precision, so chaining them over the whole K (4096-12288 at 8B) would lose digits the
            # weights have; one tile's 128 products is what the block-scaled path accumulates too.
            acc += tl.dot(a, tl.trans(b))
        else:
            g = k // GROUP
            xs = tl.load(x_scale_ptr + real_m * num_groups + g)
            ws = tl.load(w_scale_ptr + real_n * num_groups + g)
            acc += tl.dot(a, tl.trans(b)) * (xs[:, None] * ws[None, :])
    if ONE_GROUP:
        acc = acc * tl.load(x_scale_ptr + real_m * num_groups)[:, None] * \
            tl.load(w_scale_ptr + real_n * num_groups)[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    if WRITE_PARTIAL:
        partial = out_ptr + (pid_k * M + offs_m).to(tl.int64)[:, None] * N + offs_n[None, :]
        tl.store(partial, acc, mask=out_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + real_n).to(tl.float32)[None, :]
        out = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@dataclass(frozen=True, slots=True)
class GemmConfig:
    """The W8A8 GEMM's launch settings; `gemm_config` picks them, benchmarks may pass others."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int = GEMM_NUM_STAGES
    split_k: int = 1  # programs summing parts of K for one output tile, added by a reduce after


def gemm_config(m: int) -> GemmConfig:
    """From the row count: 64-row tiles (one warpgroup) up to 64 rows, else 128x128 over two. Not tuned
    yet: scripts/w8a8_sweep.py times the alternatives."""
    return GemmConfig(64, 128, 4) if m <= 64 else GemmConfig(128, 128, 8)


def w8a8_block_k(group: int, k: int) -> int | None:
    """The W8A8 GEMM's K tile for scale groups of `group` of k inputs: GEMM_BLOCK_K, narrowed to split the
    groups (a checkpoint's 64-wide blocks, say); None where no fp8 dot tiles them (groups of 16)."""
    if group >= k:
        return GEMM_BLOCK_K
    block_k = math.gcd(GEMM_BLOCK_K, group)
    return block_k if block_k >= MIN_FP8_DOT_K else None


def w8a8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, group: int,
                bias: torch.Tensor | None = None, config: GemmConfig | None = None) -> torch.Tensor:
    """x [M, K] @ dequantize(weight [N, K] e4m3, weight_scale [N, ceil(K / group)])^T (+ bias), x
    quantized per token and group of `group` inputs first; in x's dtype, float32 accumulation. config:
    gemm_config's unless given."""
    (m, k), n = x.shape, weight.shape[0]
    num_groups = triton.cdiv(k, group)
    if weight.shape[1] != k or weight.dtype != FP8_DTYPE or weight.stride(-1) != 1:
        raise ValueError(f"weight {tuple(weight.shape)} {weight.dtype} must be [N, {k}] {FP8_DTYPE} with a "
                         "contiguous last dim")
    if weight_scale.shape != (n, num_groups) or weight_scale.dtype != torch.float32:
        raise ValueError(f"weight_scale {tuple(weight_scale.shape)} {weight_scale.dtype} must be float32 "
                         f"({n}, {num_groups}) for groups of {group}")
    block_k = w8a8_block_k(group, k)
    if block_k is None:
        raise ValueError(f"scale groups of {group} inputs do not tile by {MIN_FP8_DOT_K}, the narrowest "
                         "fp8 dot")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    x_q, x_scale = quantize_rows(x, group)
    config = config or gemm_config(m)
    split = plan_split_k(k, block_k, config.split_k)
    write_partial = split.splits > 1
    target = split_k_workspace(split, m, n, x.device) if write_partial else out
    _w8a8_gemm_kernel[(triton.cdiv(m, config.block_m), triton.cdiv(n, config.block_n), split.splits)](
        x_q, x_scale, weight, weight_scale.contiguous(), bias if bias is not None else out, target,
        m, n, k, weight.stride(0), out.stride(0), num_groups, group, split.tiles_per_split,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=block_k, ONE_GROUP=num_groups == 1,
        HAS_BIAS=bias is not None, WRITE_PARTIAL=write_partial, NUM_STAGES=config.num_stages,
        num_warps=config.num_warps,
    )
    return reduce_split_k(target, bias, out) if write_partial else out
