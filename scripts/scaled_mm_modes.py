"""torch._scaled_mm's modes at Qwen3-8B's projection shapes, one CUDA GPU: microseconds a call of the W8A8
product alone (activations quantized already, as the norm or SiLU-mul before it writes them) with row-wise
scales (a scale a token and a weight row: cuBLASLt's outer-vector-scaled kernels with torch 2.11), row-wise
with fast accumulation (the tensor cores' own accumulator for the whole K loop, not promoted to float32
every few MMAs), tensor-wise scales (one scalar each: cuBLASLt's own heuristics) with and without fast
accumulation, and bf16 F.linear; each beside its floor. Then, for each mode, its error against the float32
product of the same e4m3 operands (largest absolute error over the largest magnitude, and the mean), which
is what fast accumulation costs.

    python scripts/scaled_mm_modes.py [--rows 17 32 64 128 256 1024 4096]

Timed as fp8_gemm_bench.py times: the calls captured in a CUDA graph and replayed, each call reading
one of four copies of the weight so that it comes from HBM."""

import argparse
import functools
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fp8_gemm_bench import (  # noqa: E402  (this folder's script: its shapes, peaks and timing)
    BANDWIDTH,
    BF16_FLOPS,
    COPIES,
    FP8_FLOPS,
    SHAPES,
    timed_us,
)

from nanovllm.kernels.fp8_gemm import quantize_rows  # noqa: E402
from nanovllm.layers.fp8 import quantize_groups  # noqa: E402

MODES = ("bf16", "rowwise", "rowwise fast", "tensor", "tensor fast")


def product(mode: str, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, w16: torch.Tensor,
            w_scale: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """One call of `mode`: x [M, K] bf16; q [M, K] e4m3 with scale [M, 1]; w16 [N, K] bf16 and its e4m3
    form, w_scale = (weight [N, K], scale [N, 1])."""
    if mode == "bf16":
        return F.linear(x, w16)
    wq, ws = w_scale
    fast = mode.endswith("fast")
    if mode.startswith("rowwise"):
        return torch._scaled_mm(q, wq.t(), scale_a=scale, scale_b=ws.view(1, -1), out_dtype=torch.bfloat16,
                                use_fast_accum=fast)
    one = unit(x.device)
    return torch._scaled_mm(q, wq.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                            use_fast_accum=fast)


@functools.cache
def unit(device: torch.device) -> torch.Tensor:
    """The tensor-wise modes' scale, made once (not a fill kernel inside every timed call)."""
    return torch.ones((), device=device, dtype=torch.float32)


def errors(mode: str, x, q, scale, w16, w_scale) -> str:
    """max |out - ref| / max |ref| and mean |out - ref| / mean |ref|, ref the float32 product of the
    operands the mode reads (scales applied as it applies them)."""
    wq, ws = w_scale
    if mode == "bf16":
        ref = x.float() @ w16.float().t()
    elif mode.startswith("rowwise"):
        ref = (q.float() * scale) @ (wq.float() * ws).t()
    else:
        ref = q.float() @ wq.float().t()
    out = product(mode, x, q, scale, w16, w_scale).float()
    d = (out - ref).abs()
    return f"{(d.max() / ref.abs().max()).item():.1e}/{(d.mean() / ref.abs().mean()).item():.1e}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[17, 32, 64, 128, 256, 1024, 4096])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("it times CUDA kernels: run it on a CUDA GPU")
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{'shape':13s} {'rows':>5s} " + " ".join(f"{c:>12s}" for c in MODES)
          + f" {'floor':>7s} {'fp8 floor':>9s}  (us)")
    for name, (n, k) in SHAPES.items():
        w16 = [torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) / k**0.5
               for _ in range(COPIES)]
        wq = [quantize_groups(w, k) for w in w16]
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16)
            q, scale = quantize_rows(x, k)
            calls = [(x, q, scale, w, ws) for w, ws in zip(w16, wq)]
            times = {mode: timed_us(lambda *a, mode=mode: product(mode, *a), calls) for mode in MODES}
            flops = 2 * m * n * k
            floor = max(n * k * 2 / BANDWIDTH, flops / BF16_FLOPS) * 1e6
            fp8_floor = max(n * k / BANDWIDTH, flops / FP8_FLOPS) * 1e6
            print(f"{name:13s} {m:5d} " + " ".join(f"{times[c]:12.1f}" for c in MODES)
                  + f" {floor:7.1f} {fp8_floor:9.1f}", flush=True)
        print(f"{name:13s} error (max/mean, {args.rows[-1]} rows): "
              + ", ".join(f"{mode} {errors(mode, x, q, scale, w16[0], wq[0])}" for mode in MODES), flush=True)


if __name__ == "__main__":
    main()
