"""The kernel cases test_sm90_compile.py compiles for sm_90: each Triton kernel with the constexprs (and
pointer types, launch options) of a configuration the engine launches, and the argument types by name
(the linear layers' matmuls: sm90_linear_cases.py; the MoE kernels': sm90_moe_cases.py)."""

from sm90_linear_cases import linear_cases
from sm90_moe_cases import moe_cases

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
    "x_scale_ptr": "*fp32",  # float16 rows' scales
}
FLOAT_SCALARS = {"eps", "scale_log2", "q_eps", "k_eps", "k_scale_inv", "v_scale_inv", "v_scale"}
# Cases reading or writing an fp8 (e4m3) KV cache: their cache pointers hold fp8.
FP8_CACHE = {"k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv"}
# Cases over an int8 KV cache (kv_cache_dtype="int8"): int8 values, float32 scales per token.
INT8_CACHE = {"k_cache_ptr": "*i8", "v_cache_ptr": "*i8"}
ROPE_SHAPES = dict(NUM_HEADS=16, NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_H=16, BLOCK_KV=8, BLOCK_D=128)
DECODE = dict(NUM_HEADS_PER_KV=2, NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_SIZE=256, BLOCK_G=16, BLOCK_N=128,
              COMBINE_HEADS=2, COMBINE_ROWS=16, TILES="cast", KV_PER_PROG=1)


def words_large_batch_cases(name: str, cache: dict, decode_attention, decode_launch) -> dict:
    """The large-batch decode builds of a quantized cache read as 16-bit words: one chunk a context, and
    two KV heads a program (decode_launch.FP8_PACKED)."""
    one_split = dict(DECODE, BLOCK_N=64, DOT_PRECISION="tf32", ORDERED=True, TILES="words", ONE_SPLIT=True)
    return {
        f"decode-{name}-words-large-batch-one-split": (
            decode_attention._decode_split_kernel, one_split, cache,
            decode_launch.FP8_LARGE_BATCH.options(words=True)),
        f"decode-{name}-words-packed": (
            decode_attention._decode_split_kernel, dict(one_split, KV_PER_PROG=2), cache,
            decode_launch.FP8_PACKED.options(words=True)),
    }


def cases() -> dict:
    """name: (kernel, constexprs[, pointer types[, launch options]]), for shapes of Qwen3-0.6B (the MoE
    kernels: of Qwen3-30B-A3B). Imports the kernels: call it with the interpreter off."""
    from nanovllm.kernels import (
        decode_attention,
        decode_inputs,
        decode_launch,
        decode_rope,
        norm_act,
        norm_quant,
        prefill_attention,
        rope_store,
        sample_race,
    )
    silu_quant_warps = dict(num_warps=norm_quant.silu_mul_warps(norm_quant.ROW_BLOCK))  # 8B's whole rows
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
        # decode_words' "words" form of an fp8 cache's tiles (float32 queries keep "cast").
        "decode-fp8-words": (decode_attention._decode_split_kernel,
                             dict(DECODE, DOT_PRECISION="tf32", ORDERED=True, TILES="words"), FP8_CACHE,
                             decode_launch.WIDE.options(words=True)),
        "decode-fp8-words-large-batch": (decode_attention._decode_split_kernel,
                                         dict(DECODE, BLOCK_N=64, DOT_PRECISION="tf32", ORDERED=True,
                                              TILES="words"), FP8_CACHE,
                                         decode_launch.FP8_LARGE_BATCH.options(words=True)),
        # One chunk a context (large batches): each program stores its output, no partials or combine.
        "decode-one-split": (decode_attention._decode_split_kernel,
                             dict(DECODE, DOT_PRECISION="tf32", ORDERED=True, ONE_SPLIT=True), {},
                             decode_launch.WIDE.options(words=False)),
        # fp8's large-batch words tiles, one chunk a context; FP8_PACKED: two KV heads a program, their GQA
        # groups stacked (decode_words).
        **words_large_batch_cases("fp8", FP8_CACHE, decode_attention, decode_launch),
        "decode-fp8-words-small-batch": (decode_attention._decode_split_kernel,
                                         dict(DECODE, DOT_PRECISION="tf32", ORDERED=False, TILES="words"),
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
                                       TILES="words"), FP8_CACHE, dict(num_warps=4, num_stages=3)),
        "decode-rope-fp8-words-wide": (decode_rope._decode_rope_split_kernel,
                                       dict(DECODE, DOT_PRECISION="tf32", HAS_NORM=True, QUANT=True,
                                            TILES="words"), FP8_CACHE,
                                       decode_launch.WIDE.options(words=True)),
        "decode-rope-fp8-words-large-batch": (decode_rope._decode_rope_split_kernel,
                                              dict(DECODE, BLOCK_N=64, DOT_PRECISION="tf32", HAS_NORM=True,
                                                   QUANT=True, TILES="words"), FP8_CACHE,
                                              decode_launch.FP8_LARGE_BATCH.options(words=True)),
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
            decode_launch.FP8_LARGE_BATCH.options(words=False)),
        # decode_words.INT8_WORDS: an int8 cache read as words (as fp8's), its scales beside the dots.
        **words_large_batch_cases("int8", INT8_CACHE, decode_attention, decode_launch),
        "decode-rope-int8-words-pdl": (decode_rope._decode_rope_split_kernel,
                                       dict(DECODE, DOT_PRECISION="tf32", HAS_NORM=True, QUANT=True, PDL=True,
                                            LATE_TRIGGER=True, TILES="words"), INT8_CACHE,
                                       dict(num_warps=4, num_stages=3, launch_pdl=True)),
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
        "add-rms-norm": (norm_act._rms_norm_kernel, dict(HAS_RESIDUAL=True, BLOCK=1024)),
        "rms-norm": (norm_act._rms_norm_kernel, dict(HAS_RESIDUAL=False, BLOCK=1024)),
        "silu-and-mul": (norm_act._silu_and_mul_kernel, dict(BLOCK=norm_act.ACT_BLOCK)),
        # one fp8 row's norm and SiLU-mul (layers/linear_methods.norm_first): in the decode chain's PDL
        "add-rms-norm-pdl": (norm_act._rms_norm_kernel, dict(HAS_RESIDUAL=True, BLOCK=4096, PDL=True), {},
                             dict(num_warps=8, launch_pdl=True)),
        "silu-and-mul-pdl": (norm_act._silu_and_mul_kernel, dict(BLOCK=norm_act.ACT_BLOCK, PDL=True), {},
                             dict(launch_pdl=True)),
        # before fp8's W8A8 GEMMs (17+ rows): e4m3 out, a scale a row (or a row and 128 inputs: "groups")
        "add-rms-norm-quant": (norm_quant._rms_norm_quant_kernel,
                               dict(HAS_RESIDUAL=True, GROUP=0, BLOCK=4096),
                               {"q_ptr": "*fp8e4nv", "scale_ptr": "*fp32"}, dict(num_warps=8)),
        "silu-mul-quant": (norm_quant._silu_mul_quant_kernel,
                           dict(GROUP=0, BLOCK=norm_quant.ROW_BLOCK, WHOLE_ROW=True),
                           {"q_ptr": "*fp8e4nv", "scale_ptr": "*fp32"}, silu_quant_warps),
        "add-rms-norm-float16": (norm_quant._rms_norm_quant_kernel,
                                 dict(HAS_RESIDUAL=True, GROUP=0, BLOCK=4096, FLOAT16=True),
                                 {"q_ptr": "*fp16", "scale_ptr": "*fp32"}, dict(num_warps=8)),
        "silu-mul-float16": (norm_quant._silu_mul_quant_kernel,
                             dict(GROUP=0, BLOCK=norm_quant.ROW_BLOCK, WHOLE_ROW=True, FLOAT16=True),
                             {"q_ptr": "*fp16", "scale_ptr": "*fp32"}, silu_quant_warps),
        "add-rms-norm-quant-groups": (norm_quant._rms_norm_quant_kernel,
                                      dict(HAS_RESIDUAL=True, GROUP=128, BLOCK=4096),
                                      {"q_ptr": "*fp8e4nv", "scale_ptr": "*fp32"}, dict(num_warps=8)),
        "silu-mul-quant-groups": (norm_quant._silu_mul_quant_kernel,
                                  dict(GROUP=128, BLOCK=norm_quant.ACT_BLOCK, WHOLE_ROW=False),
                                  {"q_ptr": "*fp8e4nv", "scale_ptr": "*fp32"}),
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
        **linear_cases(),
        **moe_cases(),
    }
