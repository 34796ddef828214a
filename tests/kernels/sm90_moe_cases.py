"""The mixture-of-experts kernels' cases for sm90_cases.cases(): routing, alignment and the grouped GEMMs
over bf16 and fp8 experts (widened to bf16, to float16 over float16 rows, or W8A8), at Qwen3-30B-A3B's
shapes (top-8 of 128 experts; the 256-row configs where a case says so)."""

# fp8 experts' weights, and their activations as float16 rows with a scale a row (W8A16 in float16) or as
# e4m3 with scales (W8A8).
FP8_EXPERTS = {"w_ptr": "*fp8e4nv"}
F16_ROWS = {"w_ptr": "*fp8e4nv", "a_ptr": "*fp16", "a_scale_ptr": "*fp32"}
E4M3_ROWS = {"w_ptr": "*fp8e4nv", "a_ptr": "*fp8e4nv", "a_scale_ptr": "*fp32"}


# The grouped GEMM's constexprs: gate/up reads x (a row a token, top-8 slots each) and gates; down reads
# the intermediate (a row a slot) and multiplies the routing weights. fp8 experts widened to bf16, one
# scale a row, 64-column tiles, unless a case says otherwise.
GEMM = dict(W_FP8=True, A_FP8=False, GROUP=0, BLOCK_N=64, SWAP_AB=False, DOT_PRECISION="tf32")
F16_256_ROWS = dict(A_F16=True, BLOCK_M=32, BLOCK_K=128, SWAP_AB=True)
PREFILL = dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=128)
PREFILL_LAUNCH = dict(num_warps=8, num_stages=3)


def gate_up(**changes) -> dict:
    return {**GEMM, "A_ROWS_PER_SLOT_DIV": 8, "GATED": True, "MUL_ROUTED_WEIGHT": False, **changes}


def down(**changes) -> dict:
    return {**GEMM, "A_ROWS_PER_SLOT_DIV": 1, "GATED": False, "MUL_ROUTED_WEIGHT": True, **changes}


def moe_cases() -> dict:
    """name: (kernel, constexprs[, pointer types[, launch options]]), as sm90_cases.cases()."""
    from nanovllm.kernels import float16_rows, fused_moe, moe_align, moe_routing

    return {
        "moe-topk-softmax": (moe_routing._topk_softmax_kernel,
                             dict(TOP_K=8, K_PAD=8, E_PAD=128, BLOCK_T=32, RENORMALIZE=True)),
        "moe-count": (moe_align._count_kernel, dict(E_PAD=128, BLOCK_S=32)),
        "moe-chunk-scan": (moe_align._chunk_scan_kernel, dict(E_PAD=128, BLOCK=1024)),
        "moe-scatter": (moe_align._scatter_kernel,
                        dict(E_PAD=128, BLOCK_M=16, BLOCK_S=32, LABEL_ROWS=32, COUNT_HERE=False,
                             SUM_HERE=False, CHUNKS_PAD=128)),
        "moe-scatter-summed": (moe_align._scatter_kernel,
                               dict(E_PAD=128, BLOCK_M=16, BLOCK_S=32, LABEL_ROWS=32, COUNT_HERE=False,
                                    SUM_HERE=True, CHUNKS_PAD=64), {}, dict(num_warps=8)),
        "moe-align-one-launch": (moe_align._scatter_kernel,
                                 dict(E_PAD=128, BLOCK_M=16, BLOCK_S=64, LABEL_ROWS=32, COUNT_HERE=True,
                                      SUM_HERE=False, CHUNKS_PAD=1)),
        "moe-gate-up": (fused_moe._grouped_gemm_kernel, gate_up(W_FP8=False, BLOCK_M=16, BLOCK_K=128)),
        "moe-down": (fused_moe._grouped_gemm_kernel, down(W_FP8=False, BLOCK_M=64, BLOCK_N=128, BLOCK_K=64)),
        # fp8 experts: e4m3 weights widened in registers, 128x128 block scales or one a row.
        "moe-gate-up-fp8-block": (fused_moe._grouped_gemm_kernel, gate_up(GROUP=128, BLOCK_M=16, BLOCK_K=128),
                                  FP8_EXPERTS),
        "moe-down-fp8-channel": (fused_moe._grouped_gemm_kernel, down(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64),
                                 FP8_EXPERTS),
        # fp8 experts widened in registers with the weight tile as wgmma's 64-row operand.
        "moe-gate-up-fp8-channel-swap-ab": (fused_moe._grouped_gemm_kernel,
                                            gate_up(BLOCK_M=16, BLOCK_K=128, SWAP_AB=True), FP8_EXPERTS),
        # fp8 experts widened to float16 over float16 rows (bf16 x times a power of two a row, exactly), at
        # the 256-row config.
        "moe-gate-up-fp8-f16-channel": (fused_moe._grouped_gemm_kernel, gate_up(**F16_256_ROWS), F16_ROWS),
        "moe-gate-up-fp8-f16-block": (fused_moe._grouped_gemm_kernel, gate_up(**F16_256_ROWS, GROUP=128),
                                      F16_ROWS),
        "moe-down-fp8-f16-channel": (fused_moe._grouped_gemm_kernel, down(**F16_256_ROWS), F16_ROWS),
        "float16-rows": (float16_rows._float16_rows_kernel, dict(BLOCK=1024), {"out_ptr": "*fp16"}),
        # W8A8 experts: the activations quantized to e4m3 as well, both operands on fp8 tensor cores.
        "moe-gate-up-w8a8-block": (fused_moe._grouped_gemm_kernel,
                                   gate_up(A_FP8=True, GROUP=128, BLOCK_M=32, BLOCK_K=128, SWAP_AB=True),
                                   E4M3_ROWS),
        "moe-down-w8a8-channel": (fused_moe._grouped_gemm_kernel,
                                  down(A_FP8=True, BLOCK_M=16, BLOCK_K=128, SWAP_AB=True), E4M3_ROWS),
        # moe_launch's prefill tiles (_prefill_tiles): 256 columns for bf16 and W8A8 with a scale a row, 128
        # for W8A8 with 128 x 128 blocks (256 spill there).
        "moe-gate-up-prefill": (fused_moe._grouped_gemm_kernel,
                                gate_up(W_FP8=False, **{**PREFILL, "BLOCK_K": 64}), {}, PREFILL_LAUNCH),
        "moe-gate-up-w8a8-prefill": (fused_moe._grouped_gemm_kernel, gate_up(A_FP8=True, **PREFILL),
                                     E4M3_ROWS, PREFILL_LAUNCH),
        # the same with MoeConfig.fast_accum: the e4m3 dots chained over the whole K
        "moe-gate-up-w8a8-prefill-fast-accum": (fused_moe._grouped_gemm_kernel,
                                                gate_up(A_FP8=True, FAST_ACCUM=True, **PREFILL), E4M3_ROWS,
                                                PREFILL_LAUNCH),
        "moe-gate-up-w8a8-block-prefill": (fused_moe._grouped_gemm_kernel,
                                           gate_up(A_FP8=True, GROUP=128, **{**PREFILL, "BLOCK_N": 128}),
                                           E4M3_ROWS, PREFILL_LAUNCH),
    }
