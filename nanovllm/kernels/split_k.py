"""Deterministic split-K for the few-token matmuls (kernels/skinny_gemm.py, kernels/skinny_rows.py): how K
is cut into whole tiles, the float32 workspace the splits write, and two ways of summing it in a fixed
order (the same inputs give the same bits on every run, which float atomics would not): a second kernel,
or the last split of each column block to finish (last_split_sums), which adds no launch. That one needs
the layer's arrival counters: int32 zeros, one an output column (a column block counts at its first),
which each block's last split resets, so that a layer's calls, one after another, share them. The reduce
launches it saves cost up to 5-6% of a decode step of Qwen3-8B with fp8 weights at 4-16 rows (skipped,
wrong sums: an H200, 2026-12-05); layers hold counters only with layers/linear_methods.SPLIT_COUNTERS."""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# The reduce: one program sums this many columns of one row.
REDUCE_BLOCK_N = 256


@dataclass(frozen=True, slots=True)
class SplitK:
    splits: int  # programs per column block
    tiles_per_split: int  # K tiles each sums (a count, so kernels see k as a multiple of their tile)


def plan_split_k(k: int, block_k: int, wanted: int) -> SplitK:
    """Up to `wanted` splits of whole block_k tiles; splits that would get no tile are dropped, so only
    the last sees the ragged end of K."""
    num_tiles = triton.cdiv(k, block_k)
    tiles_per_split = triton.cdiv(num_tiles, max(1, min(wanted, num_tiles)))
    return SplitK(triton.cdiv(num_tiles, tiles_per_split), tiles_per_split)


def split_k_workspace(split: SplitK, m: int, n: int, device: torch.device) -> torch.Tensor:
    """The [splits, m, n] float32 partials (shape-sized: capturable in a CUDA graph)."""
    return torch.empty((split.splits, m, n), dtype=torch.float32, device=device)


@triton.jit
def last_split_sums(acc, partial_ptr, split_stride, counter_ptr, offs, mask):
    """(whether this program is its column block's last split to finish, and then the sum of the block's
    partials in split order, else acc), after this program stored its own partial: the splits' partials lie
    split_stride apart from partial_ptr, offs indexing one split's; counter_ptr is the block's counter.
    Each split's partial is stored before it counts (a barrier, then a release at GPU scope), and the last
    reads them from L2 after its acquire."""
    tl.debug_barrier()  # every thread's partial stored before the count
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    splits = tl.num_programs(1)
    last = arrived == splits - 1
    if last:
        acc = tl.zeros_like(acc)
        for split in range(0, splits):  # the reduce kernel's order, so the same bits
            acc += tl.load(partial_ptr + split * split_stride + offs, mask=mask, other=0.0,
                           cache_modifier=".cg")
        tl.store(counter_ptr, 0)  # ready for the layer's next call
    return last, acc


@triton.jit
def split_k_reduce_kernel(
    partial_ptr,  # [SPLIT_K, M, N] float32
    bias_ptr,
    out_ptr,  # [M, N], rows stride_om apart
    M,
    N,
    stride_om,
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for split in tl.static_range(SPLIT_K):
        acc += tl.load(partial_ptr + (split * M + row) * N + offs_n, mask=n_mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_mask)


def reduce_split_k(partials: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """out[m, n] = sum over splits of partials[:, m, n] (+ bias[n]), in out's dtype."""
    splits, m, n = partials.shape
    split_k_reduce_kernel[(triton.cdiv(n, REDUCE_BLOCK_N), m)](
        partials, bias if bias is not None else partials, out, m, n, out.stride(0),
        SPLIT_K=splits, HAS_BIAS=bias is not None, BLOCK_N=REDUCE_BLOCK_N)
    return out
