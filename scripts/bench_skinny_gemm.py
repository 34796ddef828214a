"""skinny_linear vs torch.nn.functional.linear (cuBLAS) for one-token matmuls, bf16, on one CUDA GPU:

    python scripts/bench_skinny_gemm.py        # no arguments; about 30-60 s on an H200, mostly compiling

For the linear layers of Qwen3-0.6B and Qwen3-8B and M in 1..16 it prints microseconds per call, the weight
bytes read per second, and the largest difference from F.linear. Calls are timed the way decode runs
them: replayed from a CUDA graph, each call reading a different copy of the weight so that the weight
comes from HBM, not from the 50 MB L2 (a real model's layers never share one). After the table, while the
time budget lasts, a few alternative configs per shape are timed, to show where skinny_config could be
tuned. Writes everything as JSON to $OUT/bench_skinny_gemm.json when $OUT is set.
"""

import json
import os
import sys
import time
from dataclasses import astuple

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nanovllm.kernels.common import sm_count  # noqa: E402
from nanovllm.kernels.skinny_gemm import SkinnyConfig, skinny_config, skinny_linear  # noqa: E402

# (name, N, K): fused qkv, o_proj, fused gate_up and down_proj of each model.
SHAPES = [
    ("0.6B qkv", 4096, 1024),
    ("0.6B o", 1024, 2048),
    ("0.6B gate_up", 6144, 1024),
    ("0.6B down", 1024, 3072),
    ("8B qkv", 6144, 4096),
    ("8B o", 4096, 4096),
    ("8B gate_up", 24576, 4096),
    ("8B down", 4096, 12288),
]
M_VALUES = [1]
# Weight copies per shape add up to at least this many bytes, several times the L2, so each call in the
# graph finds its weight evicted.
ROTATION_BYTES = 256 << 20
GRAPH_REPLAYS = 20
# Stop starting config-sweep measurements after this many seconds (the whole run should stay under 60).
SWEEP_DEADLINE_S = 45.0
# M == 8 stands for 2..15 (one compiled variant); M == 16 would compile another.
SWEEP_M_VALUES = [1]
DTYPE = torch.bfloat16


def time_per_call_us(fn, x: torch.Tensor, weights: list[torch.Tensor]) -> float:
    """Mean microseconds per call of fn(x, w) over a CUDA graph that calls it once per weight copy."""
    out = [fn(x, w) for w in weights[:2]]  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = [fn(x, w) for w in weights]
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(GRAPH_REPLAYS):
        graph.replay()
    end.record()
    end.synchronize()
    del out
    return start.elapsed_time(end) * 1e3 / (GRAPH_REPLAYS * len(weights))


def sweep_candidates(default: SkinnyConfig) -> list[SkinnyConfig]:
    """Neighbours of the default config: one knob moved at a time."""
    d = default
    candidates = [
        SkinnyConfig(d.block_n, d.block_k, d.split_k, d.num_warps, d.num_stages + 2),
        SkinnyConfig(d.block_n, d.block_k, 2 * d.split_k, d.num_warps, d.num_stages),
        SkinnyConfig(max(4, d.block_n // 2), d.block_k, d.split_k, d.num_warps, d.num_stages),
        SkinnyConfig(d.block_n, 2 * d.block_k, d.split_k, d.num_warps, d.num_stages),
        SkinnyConfig(d.block_n, d.block_k, d.split_k, 8, d.num_stages),
    ]
    return [c for c in dict.fromkeys(candidates) if c != default]


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("bench_skinny_gemm needs a CUDA GPU")
    t0 = time.perf_counter()
    torch.manual_seed(0)
    num_sms = sm_count(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()}, {num_sms} SMs, torch {torch.__version__}")
    cases = {}
    for name, n, k in SHAPES:
        weight_bytes = n * k * torch.finfo(DTYPE).bits // 8
        num_copies = max(2, -(-ROTATION_BYTES // weight_bytes))
        # nn.Linear-like init: outputs of O(1) for unit-variance inputs.
        weights = [torch.randn(n, k, device="cuda", dtype=DTYPE) / k**0.5 for _ in range(num_copies)]
        cases[name] = (n, k, weight_bytes, weights)

    header = (
        f"{'shape':<13}{'N':>6}{'K':>6}{'M':>4}{'torch us':>10}{'skinny us':>11}{'torch GB/s':>12}"
        f"{'skinny GB/s':>13}{'speedup':>9}{'max|err|':>10}  config (BN, BK, split, warps, stages)"
    )
    print(header)
    rows = []
    for name, (n, k, weight_bytes, weights) in cases.items():
        for m in M_VALUES:
            x = torch.randn(m, k, device="cuda", dtype=DTYPE)
            config = skinny_config(n, k, 2, num_sms)
            err = (skinny_linear(x, weights[0]).float() - F.linear(x, weights[0]).float()).abs().max().item()
            torch_us = time_per_call_us(F.linear, x, weights)
            skinny_us = time_per_call_us(skinny_linear, x, weights)
            row = dict(
                shape=name,
                n=n,
                k=k,
                m=m,
                torch_us=torch_us,
                skinny_us=skinny_us,
                max_abs_err=err,
                torch_gbps=weight_bytes / torch_us / 1e3,
                skinny_gbps=weight_bytes / skinny_us / 1e3,
                config=list(astuple(config)),
            )
            rows.append(row)
            print(
                f"{name:<13}{n:>6}{k:>6}{m:>4}{torch_us:>10.2f}{skinny_us:>11.2f}{row['torch_gbps']:>12.0f}"
                f"{row['skinny_gbps']:>13.0f}{torch_us / skinny_us:>8.2f}x{err:>10.2e}  {row['config']}",
                flush=True,
            )
    print(f"table done at {time.perf_counter() - t0:.0f} s")

    # Alternative configs, until the deadline: shows which knob would help which shape.
    sweep = []
    for name, (n, k, weight_bytes, weights) in cases.items():
        for m in SWEEP_M_VALUES:
            if time.perf_counter() - t0 > SWEEP_DEADLINE_S:
                break
            x = torch.randn(m, k, device="cuda", dtype=DTYPE)
            default = skinny_config(n, k, 2, num_sms)
            results = {}
            for config in [default, *sweep_candidates(default)]:
                if time.perf_counter() - t0 > SWEEP_DEADLINE_S:
                    break
                try:
                    us = time_per_call_us(lambda x, w, c=config: skinny_linear(x, w, config=c), x, weights)
                except Exception as e:  # a candidate may not compile (shared memory): report and move on
                    print(f"  {name} M={m} {config}: {type(e).__name__}: {str(e)[:80]}")
                    continue
                results[config] = us
            if not results:
                continue
            best = min(results, key=results.get)
            sweep.append(
                dict(
                    shape=name,
                    m=m,
                    default_us=results.get(default),
                    best=list(astuple(best)),
                    best_us=results[best],
                    tried=len(results),
                )
            )
            print(
                f"sweep {name:<13} M={m:<3} default {results.get(default, float('nan')):6.2f} us, best "
                f"{results[best]:6.2f} us ({weight_bytes / results[best] / 1e3:5.0f} GB/s) of "
                f"{len(results)}: {best}",
                flush=True,
            )
    print(f"done in {time.perf_counter() - t0:.0f} s")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_skinny_gemm.json"), "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), table=rows, sweep=sweep), f, indent=1)


if __name__ == "__main__":
    main()
