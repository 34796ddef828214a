"""Probes of the linear layers' cost on the GPU, outside the engine: Qwen3-0.6B's decode chain (28 layers
x qkv, o, gate_up, down; `pdl` adds the LM head) replayed in one CUDA graph, at M rows. Each subcommand
is one question of BENCHMARKS.md's fifth session, which answered no to each; `pdl` now times the engine's
own GEMV, which launches as a programmatic dependent since the eleventh session (calls P2, P3).

    python scripts/linear_probe.py pdl        # 1-row GEMVs with and without programmatic dependent launch
    python scripts/linear_probe.py tiles      # cuBLAS vs cuBLASLt vs a Triton tile GEMM, M = 1..256
    python scripts/linear_probe.py few-rows   # cuBLAS vs a GEMV-shaped tl.dot kernel with split-K, M = 2..128
    python scripts/linear_probe.py host       # host us per call: cuBLAS shapes new and seen, Triton"""

import argparse
import dataclasses
import itertools
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nanovllm.kernels import norm_act  # noqa: E402
from nanovllm.kernels.skinny_gemm import skinny_config, skinny_linear  # noqa: E402

SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)]  # (N, K) of one layer's four linears
VOCAB, HIDDEN, LAYERS = 151936, 1024, 28
WEIGHT_BYTES = 1.19e9  # the chain with the LM head, bf16


@triton.jit
def _tile_gemm(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om, tiles_per_split,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
               WRITE_PARTIAL: tl.constexpr):
    """out^T[N, M] = W[N, K] @ x^T[K, M] (swap-AB: the MMA's rows are weight rows) over one K range;
    with WRITE_PARTIAL a float32 [split, M, N] partial that _reduce sums."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M) + tl.program_id(2) * BLOCK_M
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + tl.minimum(offs_n, N - 1)[:, None].to(tl.int64) * stride_wn
    x_rows = x_ptr + tl.minimum(offs_m, M - 1)[None, :].to(tl.int64) * stride_xm
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    k_start = pid_k * tiles_per_split * BLOCK_K
    for k in tl.range(k_start, tl.minimum(k_start + tiles_per_split * BLOCK_K, K), BLOCK_K,
                      num_stages=NUM_STAGES):
        acc = tl.dot(tl.load(w_rows + (k + offs_k)[None, :]), tl.load(x_rows + (k + offs_k)[:, None]), acc)
    mask = (offs_m[None, :] < M) & (offs_n[:, None] < N)
    if WRITE_PARTIAL:
        tl.store(out_ptr + (pid_k * M + offs_m[None, :]).to(tl.int64) * N + offs_n[:, None], acc, mask=mask)
    else:
        tl.store(out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None],
                 acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _reduce(partial_ptr, out_ptr, MN, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(partial_ptr + s * MN + offs, mask=offs < MN, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=offs < MN)


def tile_gemm(block_m: int, block_n: int, block_k: int, stages: int, target_programs: int = 0):
    """A linear(x, w, out) through _tile_gemm; target_programs > 0 splits K until the grid has that many."""
    def run(x, w, out):
        (m, k), n = x.shape, w.shape[0]
        blocks, tiles = triton.cdiv(n, block_n), triton.cdiv(k, block_k)
        split = max(1, min(tiles, target_programs // blocks)) if target_programs else 1
        per = triton.cdiv(tiles, split)
        split = triton.cdiv(tiles, per)
        target = torch.empty(split * m * n, device=x.device, dtype=torch.float32) if split > 1 else out
        _tile_gemm[(blocks, split, triton.cdiv(m, block_m))](
            x, w, target, m, n, k, x.stride(0), w.stride(0), out.stride(0), per, BLOCK_M=block_m,
            BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=stages, WRITE_PARTIAL=split > 1)
        if split > 1:
            _reduce[(triton.cdiv(m * n, 1024),)](target, out, m * n, SPLIT_K=split, BLOCK=1024)
    return run


def graph_us(fn, reps: int = 100) -> float:
    """Microseconds per replay of fn captured in a CUDA graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(10):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps * 1e3


class Chain:
    """The decode chain at m rows: each linear reads the previous one's output (its first K columns)."""

    def __init__(self, m: int, with_head: bool) -> None:
        torch.manual_seed(0)
        self.weights = [[torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for n, k in SHAPES]
                        for _ in range(LAYERS)]
        self.head = None
        if with_head:
            self.head = torch.randn(VOCAB, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.02
        self.outs = {n: torch.zeros(m, n, device="cuda", dtype=torch.bfloat16) for n, _ in SHAPES}
        self.x0 = torch.randn(m, HIDDEN, device="cuda", dtype=torch.bfloat16)
        self.logits = torch.zeros(m, VOCAB, device="cuda", dtype=torch.bfloat16)

    def run(self, linear) -> None:
        x = self.x0
        for layer in self.weights:
            for w in layer:
                linear(x[:, :w.shape[1]], w, self.outs[w.shape[0]])
                x = self.outs[w.shape[0]]
        if self.head is not None:
            linear(x[:, :HIDDEN], self.head, self.logits)

    def result(self) -> torch.Tensor:
        return (self.logits if self.head is not None else self.outs[HIDDEN]).float().clone()


def cublas(x, w, out):
    torch.matmul(x, w.t(), out=out)


def probe_pdl() -> None:
    """The engine's one-row GEMV with and without programmatic dependent launch, and the weight tiles a
    PDL launch loads before its wait (SkinnyConfig.preload; the engine's: PDL_PRELOAD_TILES)."""
    chain = Chain(1, with_head=True)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count

    def gemv(pdl: bool, preload: int | None = None):
        def run(x, w, out):
            config = dataclasses.replace(skinny_config(*w.shape, 2, num_sms), preload=preload)
            skinny_linear(x, w, out=out, config=config, pdl=pdl)
        return run

    variants = {"no PDL": gemv(False), "PDL (engine)": gemv(True), "PDL, no preload": gemv(True, 0),
                "PDL, 1 tile preloaded": gemv(True, 1)}
    reference = None
    for name, linear in variants.items():
        us = graph_us(lambda linear=linear: chain.run(linear), reps=200)
        got = chain.result()
        reference = got if reference is None else reference
        print(f"{name:36s} {us:7.1f} us per token ({WEIGHT_BYTES / us / 1e6:.2f} TB/s), "
              f"max diff {(got - reference).abs().max().item():.3g}", flush=True)


def tile_configs(m: int) -> list[tuple]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, stages): output tiles of the usual shape, no split-K."""
    block_ms = sorted({min(max(16, triton.next_power_of_2(m)), 64), 16 if m <= 64 else 32})
    return list(itertools.product(block_ms, (64, 128), (64, 128), (3, 5)))


def few_rows_configs(m: int) -> list[tuple]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, stages, programs): all rows in one tile, few weight rows a program
    (as the GEMV), K split until the grid has `programs` programs."""
    return [(max(16, triton.next_power_of_2(m)), bn, bk, stages, programs)
            for bn, bk, stages, programs in itertools.product((16, 32), (128, 256), (3, 5), (264, 528))]


def probe_gemm(rows: list[int], configs_at, with_cublaslt: bool) -> None:
    for m in rows:
        gemm_at(m, configs_at(m), with_cublaslt)


def gemm_at(m: int, configs: list[tuple], with_cublaslt: bool) -> None:
    """One line: the chain through cuBLAS (and cuBLASLt), and through the fastest Triton config."""
    chain = Chain(m, with_head=False)
    line = f"M={m:4d} cuBLAS {graph_us(lambda: chain.run(cublas)):7.1f} us"
    reference = chain.result()
    if with_cublaslt:
        torch.backends.cuda.preferred_blas_library("cublaslt")
        line += f", cuBLASLt {graph_us(lambda: chain.run(cublas)):7.1f} us"
        torch.backends.cuda.preferred_blas_library("cublas")
    us, best = min((graph_us(lambda cfg=cfg: chain.run(tile_gemm(*cfg)), reps=50), cfg) for cfg in configs)
    chain.run(tile_gemm(*best))
    err = (chain.result() - reference).abs().max().item() / reference.abs().max().item()
    print(f"{line}, best Triton GEMM {us:7.1f} us (config {best}; rel. diff {err:.2g})", flush=True)


def host_us(fn, reps: int = 200) -> float:
    """Median host microseconds of one call, the GPU idle before each (no launch waits for a queue)."""
    times = []
    for i in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - start)
    return round(sorted(times)[reps // 2] * 1e6, 1)


def probe_host() -> None:
    w = torch.randn(4096, HIDDEN, device="cuda", dtype=torch.bfloat16)
    xs = {m: torch.randn(m, HIDDEN, device="cuda", dtype=torch.bfloat16) for m in range(1500, 2300)}
    norm_weight = torch.ones(HIDDEN, device="cuda", dtype=torch.bfloat16)
    wide = torch.randn(2000, 6144, device="cuda", dtype=torch.bfloat16)
    print("cuBLAS linear, the same M every call:", host_us(lambda i: F.linear(xs[2000], w)))
    print("cuBLAS linear, an M new to cuBLAS every call:", host_us(lambda i: F.linear(xs[1500 + i], w)))
    print("cuBLAS linear, those M again:", host_us(lambda i: F.linear(xs[1500 + i], w)))
    print("Triton rms_norm:", host_us(lambda i: norm_act.rms_norm(xs[1700 + i], norm_weight, 1e-6)))
    x = xs[2000]
    print("Triton add_rms_norm:", host_us(lambda i: norm_act.add_rms_norm(x, x, norm_weight, 1e-6)))
    print("Triton silu_and_mul:", host_us(lambda i: norm_act.silu_and_mul(wide)))
    print("torch.empty:", host_us(lambda i: torch.empty(2000, HIDDEN, device="cuda", dtype=torch.bfloat16)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("probe", choices=["pdl", "tiles", "few-rows", "host"])
    parser.add_argument("--rows", type=int, nargs="*", help="M values (tiles: 1 16 64 128 256; few-rows: "
                                                           "2 16 64 128)")
    args = parser.parse_args()
    if args.probe == "pdl":
        probe_pdl()
    elif args.probe == "tiles":
        probe_gemm(args.rows or [1, 16, 64, 128, 256], tile_configs, with_cublaslt=True)
    elif args.probe == "few-rows":
        probe_gemm(args.rows or [2, 16, 64, 128], few_rows_configs, with_cublaslt=False)
    else:
        probe_host()


if __name__ == "__main__":
    main()
