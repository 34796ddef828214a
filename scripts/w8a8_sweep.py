"""The W8A8 GEMM (kernels/fp8_gemm.py) under other launch settings at a model's four projections, for the
row counts of batched decode (17-256 rows, where the fp8 methods leave the few-row kernels), beside what
the engine runs there today: torch._scaled_mm per channel (x quantized first, timed with and without that
kernel) or torch's block-scaled GEMM for 128 x 128 blocks. One CUDA GPU.

    python scripts/w8a8_sweep.py [--model configs/Qwen3-8B] [--rows 32 64 128 256] [--scales channel|block]
        [--shapes o_proj down_proj]      # only these projections (default: all four)

Timed as decode runs them: calls captured in a CUDA graph and replayed, each reading another copy of the
weight so that it comes from HBM, not L2; each line beside its floor, the larger of reading the weight once
at copy bandwidth and the FLOPs at the fp8 tensor cores' peak. At few rows a grid of 128 x 128 output
tiles leaves most SMs idle (Qwen3-8B's o_proj at 64 rows: 32 programs), which split-K and narrower
column blocks answer; the sweep measures which."""

import argparse
import functools
import itertools
import json
import os
from pathlib import Path

import torch
from fp8_gemm_bench import BANDWIDTH, FP8_FLOPS  # a script beside this one
from fp8_gemm_bench import timed_us as graph_timed_us
from rows_sweep import shapes

from nanovllm.kernels.fp8_gemm import GemmConfig, gemm_config, quantize_rows, w8a8_linear
from nanovllm.kernels.fp8_scaled_mm import block_scaled_mm_linear, padded_block_scales, scaled_mm_linear
from nanovllm.layers.fp8 import quantize_blocks, quantize_groups

COPIES = 4  # weights cycled through: together beyond the 60 MB L2 at 8B's shapes
SETTINGS = dict(block_m=(64, 128), block_n=(64, 128, 256), num_warps=(4, 8), num_stages=(3, 4, 5),
                split_k=(1, 2, 4))


def candidates(m: int) -> list[GemmConfig]:
    """Every setting tried at m rows: no row block past the next power of two of m."""
    return [GemmConfig(bm, bn, warps, stages, split)
            for bm, bn, warps, stages, split in itertools.product(*SETTINGS.values())
            if bm <= max(64, 1 << (m - 1).bit_length()) and not (bm == 128 and bn == 256 and stages > 3)]


def weights(n: int, k: int, scales: str) -> list[tuple]:
    """COPIES of (e4m3 weight, its scales in the engine's layout, the scale group, torch's block scales)."""
    found = []
    for _ in range(COPIES):
        w = torch.randn(n, k, device="cuda") / k**0.5
        if scales == "channel":
            q, s = quantize_groups(w, k)
            found.append((q, s, k, None))
        else:
            q, blocks = quantize_blocks(w, (128, 128))
            rows = blocks.repeat_interleave(128, 0)[:n].contiguous()  # layers/fp8.py's layout
            found.append((q, rows, 128, padded_block_scales(blocks)))
    return found


def engine_call(x: torch.Tensor, q, s, group, blocks) -> torch.Tensor:
    """What the engine runs at these rows today (layers/fp8_methods.py)."""
    if blocks is None:
        return scaled_mm_linear(x, q, s, group)
    return block_scaled_mm_linear(x, q, blocks)


def sweep(m: int, n: int, k: int, copies: list[tuple]) -> dict:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    timed = functools.partial(graph_timed_us, calls=copies)
    floor = max(n * k / BANDWIDTH, 2 * m * n * k / FP8_FLOPS) * 1e6
    quantize_us = graph_timed_us(lambda *_: quantize_rows(x, copies[0][2]), copies)
    engine_us = timed(lambda q, s, g, b: engine_call(x, q, s, g, b))
    default_us = timed(lambda q, s, g, b: w8a8_linear(x, q, s, g))
    times = {}
    for config in candidates(m):
        try:
            times[config] = timed(lambda q, s, g, b, c=config: w8a8_linear(x, q, s, g, None, c))
        except Exception as e:  # noqa: BLE001  a setting Triton cannot build (shared memory, say)
            print(f"    skipped {config}: {type(e).__name__}", flush=True)
    best = sorted(times, key=times.get)[:3]
    print(f"  {m:3d} rows: floor {floor:6.1f} us | engine {engine_us:6.1f} (quantize {quantize_us:4.1f}) | "
          f"Triton default {default_us:6.1f} ({gemm_config(m)})", flush=True)
    for config in best:
        print(f"             {times[config]:6.1f} us {config}", flush=True)
    return dict(rows=m, floor_us=floor, engine_us=engine_us, quantize_us=quantize_us, default_us=default_us,
                best=[(str(c), times[c]) for c in best])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="configs/Qwen3-8B", help="a folder with a config.json")
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 64, 128, 256])
    parser.add_argument("--scales", choices=("channel", "block"), default="channel",
                        help="one scale a weight row (quantization='fp8') or a 128 x 128 block (checkpoints)")
    parser.add_argument("--shapes", nargs="+", default=None,
                        choices=("qkv_proj", "o_proj", "gate_up_proj", "down_proj"), help="default: all four")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("it times CUDA kernels: run it on a CUDA GPU")
    if min(args.rows) < 1:
        parser.error("--rows: at least one row")
    config = json.loads((Path(args.model) / "config.json").read_text())
    torch.manual_seed(0)
    results = {}
    for name, (n, k, _) in shapes(config).items():
        if args.shapes and name not in args.shapes:
            continue
        print(f"{name} N={n} K={k} ({args.scales} scales)", flush=True)
        copies = weights(n, k, args.scales)
        results[name] = [sweep(m, n, k, copies) for m in args.rows]
        del copies
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "w8a8_sweep.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
