"""fp8 linear kernels against bf16 on Qwen3-8B's projection shapes, one CUDA GPU: for each shape and row
count, microseconds of bf16 F.linear (cuBLAS), the W8A16 GEMV (up to 16 rows), the Triton W8A8 GEMM with
per-channel and 128x128 block scales, and torch._scaled_mm with row-wise scales; each beside its floor,
the larger of reading the weight once at copy bandwidth and the FLOPs at the tensor cores' peak.

    python scripts/fp8_gemm_bench.py [--rows 1 16 64 256 1024 4096]

Timed with CUDA events over repeated calls, each call reading a different copy of the weight so that it
comes from HBM, not L2. The evidence the kernel plan's fp8 buckets (layers/fp8.py) are chosen by."""

import argparse

import torch
import torch.nn.functional as F

from nanovllm.kernels.fp8_gemm import scaled_mm_linear, w8a8_linear
from nanovllm.kernels.fp8_gemv import MAX_ROWS, fp8_gemv_linear
from nanovllm.layers.fp8 import quantize_groups

SHAPES = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (24576, 4096),
          "down_proj": (4096, 12288)}  # (N, K) of Qwen3-8B at one GPU
COPIES = 4  # weights cycled through: together far beyond the 60 MB L2
REPEATS = 20
BANDWIDTH = 4.3e12  # bytes/s, the H200's device-to-device copy
BF16_FLOPS, FP8_FLOPS = 790e12, 1580e12  # dense tensor-core peaks, H200


def timed_us(fn, calls) -> float:
    for call in calls:
        fn(*call)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPEATS):
        for call in calls:
            fn(*call)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (REPEATS * len(calls))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256, 1024, 4096])
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{'shape':13s} {'rows':>5s} {'bf16':>8s} {'floor':>7s} {'gemv':>8s} {'w8a8 ch':>8s} "
          f"{'w8a8 blk':>8s} {'scaled_mm':>9s} {'fp8 floor':>9s}  (us)")
    for name, (n, k) in SHAPES.items():
        w16 = [torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) / k**0.5
               for _ in range(COPIES)]
        per_channel = [quantize_groups(w, k) for w in w16]
        block = [quantize_groups(w, 128) for w in w16]  # the block layout's [N, K / 128] scales
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16)
            flops = 2 * m * n * k
            floor16 = max(n * k * 2 / BANDWIDTH, flops / BF16_FLOPS) * 1e6
            floor8 = max(n * k / BANDWIDTH, flops / FP8_FLOPS) * 1e6
            bf16 = timed_us(F.linear, [(x, w) for w in w16])
            channel_calls = [(x, q, s) for q, s in per_channel]
            gemv = (timed_us(lambda x, q, s, k=k: fp8_gemv_linear(x, q, s, k, None), channel_calls)
                    if m <= MAX_ROWS else float("nan"))
            channel = timed_us(lambda x, q, s, k=k: w8a8_linear(x, q, s, k, None), channel_calls)
            blocked = timed_us(lambda x, q, s: w8a8_linear(x, q, s, 128, None), [(x, q, s) for q, s in block])
            scaled = timed_us(lambda x, q, s, k=k: scaled_mm_linear(x, q, s, k, None), channel_calls)
            print(f"{name:13s} {m:5d} {bf16:8.1f} {floor16:7.1f} {gemv:8.1f} {channel:8.1f} {blocked:8.1f} "
                  f"{scaled:9.1f} {floor8:9.1f}", flush=True)


if __name__ == "__main__":
    main()
