"""The bf16 rows kernel (kernels/skinny_rows.py) under other launch settings, at a model's four decode
projections as the engine launches them (q/k/v and gate/up with the residual add and RMSNorm folded in,
o and down plain; programmatic dependent launches), for 2-16 rows: the engine's settings (rows_config),
the best found, and each beside one row through the engine's one-row GEMV and beside its floor (reading
the weight once at copy bandwidth). One CUDA GPU.

    python scripts/rows_sweep.py [--model configs/Qwen3-8B] [--rows 2 5 8 16]

Timed as decode runs them: calls captured in a CUDA graph and replayed, each reading another copy of the
weight so that it comes from HBM, not L2. The evidence rows_config is chosen by at a model's shapes."""

import argparse
import functools
import itertools
import json
from pathlib import Path

import torch
from fp8_gemm_bench import timed_us as graph_timed_us  # a script beside this one

from nanovllm.kernels.gemv_folds import skinny_norm_linear
from nanovllm.kernels.rows_settings import RowsConfig, rows_config
from nanovllm.kernels.skinny_gemm import ADD_RMS_NORM, PLAIN, skinny_linear
from nanovllm.kernels.skinny_rows import launch_rows

COPIES = 4  # weights cycled through: together beyond the 60 MB L2 at 8B's shapes
BANDWIDTH = 4.3e12  # bytes/s, the H200's device-to-device copy
SETTINGS = dict(block_n=(16, 32, 64), block_k=(128, 256), num_stages=(3, 4, 5), split_k=(1, 2, 4))


def shapes(config: dict) -> dict[str, tuple[int, int, bool]]:
    """(N, K, norm folded in) of each decode projection at one GPU."""
    hidden, inter, head_dim = config["hidden_size"], config["intermediate_size"], config.get("head_dim", 128)
    qkv = (config["num_attention_heads"] + 2 * config["num_key_value_heads"]) * head_dim
    attention = config["num_attention_heads"] * head_dim
    return {"qkv_proj": (qkv, hidden, True), "o_proj": (hidden, attention, False),
            "gate_up_proj": (2 * inter, hidden, True), "down_proj": (hidden, inter, False)}


def timed_us(fn, copies) -> float:
    """Microseconds a call of fn(weight), over the weight copies (fp8_gemm_bench's graph-replay timing)."""
    return graph_timed_us(fn, [(w,) for w in copies])


def candidates(norm: bool) -> list[RowsConfig]:
    """Every setting the sweep tries; the norm's launches do not split K (a split would cut its sums)."""
    found = []
    for block_n, block_k, stages, split in itertools.product(*SETTINGS.values()):
        if norm and split > 1:
            continue
        for warps in {max(1, block_n // 16), 2, 4}:
            found.append(RowsConfig(block_n, block_k, split, warps, stages, 0 if norm else 2))
    return found


def launcher(m: int, n: int, k: int, norm: bool):
    """(weight, setting) -> the rows kernel's call on m random rows, as the engine launches it."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    if not norm:
        return lambda w, setting: launch_rows(x, w, None, out, setting, True)
    summed, norm_w = torch.empty_like(x), torch.ones(k, device="cuda", dtype=torch.bfloat16)
    return lambda w, setting: launch_rows(x, w, None, out, setting, True, ADD_RMS_NORM, x, summed, norm_w,
                                          1e-6)


def one_row_gemv(k: int, norm: bool):
    """weight -> the engine's one-row GEMV call (the norm folded in where the rows kernel folds it)."""
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    if not norm:
        return lambda w: skinny_linear(x, w, None, pdl=True)
    norm_w = torch.ones(k, device="cuda", dtype=torch.bfloat16)
    return lambda w: skinny_norm_linear(x, norm_w, 1e-6, w, None, x, True)


def sweep(m: int, n: int, k: int, norm: bool, copies: list[torch.Tensor]) -> None:
    """Prints the engine's setting's time at m rows and the three best found."""
    call = launcher(m, n, k, norm)
    engine = rows_config(n, k, ADD_RMS_NORM if norm else PLAIN)
    engine_us = timed_us(functools.partial(call, setting=engine), copies)
    times = {}
    for setting in candidates(norm):
        try:
            times[setting] = timed_us(functools.partial(call, setting=setting), copies)
        except Exception as e:  # noqa: BLE001  a setting Triton cannot build (shared memory, say)
            times[setting] = float("inf")
            print(f"  skipped {setting}: {type(e).__name__}", flush=True)
    print(f"  {m:2d} rows: engine {engine_us:7.1f} us ({engine})", flush=True)
    for setting in sorted(times, key=times.get)[:3]:
        print(f"           {times[setting]:7.1f} us {setting}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="configs/Qwen3-8B", help="a folder with a config.json")
    parser.add_argument("--rows", type=int, nargs="+", default=[2, 5, 8, 16])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("it times CUDA kernels: run it on a CUDA GPU")
    if not all(1 <= m <= 16 for m in args.rows):
        parser.error("--rows: the rows kernel takes 1 to 16 rows")
    config = json.loads((Path(args.model) / "config.json").read_text())
    torch.manual_seed(0)
    for name, (n, k, norm) in shapes(config).items():
        copies = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(COPIES)]
        gemv = timed_us(one_row_gemv(k, norm), copies)
        print(f"{name} N={n} K={k}{' +norm' if norm else ''}: floor {n * k * 2 / BANDWIDTH * 1e6:.1f} us, "
              f"one-row GEMV {gemv:.1f}", flush=True)
        for m in args.rows:
            sweep(m, n, k, norm, copies)


if __name__ == "__main__":
    main()
