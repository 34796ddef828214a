"""One-token matmuls in Triton: out[1, N] = x[1, K] @ weight[N, K]^T (+ bias), a GEMV, as single-stream
decode runs every linear layer (cuBLAS reaches a third to two thirds of the memory bandwidth there).

A GEMV costs one read of the weight (N * K * 2 bytes in bf16); FLOPs are free. So each program owns
BLOCK_N output columns and streams its [BLOCK_N, K] slab of the weight in [BLOCK_N, BLOCK_K] tiles,
pipelined num_stages deep (cp.async into shared memory) so that enough bytes are in flight to cover HBM
latency; x is tiny and stays in L2. acc[BLOCK_N, BLOCK_K] += w * x elementwise in float32, summed
across lanes once at the end (no per-tile shuffles). This kernel takes one row; kernels/skinny_rows.py
takes 2-16 (on tensor cores). An e4m3 weight with one scale a row (kernels/fp8_skinny.py) is widened to
float32 in registers like a bf16 one, its scale multiplying the finished sums.

Split-K (grid axis 1) is used only when too few column blocks exist to keep the SMs busy. It stays
deterministic: float32 partials go to a [split_k, N] workspace that a second kernel sums in a fixed order
(kernels/split_k.py).
All sizes come from shapes (no host sync, no data-dependent allocation), so calls are CUDA-graph capturable.
Accumulation is float32; the result is in x's dtype.

A prologue can fold the small kernel before a linear layer into the GEMV's pass over x: RMSNorm (after
a residual add or not) or SiLU-mul; or the SiLU-mul after a gated MLP's gate/up projection folds in as
its epilogue (GATED), each program owning matching gate and up rows (kernels/gemv_folds.py has the entry
points). At one row a decode step ran 57 norm and 28 SiLU-mul kernels of ~1.5 us each, mostly launch gaps
(commit 105f5a8; docs/performance-notes.md, section "Decode GEMMs and GEMVs").

On sm_90+ the layers launch it as a programmatic dependent (pdl=True): it starts while the kernel before
it runs, loads its first weight tiles, waits for that kernel's output, then lets the next kernel start
(one-row decode 0.845 vs 0.898 ms/token; commit 12ea44a, 2026-12-01).
"""

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from nanovllm.kernels.common import sm_count
from nanovllm.kernels.skinny_launch import PDL_PRELOAD_TILES, SkinnyConfig, skinny_config
from nanovllm.kernels.split_k import plan_split_k, reduce_split_k, split_k_workspace

# What the kernel does to x before the GEMV (in its pass over x, which every program reads anyway), so
# that the small kernel before a linear layer (its RMSNorm, SiLU-mul) need not run (kernels/gemv_folds.py).
# (tl.constexpr: a kernel may read a global only when it is one.)
PLAIN, RMS_NORM, ADD_RMS_NORM, SILU_MUL = (tl.constexpr(i) for i in range(4))


@triton.jit
def _gemv_tile(partial, squares, w, k, k_end, x_ptr, residual_ptr, sum_ptr, norm_w_ptr, K, pid_n,
               PROLOGUE: tl.constexpr, BLOCK_K: tl.constexpr):
    """partial += w * x[k : k + BLOCK_K] (x through the prologue), and the norm's sum of squares."""
    offs_k = k + tl.arange(0, BLOCK_K)
    k_mask = offs_k < k_end
    x = tl.load(x_ptr + offs_k, mask=k_mask, other=0.0)
    if PROLOGUE == ADD_RMS_NORM:
        # Rounded to x's dtype as the residual stream is stored, before the norm reads it.
        x = (x.to(tl.float32) + tl.load(residual_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
             ).to(x_ptr.dtype.element_ty)
        if pid_n == 0:
            tl.store(sum_ptr + offs_k, x, mask=k_mask)
    xf = x.to(tl.float32)
    if PROLOGUE == RMS_NORM or PROLOGUE == ADD_RMS_NORM:
        # The norm's 1/rms scales the whole row: it is applied to the sums at the end.
        squares += xf * xf
        xf = xf * tl.load(norm_w_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
    if PROLOGUE == SILU_MUL:
        up = tl.load(x_ptr + K + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        xf = (xf / (1.0 + tl.exp(-xf)) * up).to(x_ptr.dtype.element_ty).to(tl.float32)
    return partial + w.to(tl.float32) * xf[None, :], squares


@triton.jit
def store_gated(acc, out_ptr, pid_n, half, BLOCK_N: tl.constexpr):
    """silu(gate) * up of sums interleaved [gate, up, gate, up, ...], each rounded to out's dtype first as
    the gate/up projection's output is stored, then as norm_act's SiLU-mul kernel computes it (also
    kernels/fp8_block_gemv.py's epilogue)."""
    gate, up = tl.split(tl.reshape(acc.to(out_ptr.dtype.element_ty).to(tl.float32), [BLOCK_N // 2, 2]))
    offs = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=offs < half)


@triton.jit
def weight_tile(w_rows, k, k_end, offs):
    """The [rows, len(offs)] weight tile at K offset k; columns from k_end on read as 0. Also skinny_rows'."""
    return tl.load(w_rows + (k + offs)[None, :], mask=(k + offs < k_end)[None, :], other=0.0)


@triton.jit
def _skinny_gemm_kernel(
    x_ptr,  # [K], contiguous ([2K] for SILU_MUL: gate then up)
    w_ptr,
    bias_ptr,
    out_ptr,  # [N] in x's dtype ([N / 2] GATED), or with WRITE_PARTIAL a [split_k, N] float32 workspace
    residual_ptr,  # ADD_RMS_NORM: [K], added to x
    sum_ptr,  # ADD_RMS_NORM: [K], receives x + residual (written by the first column block)
    norm_w_ptr,  # RMS_NORM, ADD_RMS_NORM: [K]
    eps,
    N,
    K,
    stride_wn,
    tiles_per_split,  # K tiles per split (a tile count, so the compiler sees k is a multiple of BLOCK_K)
    w_scale_ptr,  # SCALED: an fp8 weight's float32 [N] scales, one a row (weight[n, k] * w_scale[n])
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    WRITE_PARTIAL: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    PROLOGUE: tl.constexpr = PLAIN,
    PDL: tl.constexpr = False,  # launched as a programmatic dependent of the kernel before
    PRELOAD: tl.constexpr = 0,  # weight tiles (0-2) loaded first: before the wait under PDL
    SCALED: tl.constexpr = False,  # fp8 weights: their row's scale multiplies the finished sums
    GATED: tl.constexpr = False,  # weight [gate; up] ([N / 2] rows each): silu(gate) * up out, N / 2 wide
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    # Columns past N read the last real weight row instead of being masked (their sums are never
    # stored), so the weight load needs only the K mask, which is uniform along each row.
    real_n = tl.minimum(offs_n, N - 1).to(tl.int64)
    if GATED:  # BLOCK_N / 2 outputs j: gate row j and up row N / 2 + j side by side
        lane = tl.arange(0, BLOCK_N)
        gate_row = tl.minimum(pid_n * (BLOCK_N // 2) + lane // 2, N // 2 - 1)
        real_n = (gate_row + (lane % 2) * (N // 2)).to(tl.int64)
    w_rows = w_ptr + real_n[:, None] * stride_wn  # [BLOCK_N, 1]
    k_start = pid_k * tiles_per_split * BLOCK_K
    k_end = tl.minimum(k_start + tiles_per_split * BLOCK_K, K)
    partial = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    squares = tl.zeros([BLOCK_K], dtype=tl.float32)
    offs = tl.arange(0, BLOCK_K)
    k_loop = k_start
    # Under PDL the weight, which no kernel writes, has its first PRELOAD tiles requested while the
    # kernel before finishes; x and the rest of the weight come after the wait.
    if PRELOAD >= 1:
        w0 = weight_tile(w_rows, k_start, k_end, offs)
    if PRELOAD >= 2:
        w1 = weight_tile(w_rows, k_start + BLOCK_K, k_end, offs)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()  # the next kernel may launch now and preload its own weight
    if PRELOAD >= 1:
        partial, squares = _gemv_tile(partial, squares, w0, k_start, k_end, x_ptr, residual_ptr, sum_ptr,
                                      norm_w_ptr, K, pid_n, PROLOGUE, BLOCK_K)
    if PRELOAD >= 2:
        partial, squares = _gemv_tile(partial, squares, w1, k_start + BLOCK_K, k_end, x_ptr,
                                      residual_ptr, sum_ptr, norm_w_ptr, K, pid_n, PROLOGUE, BLOCK_K)
    k_loop += PRELOAD * BLOCK_K
    # num_stages on the loop itself: Triton pipelines loads that feed no tl.dot only then.
    for k in tl.range(k_loop, k_end, BLOCK_K, num_stages=NUM_STAGES):  # w: [BLOCK_N, BLOCK_K] tiles
        w = tl.load(w_rows + (k + offs)[None, :], mask=(k + offs < K)[None, :], other=0.0)
        partial, squares = _gemv_tile(partial, squares, w, k, K, x_ptr, residual_ptr, sum_ptr, norm_w_ptr,
                                      K, pid_n, PROLOGUE, BLOCK_K)
    acc = tl.sum(partial, axis=1)  # [BLOCK_N]
    if SCALED:
        acc = acc * tl.load(w_scale_ptr + real_n)
    if PROLOGUE == RMS_NORM or PROLOGUE == ADD_RMS_NORM:
        acc = acc * tl.rsqrt(tl.sum(squares, axis=0) / K + eps)
    if WRITE_PARTIAL:
        tl.store(out_ptr + pid_k * N + offs_n, acc, mask=n_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + real_n).to(tl.float32)
        if GATED:
            store_gated(acc, out_ptr, pid_n, N // 2, BLOCK_N)
        else:
            tl.store(out_ptr + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_mask)


def skinny_linear(
    x: torch.Tensor,  # [1, K], last dim contiguous (may be a column slice)
    weight: torch.Tensor,  # [N, K], last dim contiguous (an nn.Linear weight)
    bias: torch.Tensor | None = None,  # [N]
    out: torch.Tensor | None = None,  # [1, N] in x's dtype, last dim contiguous
    *,
    config: SkinnyConfig | None = None,  # default: skinny_config(...) from the shapes
    pdl: bool = False,  # a programmatic dependent launch (supports_pdl(x.device) must hold)
) -> torch.Tensor:
    """x @ weight.T (+ bias) in x's dtype with float32 accumulation, for one row (or none).
    No host sync and only shape-sized allocations, so it can run inside a captured CUDA graph."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} must be [M, K] and [N, K]")
    (m, k), n = x.shape, weight.shape[0]
    if m > 1:
        raise ValueError(f"skinny_linear handles at most one row; got {m}: use F.linear")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x dtype {x.dtype} is not float16, bfloat16 or float32")
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(
            f"weight {weight.dtype} and bias {None if bias is None else bias.dtype} must match x's {x.dtype}"
        )
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias has shape {tuple(bias.shape)}; expected ({n},)")
    if x.stride(-1) != 1 or weight.stride(-1) != 1 or (bias is not None and not bias.is_contiguous()):
        raise ValueError("x and weight need a contiguous last (K) dimension and bias must be contiguous")
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or out.dtype != x.dtype or out.stride(-1) != 1:
        raise ValueError(
            f"out must be ({m}, {n}) {x.dtype} with a contiguous last dim; got {tuple(out.shape)} {out.dtype}"
        )
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.copy_(bias.expand(m, n)) if bias is not None else out.zero_()
    if config is None:
        config = skinny_config(n, k, x.element_size(), sm_count(x.device))

    return launch_gemv(x, weight, bias, out, config, pdl)


def launch_gemv(x, weight, bias, out, config: SkinnyConfig, pdl: bool, prologue: tl.constexpr = PLAIN,
                residual=None, summed=None, norm_weight=None, eps: float = 0.0, weight_scale=None,
                gated: bool = False) -> torch.Tensor:
    """The kernel's launch, arguments unchecked (the entry points here, in kernels/gemv_folds.py and in
    kernels/fp8_skinny.py check them). weight_scale: an e4m3 weight's float32 scales, one a row ([N] or
    [N, 1], contiguous). gated: out = silu(gate) * up, [1, N / 2] (no split-K: config.split_k must be 1).
    Under PDL (programmatic dependent launch, sm_90+) the kernel may start while the kernel before it
    runs: it loads its first weight tiles, waits for that kernel's results, then lets the next launch.
    Everything it reads before the wait (the weight) no kernel writes, so this is race-free; the
    split-K reduce after it is a plain launch."""
    n, k = weight.shape
    split = plan_split_k(k, config.block_k, config.split_k)
    write_partial = split.splits > 1
    target = split_k_workspace(split, 1, n, x.device) if write_partial else out
    if gated and write_partial:
        raise ValueError("the SiLU-mul epilogue needs the whole sums: a gated launch cannot split K")
    _skinny_gemm_kernel[(triton.cdiv(n, config.block_n), split.splits)](
        x,
        weight,
        bias if bias is not None else x,  # never read without HAS_BIAS
        target,
        residual if residual is not None else x,  # the prologue's tensors: never read unless it uses them
        summed if summed is not None else x,
        norm_weight if norm_weight is not None else x,
        eps,
        n,
        k,
        weight.stride(0),
        split.tiles_per_split,
        weight_scale if weight_scale is not None else x,  # never read unless SCALED
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        HAS_BIAS=bias is not None,
        WRITE_PARTIAL=write_partial,
        NUM_STAGES=config.num_stages,
        PROLOGUE=prologue.value,
        num_warps=config.num_warps,
        PDL=pdl,
        PRELOAD=min(PDL_PRELOAD_TILES * pdl if config.preload is None else config.preload,
                    split.tiles_per_split),
        launch_pdl=pdl,
        SCALED=weight_scale is not None,
        GATED=gated,
    )
    return reduce_split_k(target, bias, out) if write_partial else out


def check_rows(x: torch.Tensor, width: int, weight: torch.Tensor, bias: torch.Tensor | None, max_rows: int,
               what: str = "x") -> None:
    """The few-row kernels' (gemv_rows, skinny_rows) inputs: 1 to max_rows rows of `width`, and a weight
    (and bias) of x's dtype, each with a contiguous last dim."""
    if x.dim() != 2 or not 1 <= x.shape[0] <= max_rows or x.shape[1] != width or x.stride(-1) != 1:
        raise ValueError(f"{what} must be 1 to {max_rows} rows of {width} with a contiguous last dim; "
                         f"got {tuple(x.shape)}")
    if weight.dtype != x.dtype or weight.stride(-1) != 1 or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(f"weight {weight.dtype} (and bias) must be x's dtype {x.dtype}, with a contiguous "
                         "last dim")


def check_one_row(x: torch.Tensor, width: int, what: str) -> None:
    if x.dim() != 2 or x.shape[0] != 1 or x.shape[1] != width or not x.is_contiguous():
        raise ValueError(f"{what} must be one contiguous row of {width}; got {tuple(x.shape)}")
