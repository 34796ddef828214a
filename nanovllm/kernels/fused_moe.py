"""Fused mixture-of-experts in Triton: tokens sorted by expert on the device, then one grouped GEMM
per projection.

A "slot" is one (token, k) pair of the routing, slot = token * top_k + k, for num_slots = T * top_k.

1. Align (`moe_align`): the slots are grouped by expert, each expert's group padded to a multiple of
   BLOCK_M rows, so that every BLOCK_M-row block of the sorted order belongs to one expert:

       sorted_ids  |e0 s s s - |e1 s - - - |e3 s s s s |e3 s - - - | - - ...     (- : pad = num_slots)
       expert_ids  |    0      |    1      |    3      |    3      | -1  ...     (one per block)

   Its kernels are in kernels/moe_align.py. No host sync.
2. Gate+up (`_grouped_gemm_kernel`, GATED): per block, x[token] @ w13[e]^T for the gate and the up
   rows of the same tile at once, silu(gate) * up -> intermediate [num_slots, I].
3. Down (same kernel): intermediate @ w2[e]^T times the slot's routing weight -> [num_slots, H], then
   the top_k slots of each token are summed (in a fixed order).

CUDA graphs: every buffer and grid is sized from (num_tokens, top_k, num_experts) alone. The number of
blocks is bounded by num_slots + min(E, num_slots) * (BLOCK_M - 1) padded rows (each expert that got a
slot pads fewer than BLOCK_M rows); blocks past the real ones get expert -1 and their programs return at
once. So nothing reads the routing on the host, and a decode step replays with any routing.

fp8 experts (e4m3 weights, float32 scales per row and K group, layers/fp8.py's layout) are read as e4m3,
half the weight bytes of bf16, in one of three ways:
- W8A16: each weight tile widened in registers, the activations unrounded;
- W8A16 in float16 (MoeConfig.f16): bf16 x and intermediate first as float16 rows times a power of two a
  row (kernels/float16_rows.py, exact), so that weight tiles widen to float16 (one conversion a pair on
  sm_90, where bf16 takes a permute and three), each row's sums times its scale at the end: the same
  products and float32 sums as W8A16's;
- W8A8 (MoeConfig.w8a8): x and the intermediate quantized per row and scale group first (kernels/fp8_gemm's
  quantize_rows, the rounding of layers/fp8.py's reference), both operands multiplied on fp8 tensor cores
  without widening anything, each K tile's sum added in float32 times its two scales (or, with one scale a
  row and MoeConfig.fast_accum, the dots chained in the tensor cores' accumulator, the scales applied to
  the finished sums)."""

import math

import torch
import triton
import triton.language as tl

from nanovllm.kernels.common import dot_precision, max_shared_memory
from nanovllm.kernels.float16_rows import float16_rows
from nanovllm.kernels.fp8_gemm import MIN_FP8_DOT_K, quantize_rows
from nanovllm.kernels.moe_align import MoeAlignment, max_num_blocks, moe_align  # noqa: F401 (re-exported)
from nanovllm.kernels.moe_launch import MoeConfig, fit_shared_memory, moe_config  # noqa: F401 (re-exported)


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,  # [rows, K]: x (row = token) for gate+up, the intermediate (row = slot) for down
    w_ptr,  # [E, N or 2N, K]
    out_ptr,  # [num_slots, N]
    sorted_ids_ptr,
    expert_ids_ptr,
    topk_weights_ptr,  # [num_slots] float32
    scale_ptr,  # fp8 weights: [E, N or 2N, num_groups] float32, w[e, n, k] * scale[e, n, k // GROUP]
    a_scale_ptr,  # A_FP8: [rows, num_groups] float32, a[row, k] * a_scale[row, k // GROUP]; A_F16: [rows, 1]
    num_slots,
    N,
    K,
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    stride_se,
    stride_sn,
    stride_asm,
    A_ROWS_PER_SLOT_DIV: tl.constexpr,  # a row = slot // this: top_k for x, 1 for the intermediate
    GATED: tl.constexpr,  # w rows [0, N) are the gate, [N, 2N) the up: out = silu(a @ gate^T) * (a @ up^T)
    MUL_ROUTED_WEIGHT: tl.constexpr,
    W_FP8: tl.constexpr,  # e4m3 weights with scales
    A_FP8: tl.constexpr,  # e4m3 activations with scales as well (W8A8); else they stay unrounded (W8A16)
    GROUP: tl.constexpr,  # the scales' group along K (a multiple of BLOCK_K), or 0: one scale a row
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SWAP_AB: tl.constexpr,  # products as w @ a^T: the weight tile on the tensor cores' 64-row side
    DOT_PRECISION: tl.constexpr,
    A_F16: tl.constexpr = False,  # W8A16, a as float16 times a power of two a row (kernels/float16_rows.py)
    FAST_ACCUM: tl.constexpr = False,  # A_FP8 with GROUP 0: MoeConfig.fast_accum
):
    pid_m = tl.program_id(0)  # fastest: neighbouring blocks of one expert share its weight tiles in L2
    pid_n = tl.program_id(1)
    expert = tl.load(expert_ids_ptr + pid_m)
    if expert < 0:  # a block past the real ones (the grid is sized for the worst routing)
        return
    slots = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = slots < num_slots
    rows = (slots // A_ROWS_PER_SLOT_DIV).to(tl.int64)
    a_rows = a_ptr + rows[:, None] * stride_am  # [BLOCK_M, 1]
    as_rows = a_scale_ptr + rows * stride_asm  # A_FP8: [BLOCK_M]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    # Columns past N read the last real weight row (never stored), so loads need only the K mask.
    w_rows = w_ptr + expert.to(tl.int64) * stride_we + tl.minimum(offs_n, N - 1)[:, None] * stride_wn
    s_rows = scale_ptr + expert.to(tl.int64) * stride_se + tl.minimum(offs_n, N - 1) * stride_sn  # [BLOCK_N]
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if GATED:
        acc_up = tl.zeros_like(acc)
    for k in range(0, K, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = tl.load(a_rows + offs_k[None, :], mask=valid[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_rows + offs_k[None, :], mask=k_mask[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
        acc = _accumulated(acc, a, w, s_rows, as_rows, valid, k, A_FP8, W_FP8, GROUP, SWAP_AB, DOT_PRECISION,
                           FAST_ACCUM)
        if GATED:
            w_up = tl.load(w_rows + N * stride_wn + offs_k[None, :], mask=k_mask[None, :], other=0.0)
            acc_up = _accumulated(acc_up, a, w_up, s_rows + N * stride_sn, as_rows, valid, k, A_FP8, W_FP8,
                                  GROUP, SWAP_AB, DOT_PRECISION, FAST_ACCUM)
    if SWAP_AB:  # back to [BLOCK_M, BLOCK_N], once a program
        acc = tl.trans(acc)
        if GATED:
            acc_up = tl.trans(acc_up)
    if A_F16 or (A_FP8 and GROUP == 0):  # a scale a row of a: it multiplies the finished sums
        row_scale = tl.load(as_rows, mask=valid, other=0.0)[:, None]
    else:
        row_scale = 1.0
    if W_FP8 and GROUP == 0:  # one scale a weight row: the finished sums too
        acc *= tl.load(s_rows)[None, :] * row_scale
        if GATED:
            acc_up *= tl.load(s_rows + N * stride_sn)[None, :] * row_scale
    elif A_F16:
        acc *= row_scale
        if GATED:
            acc_up *= row_scale
    if GATED:
        acc = acc * tl.sigmoid(acc) * acc_up
    if MUL_ROUTED_WEIGHT:
        acc *= tl.load(topk_weights_ptr + slots, mask=valid, other=0.0)[:, None]
    out = out_ptr + slots.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


@triton.jit
def _accumulated(acc, a, w, s_rows, as_rows, valid, k, A_FP8: tl.constexpr, W_FP8: tl.constexpr,
                 GROUP: tl.constexpr, SWAP_AB: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 FAST_ACCUM: tl.constexpr):
    """acc plus a [BLOCK_M, BLOCK_K] @ w [BLOCK_N, BLOCK_K]^T ([BLOCK_M, BLOCK_N]; transposed with
    SWAP_AB), the tile inside one scale group (BLOCK_K divides GROUP) where the scales vary along K."""
    if FAST_ACCUM:  # W8A8, one scale a row: the e4m3 dots chain in the tensor cores' accumulator
        if SWAP_AB:
            acc = tl.dot(w, tl.trans(a), acc)
        else:
            acc = tl.dot(a, tl.trans(w), acc)
    elif A_FP8:
        # A fresh e4m3 dot a tile, added in float32: sm_90's fp8 tensor cores keep ~14 bits while they
        # accumulate (kernels/fp8_gemm.py), so without FAST_ACCUM they never chain over the whole K.
        if SWAP_AB:
            part = tl.dot(w, tl.trans(a))
        else:
            part = tl.dot(a, tl.trans(w))
        if GROUP:
            a_scale = tl.load(as_rows + k // GROUP, mask=valid, other=0.0)
            w_scale = tl.load(s_rows + k // GROUP)
            if SWAP_AB:
                part *= w_scale[:, None] * a_scale[None, :]
            else:
                part *= a_scale[:, None] * w_scale[None, :]
        acc += part
    else:
        if W_FP8:  # widened: e4m3 is exact in any 16- or 32-bit float
            w = w.to(a.dtype)
        if W_FP8 and GROUP:
            # A fresh product a tile times its scales (one a weight row inside the tile's group), rather
            # than each weight times its scale before the dot: a multiply an output instead of a
            # multiply and two conversions a weight.
            w_scale = tl.load(s_rows + k // GROUP)
            if SWAP_AB:
                acc += tl.dot(w, tl.trans(a), input_precision=DOT_PRECISION) * w_scale[:, None]
            else:
                acc += tl.dot(a, tl.trans(w), input_precision=DOT_PRECISION) * w_scale[None, :]
        elif SWAP_AB:
            acc = tl.dot(w, tl.trans(a), acc, input_precision=DOT_PRECISION)
        else:
            acc = tl.dot(a, tl.trans(w), acc, input_precision=DOT_PRECISION)
    return acc


def _grouped_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, align: MoeAlignment,
                  topk_weights: torch.Tensor, top_k: int, gated: bool, config: MoeConfig,
                  scale: torch.Tensor | None = None, group: int = 0) -> None:
    n, k = out.shape[1], w.shape[2]
    grid = (align.expert_ids.numel(), triton.cdiv(n, config.block_n))
    if scale is not None and scale.shape[2] != triton.cdiv(k, group):
        raise ValueError(f"fp8 experts' scales {tuple(scale.shape)} do not have one column per {group} of "
                         f"the {k} inputs")
    group = 0 if group >= k else group  # 0: one scale a row (per channel, or a single group)
    if config.fast_accum and (group or not config.w8a8):
        raise ValueError("a fast_accum config chains W8A8 dots over the whole K: it takes fp8 experts with "
                         "one scale a row and w8a8")
    if group and group % config.block_k:
        raise ValueError(f"fp8 experts' scale groups of {group} inputs do not split into the GEMM's "
                         f"{config.block_k}-wide K tiles")
    scales = scale if scale is not None else topk_weights  # not read without fp8 weights
    a_scale = topk_weights  # not read unless W8A8 or float16 rows
    if config.w8a8:
        a, a_scale = quantize_rows(a, group or k)
    elif config.f16:
        a, a_scale = float16_rows(a)
    _grouped_gemm_kernel[grid](
        a, w, out, align.sorted_ids, align.expert_ids, topk_weights, scales, a_scale, out.shape[0], n, k,
        a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        scale.stride(0) if scale is not None else 0, scale.stride(1) if scale is not None else 0,
        a_scale.stride(0) if config.w8a8 or config.f16 else 0,
        A_ROWS_PER_SLOT_DIV=top_k, GATED=gated, MUL_ROUTED_WEIGHT=not gated, W_FP8=scale is not None,
        A_FP8=config.w8a8, A_F16=config.f16, GROUP=group, FAST_ACCUM=config.fast_accum,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, SWAP_AB=config.swap_ab,
        DOT_PRECISION=dot_precision(a.dtype), num_warps=config.num_warps, num_stages=config.num_stages,
    )


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, config: MoeConfig | None = None,
              w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
              scale_groups: tuple[int, int] = (0, 0), w8a8: bool = True) -> torch.Tensor:
    """sum_k topk_weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = topk_ids[t, k], as
    layers.fused_moe.torch_moe. x [T, H]; w13 [E, 2I, H] ([gate; up] rows); w2 [E, H, I];
    topk_weights [T, top_k] (float32 best); topk_ids [T, top_k]. float32 accumulation, x's dtype out.
    fp8 experts (layers/fp8.py's layout): e4m3 w13 and w2 with float32 scales [E, rows, ceil(K / group)],
    scale_groups the two groups along K (K itself: per channel), read as e4m3 and widened in registers
    (W8A16: x is not rounded), or, where the config says w8a8, multiplied by x and the intermediate
    quantized per row and group as layers/fp8.quantize_activations rounds them. w8a8=False keeps the
    activations unrounded whatever the default config would do (a static checkpoint's experts)."""
    num_tokens, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    top_k = topk_ids.shape[1]
    if w13.shape[2] != hidden or w2.shape != (num_experts, hidden, two_i // 2):
        raise ValueError(f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not fit x {tuple(x.shape)}: "
                         "expected [E, 2I, H] and [E, H, I]")
    if x.stride(-1) != 1 or not (w13.is_contiguous() and w2.is_contiguous()):
        raise ValueError("x needs a contiguous last dim and the expert weights must be contiguous")
    if (w13_scale is None) != (w13.element_size() != 1) or (w2_scale is None) != (w2.element_size() != 1):
        raise ValueError("fp8 expert weights need their scales (w13_scale, w2_scale), and only they take any")
    num_slots = num_tokens * top_k
    if num_slots == 0:
        return torch.zeros_like(x)
    # one config for both GEMMs: its K tiles split both scale groups (a group >= K is one a row)
    groups = [g for g, k in zip(scale_groups, (hidden, two_i // 2)) if 0 < g < k]
    if config is None:
        config = moe_config(num_slots, num_experts, x.dtype, fp8_weights=w13.element_size() == 1,
                            k_group=math.gcd(*groups) if groups else 0, w8a8=w8a8)
        a_bytes = 1 if config.w8a8 else 2 if config.f16 else x.element_size()
        config = fit_shared_memory(config, a_bytes, w13.element_size(), max_shared_memory(x.device))
    if (config.w8a8 or config.f16) and w13_scale is None:
        raise ValueError("a w8a8 or f16 config multiplies fp8 experts; these expert weights are not fp8")
    if config.f16 and (config.w8a8 or x.dtype != torch.bfloat16):
        raise ValueError("an f16 config takes bf16 activations (exact in float16 rows) and no w8a8")
    if config.w8a8 and config.block_k < MIN_FP8_DOT_K:
        raise ValueError(f"w8a8 needs K tiles of at least {MIN_FP8_DOT_K} inputs (the narrowest fp8 dot); "
                         f"the config's are {config.block_k}: the experts' scale groups are too narrow")
    align = moe_align(topk_ids, num_experts, config.block_m)
    weights = topk_weights.reshape(-1).float()
    intermediate = torch.empty(num_slots, two_i // 2, dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, intermediate, align, weights, top_k, gated=True, config=config, scale=w13_scale,
                  group=scale_groups[0])
    per_slot = torch.empty(num_slots, hidden, dtype=x.dtype, device=x.device)
    _grouped_gemm(intermediate, w2, per_slot, align, weights, 1, gated=False, config=config, scale=w2_scale,
                  group=scale_groups[1])
    return per_slot.view(num_tokens, top_k, hidden).sum(dim=1)
