"""fp8 linear kernels against bf16 on Qwen3-8B's projection shapes, one CUDA GPU: for each shape and row
count, microseconds of bf16 F.linear (cuBLAS), at one row bf16's GEMV (kernels/skinny_gemm.py), at 1-4
rows its few-row GEMV (kernels/gemv_rows.py) and at 1-128 its rows kernel (kernels/skinny_rows.py); of
the one-row fp8 GEMV, the few-row CUDA-core GEMV (1-4 rows) and the 1-16 row tensor-core kernel
(kernels/fp8_skinny.py), the same kernel at 1-128 rows over e4m3 rows (W8A8, their quantize included: the
per-channel method's rows bucket, layers/fp8_methods.W8A8_ROWS_MAX), over 128x128 block scales the
one-row GEMV (a scale a run of a tile) and the 1-16 row kernel (each tile's product times its block's
scale), as the engine runs them, the W8A16 tensor-core GEMV (up to 16 rows), the Triton W8A8 GEMM with
per-channel and 128x128 block scales, torch._scaled_mm with row-wise scales, and torch's block-scaled
GEMM (F.scaled_mm, 1x128 activation and 128x128 weight scales: what block-scaled checkpoints run from 17
rows, with a per-shape check of its error against the dequantized product; n/a where this torch lacks
it); each beside its floor, the larger of reading the weight once at copy bandwidth and the FLOPs at the
tensor cores' peak.

    python scripts/fp8_gemm_bench.py [--rows 1 16 64 256 1024 4096]

Timed as decode runs them: the calls captured in a CUDA graph and replayed (no host launch cost), each
call reading a different copy of the weight so that it comes from HBM, not L2. The evidence the kernel
plan's fp8 buckets (layers/fp8.py) are chosen by."""

import argparse

import torch
import torch.nn.functional as F

from nanovllm.kernels.fp8_gemm import quantize_rows, w8a8_linear
from nanovllm.kernels.fp8_gemv import MAX_ROWS, fp8_gemv_linear
from nanovllm.kernels.fp8_scaled_mm import block_scaled_mm_linear, padded_block_scales, scaled_mm_linear
from nanovllm.kernels.fp8_skinny import (
    fp8_block_gemv_linear,
    fp8_gemv_rows_linear,
    fp8_rows_block_linear,
    fp8_rows_linear,
    fp8_skinny_linear,
)
from nanovllm.kernels.gemv_rows import MAX_ROWS as GEMV_ROWS
from nanovllm.kernels.gemv_rows import gemv_rows_linear
from nanovllm.kernels.rows_settings import MAX_ROWS as ROWS_KERNEL_ROWS
from nanovllm.kernels.skinny_gemm import skinny_linear
from nanovllm.kernels.skinny_rows import rows_linear
from nanovllm.layers.fp8 import dequantize, quantize_blocks, quantize_groups
from nanovllm.layers.fp8_methods import fp8_rows_e4m3

SHAPES = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (24576, 4096),
          "down_proj": (4096, 12288)}  # (N, K) of Qwen3-8B at one GPU
COPIES = 4  # weights cycled through: together far beyond the 60 MB L2
REPEATS = 20
BANDWIDTH = 4.3e12  # bytes/s, the H200's device-to-device copy
BF16_FLOPS, FP8_FLOPS = 790e12, 1580e12  # dense tensor-core peaks, H200
NAN = float("nan")  # a kernel that does not take this row count


def timed_us(fn, calls) -> float:
    """Microseconds a call, replaying a CUDA graph of REPEATS rounds of the calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:  # warm-up: compiles and autotunes outside the capture
            fn(*call)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPEATS):
            for call in calls:
                fn(*call)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (REPEATS * len(calls))


def blockwise_error(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> str:
    """The block-scaled GEMM's largest error against the product of its dequantized operands, relative
    to that product's largest magnitude; or why it does not run here."""
    try:
        out = block_scaled_mm_linear(x, q, scale).float()
    except (AttributeError, RuntimeError) as e:  # an older torch, or no cuBLASLt support
        return f"n/a ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
    xq, xs = quantize_rows(x, 128)
    w = q.float() * scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
    ref = dequantize(xq, xs, 128) @ w.t()
    return f"{((out - ref).abs().max() / ref.abs().max()).item():.1e} relative error"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256, 1024, 4096])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("it times CUDA kernels: run it on a CUDA GPU")
    gen = torch.Generator(device="cuda").manual_seed(0)
    columns = ("bf16", "bf16 gemv", "bf16 gemvr", "bf16 rows", "floor", "fp8 gemv1", "blk gemv1",
               "gemv rows", "fp8 rows", "e4m3 rows", "blk rows", "gemv16", "w8a8 ch", "w8a8 blk", "scaled_mm",
               "mm blk", "fp8 floor")
    print(f"{'shape':13s} {'rows':>5s} " + " ".join(f"{c:>9s}" for c in columns) + "  (us)")
    for name, (n, k) in SHAPES.items():
        w16 = [torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) / k**0.5
               for _ in range(COPIES)]
        per_channel = [quantize_groups(w, k) for w in w16]
        block = [quantize_groups(w, 128) for w in w16]  # the block layout's [N, K / 128] scales
        blocks = [quantize_blocks(w, (128, 128)) for w in w16]  # one scale a 128 x 128 tile
        padded = [(q, padded_block_scales(s)) for q, s in blocks]  # as the linear method keeps them
        x = torch.randn(max(args.rows), k, device="cuda", generator=gen, dtype=torch.bfloat16)
        checked = blockwise_error(x, *blocks[0])
        print(f"{name}: torch's block-scaled GEMM: {checked}", flush=True)
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16)
            flops = 2 * m * n * k
            channel = [(x, q, s) for q, s in per_channel]
            times = {
                "bf16": timed_us(F.linear, [(x, w) for w in w16]),
                "bf16 gemv": timed_us(skinny_linear, [(x, w) for w in w16]) if m == 1 else NAN,
                "bf16 gemvr": (timed_us(gemv_rows_linear, [(x, w) for w in w16]) if m <= GEMV_ROWS
                               else NAN),
                "bf16 rows": (timed_us(rows_linear, [(x, w) for w in w16]) if m <= ROWS_KERNEL_ROWS
                              else NAN),
                "floor": max(n * k * 2 / BANDWIDTH, flops / BF16_FLOPS) * 1e6,
                "fp8 gemv1": (timed_us(lambda x, q, s, k=k: fp8_skinny_linear(x, q, s, k), channel)
                              if m == 1 else NAN),
                "blk gemv1": (timed_us(lambda x, q, s: fp8_block_gemv_linear(x, q, s, (128, 128)),
                                       [(x, q, s) for q, s in padded])
                               if m == 1 else NAN),
                "gemv rows": (timed_us(lambda x, q, s, k=k: fp8_gemv_rows_linear(x, q, s, k), channel)
                              if m <= GEMV_ROWS else NAN),
                "fp8 rows": (timed_us(lambda x, q, s, k=k: fp8_rows_linear(x, q, s, k), channel)
                             if m <= MAX_ROWS else NAN),
                "e4m3 rows": (timed_us(lambda x, q, s, k=k: fp8_rows_e4m3(x, q, s, k, None), channel)
                              if m <= ROWS_KERNEL_ROWS else NAN),
                "blk rows": (timed_us(lambda x, q, s: fp8_rows_block_linear(x, q, s, (128, 128)),
                                       [(x, q, s) for q, s in padded])
                             if m <= MAX_ROWS else NAN),
                "gemv16": (timed_us(lambda x, q, s, k=k: fp8_gemv_linear(x, q, s, k, None), channel)
                           if m <= MAX_ROWS else NAN),
                "w8a8 ch": timed_us(lambda x, q, s, k=k: w8a8_linear(x, q, s, k, None), channel),
                "w8a8 blk": timed_us(lambda x, q, s: w8a8_linear(x, q, s, 128, None),
                                     [(x, q, s) for q, s in block]),
                "scaled_mm": timed_us(lambda x, q, s, k=k: scaled_mm_linear(x, q, s, k, None), channel),
                "mm blk": (NAN if checked.startswith("n/a")
                           else timed_us(block_scaled_mm_linear, [(x, q, s) for q, s in blocks])),
                "fp8 floor": max(n * k / BANDWIDTH, flops / FP8_FLOPS) * 1e6,
            }
            print(f"{name:13s} {m:5d} " + " ".join(f"{times[c]:9.1f}" for c in columns), flush=True)


if __name__ == "__main__":
    main()
