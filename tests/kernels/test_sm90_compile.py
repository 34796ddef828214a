"""Every Triton kernel compiles for the H100/H200 (sm_90), without a GPU.

The interpreter, which runs the numeric tests here, executes kernels as NumPy and skips the compiler's
checks: e.g. a variable that changes type inside one branch of an `if` runs fine interpreted and fails to
compile. Triton's NVIDIA backend (ptxas included) ships in the wheel, so compiling ahead of time for a
named target catches those on a CPU-only machine. The compiling runs in one child process, because the
kernels must be imported with the interpreter off (this session imported them with it on)."""

import importlib
import json
import os
import pkgutil
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1" and __name__ != "__main__":
    # The child process imports them; this one only reads its report.
    decode_attention = decode_launch = decode_rope = fused_moe = moe_align = moe_routing = norm_act = None
    decode_inputs = prefill_attention = rope_store = sample_race = skinny_gemm = skinny_rows = split_k = None
    gemv_rows = fp8_gemm = fp8_gemv = None
else:
    import nanovllm.kernels
    from nanovllm.kernels import (
        decode_attention,
        decode_inputs,
        decode_launch,
        decode_rope,
        fp8_gemm,
        fp8_gemv,
        fused_moe,
        gemv_rows,
        moe_align,
        moe_routing,
        norm_act,
        prefill_attention,
        rope_store,
        sample_race,
        skinny_gemm,
        skinny_rows,
        split_k,
    )

H200 = GPUTarget("cuda", 90, 32)
# Pointer element types by argument name; other pointers hold the model's dtype.
POINTER_TYPES = {
    "positions_ptr": "*i64",
    "slot_mapping_ptr": "*i32",
    "seqlens_k_ptr": "*i32",
    "cu_seqlens_q_ptr": "*i32",
    "block_tables_ptr": "*i32",
    "seq_order_ptr": "*i32",
    "counters_ptr": "*i32",
    "cos_ptr": "*fp32",
    "sin_ptr": "*fp32",
    "partial_out_ptr": "*fp32",
    "partial_lse_ptr": "*fp32",
    "partial_ptr": "*fp32",
    "topk_ids_ptr": "*i32",  # as the GPU routing writes them
    "counts_ptr": "*i32",
    "cum_counts_ptr": "*i32",
    "sorted_ids_ptr": "*i32",
    "expert_ids_ptr": "*i32",
    "topk_weights_ptr": "*fp32",
    "scale_ptr": "*fp32",
    "temps_ptr": "*fp32",
    "seeds_ptr": "*i64",
    "best_val_ptr": "*fp32",
    "best_idx_ptr": "*i32",
    "tokens_ptr": "*i64",
    "out_rows_ptr": "*i32",
    "row_max_ptr": "*fp32",
    "log_min_p_ptr": "*fp32",
    "k_scales_ptr": "*fp32",  # an int8 KV cache's per-token scales
    "v_scales_ptr": "*fp32",
}
FLOAT_SCALARS = {"eps", "scale_log2", "q_eps", "k_eps", "k_scale_inv", "v_scale_inv", "v_scale"}
# Cases reading or writing an fp8 (e4m3) KV cache: their cache pointers hold fp8.
FP8_CACHE = {"k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv"}
# Cases over an int8 KV cache (kv_cache_dtype="int8"): int8 values, float32 scales per token.
INT8_CACHE = {"k_cache_ptr": "*i8", "v_cache_ptr": "*i8"}
ROPE_SHAPES = dict(NUM_HEADS=16, NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_H=16, BLOCK_KV=8, BLOCK_D=128)
# fp8 weights (layers/fp8.py's layout): e4m3 [N, K] and float32 scales; the W8A8 GEMM's x is e4m3 too.
FP8_WEIGHT = {"w_ptr": "*fp8e4nv", "w_scale_ptr": "*fp32"}
DECODE = dict(NUM_HEADS_PER_KV=2, NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_SIZE=256, BLOCK_G=16, BLOCK_N=128,
              COMBINE_HEADS=2, COMBINE_ROWS=16, FP8_TILES="cast", KV_PER_PROG=1)


def cases() -> dict:
    """name: (kernel, constexprs), for shapes of Qwen3-0.6B (the MoE kernels: of Qwen3-30B-A3B)."""
    return {
        "prefill": (prefill_attention._prefill_kernel,
                    dict(NUM_HEADS_PER_KV=2, NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_M=64,
                         BLOCK_N=64, DOT_PRECISION="tf32")),
        "decode": (decode_attention._decode_split_kernel,
                   dict(DECODE, DOT_PRECISION="tf32", ORDERED=True)),
        "rope-store-qk-norm": (rope_store._norm_rope_store_kernel,
                               dict(ROPE_SHAPES, HAS_NORM=True, QUANT=False)),
        "rope-store": (rope_store._norm_rope_store_kernel,
                       dict(ROPE_SHAPES, HAS_NORM=False, QUANT=False)),
        "rope-store-fp8": (rope_store._norm_rope_store_kernel,
                           dict(ROPE_SHAPES, HAS_NORM=True, QUANT=True), FP8_CACHE),
        "decode-fp8": (decode_attention._decode_split_kernel,
                       dict(DECODE, DOT_PRECISION="tf32", ORDERED=True), FP8_CACHE),
        # decode_fp8_tiles' "words" form of an fp8 cache's tiles (float32 queries keep "cast").
        "decode-fp8-words": (decode_attention._decode_split_kernel,
                             dict(DECODE, DOT_PRECISION="tf32", ORDERED=True, FP8_TILES="words"), FP8_CACHE,
                             decode_launch.WIDE.options(fp8_words=True)),
        "decode-fp8-words-large-batch": (decode_attention._decode_split_kernel,
                                         dict(DECODE, BLOCK_N=64, DOT_PRECISION="tf32", ORDERED=True,
                                              FP8_TILES="words"), FP8_CACHE,
                                         decode_launch.FP8_LARGE_BATCH.options(fp8_words=True)),
        # One chunk a context (large batches): each program stores its output, no partials or combine.
        "decode-one-split": (decode_attention._decode_split_kernel,
                             dict(DECODE, DOT_PRECISION="tf32", ORDERED=True, ONE_SPLIT=True), {},
                             decode_launch.WIDE.options(fp8_words=False)),
        "decode-fp8-words-large-batch-one-split": (
            decode_attention._decode_split_kernel,
            dict(DECODE, BLOCK_N=64, DOT_PRECISION="tf32", ORDERED=True, FP8_TILES="words", ONE_SPLIT=True),
            FP8_CACHE, decode_launch.FP8_LARGE_BATCH.options(fp8_words=True)),
        # decode_launch.FP8_PACKED: two KV heads a program, their GQA groups stacked (decode_fp8_tiles).
        "decode-fp8-words-packed": (
            decode_attention._decode_split_kernel,
            dict(DECODE, BLOCK_N=64, DOT_PRECISION="tf32", ORDERED=True, FP8_TILES="words", ONE_SPLIT=True,
                 KV_PER_PROG=2),
            FP8_CACHE, decode_launch.FP8_PACKED.options(fp8_words=True)),
        "decode-fp8-words-small-batch": (decode_attention._decode_split_kernel,
                                         dict(DECODE, DOT_PRECISION="tf32", ORDERED=False, FP8_TILES="words"),
                                         FP8_CACHE, dict(num_warps=4, num_stages=3)),
        # decode_launch.SMALL_BATCH: the latency-bound settings of a 16-bit and of an fp8 cache.
        "decode-small-batch": (decode_attention._decode_split_kernel,
                               dict(DECODE, BLOCK_N=64, DOT_PRECISION="tf32", ORDERED=False), {},
                               dict(num_warps=4, num_stages=3)),
        "decode-fp8-small-batch": (decode_attention._decode_split_kernel,
                                   dict(DECODE, DOT_PRECISION="tf32", ORDERED=False),
                                   FP8_CACHE, dict(num_warps=4, num_stages=3)),
        # decode_rope: the small-batch decode with q/k norm, rotary and the KV store folded in.
        "decode-rope": (decode_rope._decode_rope_split_kernel,
                        dict(DECODE, BLOCK_N=64, DOT_PRECISION="tf32", HAS_NORM=True, QUANT=False), {},
                        dict(num_warps=4, num_stages=3)),
        "decode-rope-one-split": (decode_rope._decode_rope_split_kernel,
                                  dict(DECODE, BLOCK_N=64, DOT_PRECISION="tf32", HAS_NORM=True, QUANT=False,
                                       ONE_SPLIT=True), {}, dict(num_warps=4, num_stages=3)),
        "decode-rope-pdl": (decode_rope._decode_rope_split_kernel,
                            dict(DECODE, BLOCK_N=64, DOT_PRECISION="tf32", HAS_NORM=True, QUANT=False,
                                 PDL=True),
                            {}, dict(num_warps=4, num_stages=3, launch_pdl=True)),
        # From two rows on, its dependent launches after the K/V loop (TritonBackend.DECODE_BUCKETS).
        "decode-rope-pdl-late-trigger": (decode_rope._decode_rope_split_kernel,
                                         dict(DECODE, BLOCK_N=64, DOT_PRECISION="tf32", HAS_NORM=True,
                                              QUANT=False, PDL=True, LATE_TRIGGER=True),
                                         {}, dict(num_warps=4, num_stages=3, launch_pdl=True)),
        "decode-rope-fp8": (decode_rope._decode_rope_split_kernel,
                            dict(DECODE, DOT_PRECISION="tf32", HAS_NORM=True, QUANT=True), FP8_CACHE,
                            dict(num_warps=4, num_stages=3)),
        "decode-rope-fp8-words": (decode_rope._decode_rope_split_kernel,
                                  dict(DECODE, DOT_PRECISION="tf32", HAS_NORM=True, QUANT=True,
                                       FP8_TILES="words"), FP8_CACHE, dict(num_warps=4, num_stages=3)),
        "decode-rope-fp8-words-wide": (decode_rope._decode_rope_split_kernel,
                                       dict(DECODE, DOT_PRECISION="tf32", HAS_NORM=True, QUANT=True,
                                            FP8_TILES="words"), FP8_CACHE,
                                       decode_launch.WIDE.options(fp8_words=True)),
        "decode-rope-fp8-words-large-batch": (decode_rope._decode_rope_split_kernel,
                                              dict(DECODE, BLOCK_N=64, DOT_PRECISION="tf32", HAS_NORM=True,
                                                   QUANT=True, FP8_TILES="words"), FP8_CACHE,
                                              decode_launch.FP8_LARGE_BATCH.options(fp8_words=True)),
        # An int8 cache: its tiles widen as a 16-bit cache's ("cast"), scaled per key; the launches an int8
        # cache's element size takes (decode_launch: fp8's large- and small-batch settings).
        "rope-store-int8": (rope_store._norm_rope_store_kernel,
                            dict(ROPE_SHAPES, HAS_NORM=True, QUANT=True), INT8_CACHE),
        "prefill-int8": (prefill_attention._prefill_kernel,
                         dict(NUM_HEADS_PER_KV=2, NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_SIZE=256, BLOCK_M=64,
                              BLOCK_N=64, DOT_PRECISION="tf32"), INT8_CACHE),
        "decode-int8-large-batch-one-split": (
            decode_attention._decode_split_kernel,
            dict(DECODE, BLOCK_N=64, DOT_PRECISION="tf32", ORDERED=True, ONE_SPLIT=True), INT8_CACHE,
            decode_launch.FP8_LARGE_BATCH.options(fp8_words=False)),
        "decode-int8-small-batch": (decode_attention._decode_split_kernel,
                                    dict(DECODE, DOT_PRECISION="tf32", ORDERED=False), INT8_CACHE,
                                    dict(num_warps=4, num_stages=3)),
        "decode-rope-int8-pdl": (decode_rope._decode_rope_split_kernel,
                                 dict(DECODE, DOT_PRECISION="tf32", HAS_NORM=True, QUANT=True, PDL=True,
                                      LATE_TRIGGER=True), INT8_CACHE,
                                 dict(num_warps=4, num_stages=3, launch_pdl=True)),
        "prefill-fp8": (prefill_attention._prefill_kernel,
                        dict(NUM_HEADS_PER_KV=2, NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_SIZE=256, BLOCK_M=64,
                             BLOCK_N=64, DOT_PRECISION="tf32"), FP8_CACHE),
        "skinny-gemm": (skinny_gemm._skinny_gemm_kernel,
                        dict(BLOCK_N=64, BLOCK_K=256, HAS_BIAS=True, WRITE_PARTIAL=True, NUM_STAGES=3,
                             PDL=False, PRELOAD=0)),
        "skinny-gemm-add-rms-norm": (skinny_gemm._skinny_gemm_kernel,
                                     dict(BLOCK_N=8, BLOCK_K=512, HAS_BIAS=False, WRITE_PARTIAL=False,
                                          NUM_STAGES=3, PROLOGUE=skinny_gemm.ADD_RMS_NORM.value, PDL=False,
                                          PRELOAD=0)),
        "skinny-gemm-silu-mul": (skinny_gemm._skinny_gemm_kernel,
                                 dict(BLOCK_N=4, BLOCK_K=1024, HAS_BIAS=False, WRITE_PARTIAL=False,
                                      NUM_STAGES=3, PROLOGUE=skinny_gemm.SILU_MUL.value, PDL=False,
                                      PRELOAD=1)),
        "skinny-gemm-pdl": (skinny_gemm._skinny_gemm_kernel,
                            dict(BLOCK_N=16, BLOCK_K=256, HAS_BIAS=False, WRITE_PARTIAL=False, NUM_STAGES=3,
                                 PROLOGUE=skinny_gemm.ADD_RMS_NORM.value, PDL=True, PRELOAD=2), {},
                            dict(launch_pdl=True)),
        # fp8 weights with one scale a row (kernels/fp8_skinny.py): the e4m3 tile widened in registers.
        "skinny-gemm-fp8-add-rms-norm-pdl": (
            skinny_gemm._skinny_gemm_kernel,
            dict(BLOCK_N=16, BLOCK_K=256, HAS_BIAS=False, WRITE_PARTIAL=False, NUM_STAGES=5,
                 PROLOGUE=skinny_gemm.ADD_RMS_NORM.value, PDL=True, PRELOAD=2, SCALED=True),
            FP8_WEIGHT, dict(launch_pdl=True)),
        "skinny-gemm-fp8-split-k": (
            skinny_gemm._skinny_gemm_kernel,
            dict(BLOCK_N=4, BLOCK_K=1024, HAS_BIAS=True, WRITE_PARTIAL=True, NUM_STAGES=3, PDL=False,
                 PRELOAD=0, SCALED=True),
            FP8_WEIGHT),
        "skinny-rows-add-rms-norm-pdl": (skinny_rows._skinny_rows_kernel,
                                         dict(ROWS_=16, BLOCK_N=16, BLOCK_K=256, HAS_BIAS=False,
                                              WRITE_PARTIAL=False, NUM_STAGES=4,
                                              PROLOGUE=skinny_rows.ADD_RMS_NORM.value, PDL=True,
                                              PRELOAD=2), {},
                                         dict(launch_pdl=True)),
        "skinny-rows-split": (skinny_rows._skinny_rows_kernel,
                              dict(ROWS_=16, BLOCK_N=16, BLOCK_K=256, HAS_BIAS=True, WRITE_PARTIAL=True,
                                   NUM_STAGES=4, PROLOGUE=skinny_rows.PLAIN.value, PDL=True, PRELOAD=2), {},
                              dict(num_warps=2, launch_pdl=True)),
        # fp8 weights at 2-16 rows (kernels/fp8_skinny.fp8_rows_linear): e4m3 tiles widened for the dot.
        "skinny-rows-fp8-pdl": (skinny_rows._skinny_rows_kernel,
                                dict(ROWS_=16, BLOCK_N=64, BLOCK_K=256, HAS_BIAS=True, WRITE_PARTIAL=False,
                                     NUM_STAGES=4, PROLOGUE=skinny_rows.PLAIN.value, PDL=True, PRELOAD=2,
                                     SCALED=True), FP8_WEIGHT, dict(num_warps=4, launch_pdl=True)),
        "skinny-rows-fp8-split": (skinny_rows._skinny_rows_kernel,
                                  dict(ROWS_=16, BLOCK_N=16, BLOCK_K=256, HAS_BIAS=True, WRITE_PARTIAL=True,
                                       NUM_STAGES=5, PROLOGUE=skinny_rows.PLAIN.value, PDL=True, PRELOAD=2,
                                       SCALED=True), FP8_WEIGHT, dict(num_warps=2, launch_pdl=True)),
        "split-k-reduce": (split_k.split_k_reduce_kernel, dict(SPLIT_K=4, HAS_BIAS=True, BLOCK_N=128)),
        "add-rms-norm": (norm_act._rms_norm_kernel, dict(HAS_RESIDUAL=True, BLOCK=1024)),
        "rms-norm": (norm_act._rms_norm_kernel, dict(HAS_RESIDUAL=False, BLOCK=1024)),
        "silu-and-mul": (norm_act._silu_and_mul_kernel, dict(BLOCK=norm_act.ACT_BLOCK)),
        "race-chunk": (sample_race._race_chunk_kernel, dict(SUB_BLOCK=sample_race.SUB_BLOCK, HAS_FLOOR=True,
                                                                  FAST_LOG=True)),
        "race-chunk-greedy": (sample_race._race_chunk_kernel,
                              dict(SUB_BLOCK=sample_race.SUB_BLOCK, HAS_FLOOR=False, FAST_LOG=True,
                                   ALL_GREEDY=True)),
        "decode-inputs": (decode_inputs._place_inputs_kernel, dict(BLOCK=decode_inputs.BLOCK),
                          {"static_ptr": "*i32", "staged_ptr": "*i32", "sampled_ptr": "*i64"}),
        "race-pick": (sample_race._race_pick_kernel, dict(BLOCK_C=sample_race.MAX_CHUNKS, SCATTER=False), {},
                      dict(num_warps=1)),
        # A decode graph's race: each row's token where out_rows says.
        "race-pick-scatter": (sample_race._race_pick_kernel,
                              dict(BLOCK_C=sample_race.MAX_CHUNKS, SCATTER=True), {}, dict(num_warps=1)),
        # The few-row GEMV as the layers take it at two rows: o_proj (PDL, preloaded tiles), down_proj with
        # its SiLU-mul; and a split with a bias at four rows.
        "gemv-rows-pdl": (gemv_rows._gemv_rows_kernel,
                          dict(ROWS=2, BLOCK_N=4, BLOCK_K=512, HAS_BIAS=False, WRITE_PARTIAL=False,
                               NUM_STAGES=6, PROLOGUE=gemv_rows.PLAIN.value, PDL=True, PRELOAD=2), {},
                          dict(launch_pdl=True)),
        "gemv-rows-silu-mul": (gemv_rows._gemv_rows_kernel,
                               dict(ROWS=2, BLOCK_N=4, BLOCK_K=512, HAS_BIAS=False, WRITE_PARTIAL=False,
                                    NUM_STAGES=6, PROLOGUE=gemv_rows.SILU_MUL.value, PDL=False, PRELOAD=0)),
        "gemv-rows-split": (gemv_rows._gemv_rows_kernel,
                            dict(ROWS=4, BLOCK_N=16, BLOCK_K=64, HAS_BIAS=True, WRITE_PARTIAL=True,
                                 NUM_STAGES=4, PROLOGUE=gemv_rows.PLAIN.value, PDL=False, PRELOAD=1)),
        # fp8 linear layers (layers/fp8.py): activations quantized per token and 128-group, the W8A8 GEMM of
        # a 128x128 block checkpoint and of a per-channel one (one K-group), and the W8A16 decode GEMV.
        "fp8-quantize-rows": (fp8_gemm._quantize_rows_kernel, dict(BLOCK=128),
                              {"q_ptr": "*fp8e4nv", "scale_ptr": "*fp32"}),
        "fp8-w8a8-gemm-block": (fp8_gemm._w8a8_gemm_kernel,
                                dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, ONE_GROUP=False, HAS_BIAS=True,
                                     NUM_STAGES=3),
                                dict(FP8_WEIGHT, x_ptr="*fp8e4nv", x_scale_ptr="*fp32"), dict(num_warps=8)),
        "fp8-w8a8-gemm-channel": (fp8_gemm._w8a8_gemm_kernel,
                                  dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, ONE_GROUP=True, HAS_BIAS=False,
                                       NUM_STAGES=3),
                                  dict(FP8_WEIGHT, x_ptr="*fp8e4nv", x_scale_ptr="*fp32"), dict(num_warps=4)),
        "fp8-gemv-block-pdl": (fp8_gemv._fp8_gemv_kernel,
                               dict(ROWS_=16, BLOCK_N=32, BLOCK_K=128, ONE_GROUP=False, HAS_BIAS=True,
                                    NUM_STAGES=4, DOT_PRECISION="tf32", PDL=True),
                               FP8_WEIGHT, dict(num_warps=4, launch_pdl=True)),
        "fp8-gemv-channel": (fp8_gemv._fp8_gemv_kernel,
                             dict(ROWS_=16, BLOCK_N=64, BLOCK_K=256, ONE_GROUP=True, HAS_BIAS=False,
                                  NUM_STAGES=4, DOT_PRECISION="tf32", PDL=False),
                             FP8_WEIGHT, dict(num_warps=4)),
        "moe-topk-softmax": (moe_routing._topk_softmax_kernel,
                             dict(TOP_K=8, K_PAD=8, E_PAD=128, BLOCK_T=32, RENORMALIZE=True)),
        "moe-count": (moe_align._count_kernel, dict(E_PAD=128, BLOCK_S=32)),
        "moe-scatter": (moe_align._scatter_kernel,
                        dict(E_PAD=128, BLOCK_M=16, BLOCK_S=32, LABEL_ROWS=32, COUNT_HERE=False,
                             SUM_HERE=False, CHUNKS_PAD=128)),
        "moe-scatter-summed": (moe_align._scatter_kernel,
                               dict(E_PAD=128, BLOCK_M=16, BLOCK_S=32, LABEL_ROWS=32, COUNT_HERE=False,
                                    SUM_HERE=True, CHUNKS_PAD=64), {}, dict(num_warps=8)),
        "moe-align-one-launch": (moe_align._scatter_kernel,
                                 dict(E_PAD=128, BLOCK_M=16, BLOCK_S=64, LABEL_ROWS=32, COUNT_HERE=True,
                                      SUM_HERE=False, CHUNKS_PAD=1)),
        "moe-gate-up": (fused_moe._grouped_gemm_kernel,
                        dict(A_ROWS_PER_SLOT_DIV=8, GATED=True, MUL_ROUTED_WEIGHT=False, W_FP8=False, GROUP=0,
                             BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, DOT_PRECISION="tf32")),
        "moe-down": (fused_moe._grouped_gemm_kernel,
                     dict(A_ROWS_PER_SLOT_DIV=1, GATED=False, MUL_ROUTED_WEIGHT=True, W_FP8=False, GROUP=0,
                          BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, DOT_PRECISION="tf32")),
        # fp8 experts: e4m3 weights widened in registers, 128x128 block scales or one a row.
        "moe-gate-up-fp8-block": (fused_moe._grouped_gemm_kernel,
                                  dict(A_ROWS_PER_SLOT_DIV=8, GATED=True, MUL_ROUTED_WEIGHT=False, W_FP8=True,
                                       GROUP=128, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, DOT_PRECISION="tf32"),
                                  {"w_ptr": "*fp8e4nv"}),
        "moe-down-fp8-channel": (fused_moe._grouped_gemm_kernel,
                                 dict(A_ROWS_PER_SLOT_DIV=1, GATED=False, MUL_ROUTED_WEIGHT=True, W_FP8=True,
                                      GROUP=0, BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, DOT_PRECISION="tf32"),
                                 {"w_ptr": "*fp8e4nv"}),
    }


def signature(kernel, dtype: str, pointers: dict[str, str]) -> dict[str, str]:
    def arg_type(name: str, param) -> str:
        if param.is_constexpr:
            return "constexpr"
        if name.endswith("_ptr"):
            return pointers.get(name) or POINTER_TYPES.get(name, f"*{dtype}")
        return "fp32" if name in FLOAT_SCALARS else "i32"

    return {name: arg_type(name, param) for name, param in zip(kernel.arg_names, kernel.params, strict=True)}


def aligned_pointers(names: list[str], types: dict[str, str]) -> dict:
    """What the runtime specializes every launch's pointers to (torch's allocations, and the q/k/v slices
    of a fused projection's output, start 16-byte aligned): the builds that run on the GPU, with their
    vector loads and cp.async pipelines. Without it the build is the rare unaligned one."""
    return {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names) if types[name].startswith("*")}


def launchable_kernels() -> set[str]:
    """Every Triton kernel of nanovllm.kernels, found by scanning its modules for JIT functions named
    `*_kernel` (the device helpers they call, like paged_kv_offsets, compile as part of them)."""
    found = set()
    for info in pkgutil.iter_modules(nanovllm.kernels.__path__):
        module = importlib.import_module(f"nanovllm.kernels.{info.name}")
        for name, value in vars(module).items():
            is_kernel = isinstance(value, triton.JITFunction) and name.endswith("_kernel")
            if is_kernel and value.__module__ == module.__name__:
                found.add(f"{module.__name__}.{name}")
    return found


def compile_all() -> dict[str, str]:
    """Compile every case for sm_90; returns "ok" or the error per "case/dtype", and which kernels exist
    and which the cases cover."""
    results = {
        "kernels": sorted(launchable_kernels()),
        "covered": sorted({f"{case[0].__module__}.{case[0].__name__}" for case in cases().values()}),
    }
    for case, (kernel, constexprs, *rest) in cases().items():
        pointers, options = (list(rest) + [{}, {}])[:2]  # pointer types, launch options (num_warps, ...)
        for dtype in DTYPES:
            values = dict(constexprs)
            if dtype == "fp32" and "DOT_PRECISION" in values:
                values["DOT_PRECISION"] = "ieee"  # what float32 runs use
            if dtype == "fp32" and "FP8_TILES" in values:
                values["FP8_TILES"] = "cast"  # decode_fp8_tiles.fp8_tiles's for a float32 q
                values["KV_PER_PROG"] = 1  # which takes one KV head a program (DecodeCall.prepare)
            names = kernel.arg_names
            types = signature(kernel, dtype, pointers)
            source = ASTSource(fn=kernel, signature=types,
                               constexprs={(names.index(k),): v for k, v in values.items()},
                               attrs=aligned_pointers(names, types))
            try:
                compiled = triton.compile(source, target=H200, options=options)
                results[f"{case}/{dtype}"] = "ok" if compiled.asm.get("cubin") else "no cubin"
            except Exception as e:  # reported per case by the parent
                results[f"{case}/{dtype}"] = f"{type(e).__name__}: {e}"
    return results


DTYPES = ("bf16", "fp32")
CASE_NAMES = ("prefill", "prefill-fp8", "decode", "decode-fp8", "decode-fp8-words", "decode-small-batch",
              "decode-fp8-small-batch", "decode-fp8-words-small-batch", "decode-fp8-words-large-batch",
              "decode-rope", "decode-rope-fp8", "decode-rope-fp8-words", "decode-rope-fp8-words-wide",
              "decode-rope-fp8-words-large-batch", "decode-one-split",
              "decode-fp8-words-large-batch-one-split", "decode-fp8-words-packed", "decode-rope-one-split",
              "rope-store-qk-norm", "rope-store", "rope-store-fp8",
              "rope-store-int8", "prefill-int8", "decode-int8-large-batch-one-split",
              "decode-int8-small-batch", "decode-rope-int8-pdl",
              "skinny-gemm", "skinny-gemm-add-rms-norm", "skinny-gemm-silu-mul", "skinny-gemm-pdl",
              "skinny-gemm-fp8-add-rms-norm-pdl", "skinny-gemm-fp8-split-k",
              "skinny-rows-add-rms-norm-pdl", "skinny-rows-split", "skinny-rows-fp8-pdl",
              "skinny-rows-fp8-split",
              "decode-rope-pdl", "decode-rope-pdl-late-trigger", "split-k-reduce", "add-rms-norm", "rms-norm",
              "silu-and-mul",
              "moe-count", "moe-scatter", "moe-scatter-summed", "moe-gate-up", "moe-down",
              "moe-align-one-launch",
              "moe-gate-up-fp8-block", "moe-down-fp8-channel",
              "moe-topk-softmax", "race-chunk", "race-chunk-greedy", "race-pick", "race-pick-scatter",
              "decode-inputs", "gemv-rows-pdl", "gemv-rows-silu-mul", "gemv-rows-split",
              "fp8-quantize-rows", "fp8-w8a8-gemm-block", "fp8-w8a8-gemm-channel", "fp8-gemv-block-pdl",
              "fp8-gemv-channel")


@pytest.fixture(scope="module")
def compiled() -> dict[str, str]:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=path)
    out = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


def test_every_kernel_has_a_case(compiled):
    assert len(compiled["kernels"]) >= 5  # the scan found the kernels at all
    assert compiled["kernels"] == compiled["covered"]
    assert sorted({key.split("/")[0] for key in compiled if "/" in key}) == sorted(CASE_NAMES)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASE_NAMES)
def test_kernel_compiles_for_sm90(compiled, case, dtype):
    assert compiled[f"{case}/{dtype}"] == "ok"


if __name__ == "__main__":
    print(json.dumps(compile_all()))
