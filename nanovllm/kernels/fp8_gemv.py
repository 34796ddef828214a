"""fp8-weight GEMV for decode, 1 to MAX_ROWS rows: W8A16 (weight-only fp8), as vLLM's Machete/Marlin-style
decode paths are:

    out[m, n] = sum over K-groups g of (sum over k in g of x[m, k] * w_fp8[n, k]) * w_scale[n, g] (+ bias)

At a few rows a matmul is a read of its weight, so an e4m3 weight (one byte an element) halves the bytes of
a bf16 one, and with them the single-stream floor. The activations stay in the model's dtype (no
quantizing kernel, no activation rounding): each e4m3 weight tile is widened to x's dtype in registers,
which is exact (e4m3's 3 mantissa bits and its exponents fit bf16, fp16 and fp32), and its group's scale
multiplies the tile's float32 sums. The result is the dequantized weight's product with x, rounded once.

The weight layout is layers/fp8.py's (w_fp8 [N, K], w_scale [N, ceil(K / GROUP)]): block and per-channel
scales alike, a K tile never straddling two groups. Like kernels/skinny_rows.py each program streams its
[BLOCK_N, K] slab of the weight once in pipelined tiles, on tensor cores with the operands swapped (the
weight tile the dot's left operand, the rows of x padded to ROWS = 16 its right one; padding rows repeat
the last real row and are never stored). Under PDL (sm_90+) it waits for the kernel before and then lets
the next one launch. Sizes come from shapes alone, so calls are CUDA-graph capturable.
Launch settings from a sweep at Qwen3-8B's shapes and 16 rows, graph-timed on an H200 (2026-12-03,
docs/performance-notes.md "fp8 weights"): block_n 16-64, block_k 128-256, 4-8 warps, 3-5 stages. The
settings below took 20.8 / 16.6 / 44.2 / 43.7 us (q/k/v, o, gate/up, down; gate/up's best, block_k 128,
39.5) against 34.9 / 23.9 / 56.7 / 65.0 with the settings before (block_n 16, 4 stages): still slower than
bf16 cuBLAS (15.7 / 13.2 / 50.3 / 29.0). Qwen3-0.6B's shapes were not swept. At one row with one scale a
row kernels/fp8_skinny.py takes over."""

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from nanovllm.kernels.common import DEFAULT_NUM_SMS, sm_count

FP8_DTYPE = torch.float8_e4m3fn
# The rows of x the dot takes at once: tl.dot's smallest operand width; more rows take the W8A8 GEMM.
ROWS = 16
MAX_ROWS = ROWS
# Column-block widths, widest first: the widest that still gives MIN_PROGRAMS_PER_SM programs per SM. The
# sweep's winners were the widest blocks with at least ~0.7 programs an SM (q/k/v's N = 6144: 96 blocks
# of 64; o's and down's N = 4096: 128 of 32), not the two per SM the bf16 GEMV wants.
GEMV_WIDTHS = (64, 32, 16)
MIN_PROGRAMS_PER_SM = 0.7
# A K tile of 256 e4m3 weights x 64 rows is 16 KB; three stages (the sweep's best at every shape) keep
# ~32 KB of weight in flight a program.
GEMV_BLOCK_K = 256
GEMV_NUM_STAGES = 3
GEMV_NUM_WARPS = 4


@triton.jit(do_not_specialize=["M"])  # one build for every row count
def _fp8_gemv_kernel(
    x_ptr,  # [M, K], rows stride_xm apart, last dim contiguous, the model's dtype
    w_ptr,  # [N, K] e4m3, rows stride_wn apart
    w_scale_ptr,  # [N, num_groups] float32, contiguous
    bias_ptr,  # [N]
    out_ptr,  # [M, N], rows stride_om apart
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    num_groups,
    GROUP,  # inputs per scale group (a multiple of BLOCK_K, or >= K when ONE_GROUP)
    ROWS_: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ONE_GROUP: tl.constexpr,  # per-channel / per-tensor: the scales multiply the finished sums
    HAS_BIAS: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 x (exact products), else unused by 16-bit dots
    PDL: tl.constexpr = False,  # launched as a programmatic dependent of the kernel before
):
    pid_n = tl.program_id(0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_m = tl.arange(0, ROWS_)
    m_mask = offs_m < M
    real_n = tl.minimum(offs_n, N - 1).to(tl.int64)
    w_rows = w_ptr + real_n[:, None] * stride_wn  # [BLOCK_N, 1]
    x_rows = x_ptr + tl.minimum(offs_m, M - 1).to(tl.int64)[:, None] * stride_xm  # [ROWS, 1]
    offs = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, ROWS_], dtype=tl.float32)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    for k in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        k_mask = (k + offs < K)[None, :]
        w = tl.load(w_rows + (k + offs)[None, :], mask=k_mask, other=0.0).to(x_ptr.dtype.element_ty)
        x = tl.load(x_rows + (k + offs)[None, :], mask=k_mask, other=0.0)  # [ROWS, BLOCK_K]
        if ONE_GROUP:
            acc = tl.dot(w, tl.trans(x), acc, input_precision=DOT_PRECISION)
        else:
            ws = tl.load(w_scale_ptr + real_n * num_groups + k // GROUP)  # [BLOCK_N]
            acc += tl.dot(w, tl.trans(x), input_precision=DOT_PRECISION) * ws[:, None]
    if ONE_GROUP:
        acc = acc * tl.load(w_scale_ptr + real_n * num_groups)[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + real_n).to(tl.float32)[:, None]
    out = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=n_mask[:, None] & m_mask[None, :])


def gemv_block_n(n: int, num_sms: int = DEFAULT_NUM_SMS) -> int:
    """The widest column block that still gives MIN_PROGRAMS_PER_SM programs per SM."""
    return next((w for w in GEMV_WIDTHS if triton.cdiv(n, w) >= MIN_PROGRAMS_PER_SM * num_sms),
                GEMV_WIDTHS[-1])


def fp8_gemv_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, group: int,
                    bias: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS) @ dequantize(weight [N, K] e4m3, weight_scale [N, ceil(K / group)])^T
    (+ bias) in x's dtype, x unrounded (W8A16), float32 accumulation."""
    (m, k), n = x.shape, weight.shape[0]
    num_groups = triton.cdiv(k, group)
    if m > MAX_ROWS:
        raise ValueError(f"fp8_gemv_linear takes at most {MAX_ROWS} rows; got {m}: use w8a8_linear")
    if weight.shape[1] != k or weight.dtype != FP8_DTYPE or weight.stride(-1) != 1 or x.stride(-1) != 1:
        raise ValueError(f"weight {tuple(weight.shape)} {weight.dtype} must be [N, {k}] {FP8_DTYPE}, and x "
                         "and weight need a contiguous last dim")
    if weight_scale.shape != (n, num_groups) or weight_scale.dtype != torch.float32:
        raise ValueError(f"weight_scale {tuple(weight_scale.shape)} {weight_scale.dtype} must be float32 "
                         f"({n}, {num_groups}) for groups of {group}")
    one_group = num_groups == 1
    if not one_group and group % GEMV_BLOCK_K and GEMV_BLOCK_K % group:
        raise ValueError(f"scale groups of {group} inputs do not tile by {GEMV_BLOCK_K}")
    # A group narrower than the tile (128-column blocks): tiles of one group each.
    block_k = GEMV_BLOCK_K if one_group else min(GEMV_BLOCK_K, group)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    block_n = gemv_block_n(n, sm_count(x.device))
    _fp8_gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, weight_scale.contiguous(), bias if bias is not None else out, out,
        m, n, k, x.stride(0), weight.stride(0), out.stride(0), num_groups, group,
        ROWS_=ROWS, BLOCK_N=block_n, BLOCK_K=block_k, ONE_GROUP=one_group, HAS_BIAS=bias is not None,
        NUM_STAGES=GEMV_NUM_STAGES, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        PDL=pdl, num_warps=GEMV_NUM_WARPS, launch_pdl=pdl,
    )
    return out
