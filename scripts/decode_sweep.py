"""The split-KV decode kernel (nanovllm.kernels.decode_attention) under other launch settings: tile
length, warps, pipeline stages and programs per SM, for a bf16 and an fp8 cache, at the decode shapes
of the benchmarks (Qwen3-0.6B: 16 query heads, 8 KV heads, head_dim 128, 256-token blocks; --heads for
other models' GQA groups). Prints
each case's engine choice (nanovllm.kernels.decode_launch) and the best settings found, with their
time and KV-read bandwidth as a fraction of a plain device copy's, so that choice is made by
measurement. Each case is timed as the engine runs it: contexts spread over [C/2, C], longest first,
calls replayed from a CUDA graph. GPU only.

    python scripts/decode_sweep.py [--quick]
    python scripts/decode_sweep.py --heads 32 4      # Qwen3-30B-A3B's heads (Qwen3-8B: --heads 32 8)"""

import argparse
import functools
import itertools
import json
import math

import torch
import triton.testing

from nanovllm.kernels import decode_attention as dk
from nanovllm.kernels import decode_launch as dl
from nanovllm.kernels.common import sm_count

HEAD_DIM, BLOCK_SIZE = 128, 256
CASES = [(1, 1024), (1, 4096), (64, 2048), (256, 512), (256, 1024), (512, 1024)]  # (batch, context)
# Five stages: the first count at which Triton 3.6 keeps two K/V buffers (the block-table load the tile
# addresses depend on takes a stage of its own; sm_90 SASS), so a tile's load overlaps the previous
# tile's math; with 2-4 only other programs on the SM hide it.
# One and two warps a program (fewer of a tile's row reductions cross warps through shared memory, a
# sixth of the fp8 kernel's stalls at 256 rows under ncu) lost at 16-64 rows, won up to 6% alone at
# 96-256 rows of an fp8 cache and nothing in bench.py; two warps for the fp8 large-batch launch, 4-6%
# faster a call at 256-512 rows here, were even in bench.py (docs/performance-notes.md, "fp8 KV cache",
# 2026-12-02).
SETTINGS = dict(BLOCK_N=(32, 64, 128), NUM_WARPS=(1, 2, 4, 8), NUM_STAGES=(2, 3, 4, 5),
                PROGRAMS_PER_SM=(4, 16))
QUICK = dict(BLOCK_N=(64, 128), NUM_WARPS=(2, 4, 8), NUM_STAGES=(2, 3, 5), PROGRAMS_PER_SM=(4,))
programs_per_sm = dl.PROGRAMS_PER_SM  # the engine's, restored after each forced launch
choose_launch = dl.choose_launch  # the engine's, restored after each forced setting


def copy_bandwidth() -> float:
    """Bytes per second of a 2 GiB device-to-device copy (read + write)."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src))
    return 2 * src.numel() / (ms * 1e-3)


def make_case(batch: int, context: int, kv_dtype: torch.dtype, num_heads: int, num_kv_heads: int):
    """A decode call as the engine makes one: contexts drawn from [context / 2, context] (a batch's
    sequences are at different points of their outputs), scattered blocks, sequences in the engine's
    decode order (longest first)."""
    blocks_per_seq = math.ceil(context / BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM)
    k_cache = torch.randn(shape, device="cuda").to(kv_dtype)
    v_cache = torch.randn(shape, device="cuda").to(kv_dtype)
    # Scattered blocks, as a long-running cache holds them.
    tables = torch.randperm(num_blocks, device="cuda", dtype=torch.int32).view(batch, blocks_per_seq)
    q = torch.randn(batch, num_heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    seqlens = torch.randint(max(1, context // 2), context + 1, (batch,), device="cuda", dtype=torch.int32)
    order = torch.argsort(seqlens, descending=True, stable=True).to(torch.int32)
    kv_bytes = 2 * int(seqlens.sum()) * num_kv_heads * HEAD_DIM * k_cache.element_size()
    return q, k_cache, v_cache, seqlens, tables, order, kv_bytes


def forced(setting: dict, calls: list):
    """A stand-in for decode_launch.choose_launch that always launches `setting` (and appends to
    `calls`, so the sweep can tell that the kernel asked it)."""
    launch = dl.DecodeLaunch(setting["BLOCK_N"], setting["NUM_WARPS"], setting["NUM_STAGES"])

    def choose(batch_size, num_kv_heads, head_dim, max_context_len, element_size, device, num_sms):
        calls.append(setting)
        dl.PROGRAMS_PER_SM = setting["PROGRAMS_PER_SM"]
        try:
            splits = dl.decode_num_splits(batch_size, num_kv_heads, max_context_len, launch.block_n, num_sms)
            return launch, splits
        finally:
            dl.PROGRAMS_PER_SM = programs_per_sm
    return choose


def default_setting(batch: int, context: int, element_size: int, num_kv_heads: int) -> dict:
    """What the engine launches for this case (decode_launch.choose_launch)."""
    launch, _ = dl.choose_launch(batch, num_kv_heads, HEAD_DIM, context, element_size, torch.device("cuda"),
                                 sm_count(torch.device("cuda")))
    return dict(BLOCK_N=launch.block_n, NUM_WARPS=launch.num_warps, NUM_STAGES=launch.num_stages,
                PROGRAMS_PER_SM=dl.PROGRAMS_PER_SM)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller grid of settings")
    parser.add_argument("--heads", type=int, nargs=2, default=(16, 8), metavar=("Q", "KV"),
                        help="query and KV heads (default: Qwen3-0.6B's 16 and 8)")
    args = parser.parse_args()
    num_heads, num_kv_heads = args.heads
    if num_heads % num_kv_heads:
        parser.error(f"--heads: {num_heads} query heads do not split into {num_kv_heads} KV heads' groups")
    grid = QUICK if args.quick else SETTINGS
    copy_bps = copy_bandwidth()
    print(json.dumps(dict(copy_gb_s=round(copy_bps / 1e9))), flush=True)
    workspace = torch.empty(64 * 2**20, dtype=torch.float32, device="cuda")
    counters = torch.zeros(512 * num_kv_heads, dtype=torch.int32, device="cuda")
    for kv_dtype, (batch, context) in itertools.product((torch.bfloat16, torch.float8_e4m3fn), CASES):
        q, k_cache, v_cache, seqlens, tables, order, kv_bytes = make_case(batch, context, kv_dtype, num_heads,
                                                                          num_kv_heads)
        run = functools.partial(dk.paged_decode_attention, q, k_cache, v_cache, seqlens, tables,
                                HEAD_DIM**-0.5, workspace=workspace, counters=counters, seq_order=order)
        default = default_setting(batch, context, k_cache.element_size(), num_kv_heads)
        settings = [dict(zip(grid, values)) for values in itertools.product(*grid.values())]
        results = []
        for setting in settings + ([] if default in settings else [default]):
            # DecodeCall.prepare looks choose_launch up in decode_launch at each call: patched there.
            calls = []
            dl.choose_launch = forced(setting, calls)
            try:
                # Replayed from a CUDA graph as decode steps run it: do_bench, which flushes the L2 and
                # launches from Python between calls, ranked launches otherwise (measured 2026-12-02).
                us = triton.testing.do_bench_cudagraph(run, return_mode="median") * 1e3
            except Exception as e:  # e.g. a tile and stage count that overflow shared memory
                print(f"skipped {setting}: {type(e).__name__}", flush=True)
                continue
            finally:
                dl.choose_launch = choose_launch
            if not calls:
                raise RuntimeError("the decode kernel never asked for its launch: the sweep would time the "
                                   "engine's setting under every name")
            results.append((us, setting))
        results.sort(key=lambda r: r[0])
        default_us = next(us for us, s in results if s == default)
        best_us, best = results[0]
        copy_us = kv_bytes / copy_bps * 1e6  # a copy that reads as many bytes
        print(json.dumps(dict(
            kv=str(kv_dtype).removeprefix("torch."), heads=[num_heads, num_kv_heads], batch=batch,
            context=context, default=default,
            default_us=round(default_us, 1), default_of_copy=round(copy_us / default_us, 3),
            best_us=round(best_us, 1), best_of_copy=round(copy_us / best_us, 3),
            best=best, next=[dict(us=round(us, 1), **s) for us, s in results[1:4]])), flush=True)


if __name__ == "__main__":
    main()
