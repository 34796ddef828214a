"""The linear layers' matmul kernels' cases for sm90_cases.cases(): the one-row GEMV (bf16, fp8 per channel
and in 128 x 128 blocks), the few-row GEMV and the tensor-core rows kernel (over bf16, float16 rows or e4m3
rows), split-K's reduce, and the fp8 GEMMs and GEMV, at Qwen3-0.6B's shapes unless a case says otherwise."""

# fp8 weights (layers/fp8.py's layout): e4m3 [N, K] and float32 scales; the W8A8 GEMM's x is e4m3 too.
FP8_WEIGHT = {"w_ptr": "*fp8e4nv", "w_scale_ptr": "*fp32"}


def linear_cases() -> dict:
    """name: (kernel, constexprs[, pointer types[, launch options]]), as sm90_cases.cases()."""
    from nanovllm.kernels import (
        fp8_block_gemv,
        fp8_gemm,
        fp8_gemv,
        gemv_rows,
        skinny_gemm,
        skinny_rows,
        split_k,
    )

    cases = {
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
        # The SiLU-mul after gate/up as the GEMV's epilogue (kernels/gemv_folds.py): bf16 with the norm's
        # prologue too, and e4m3 with a scale a row (Qwen3-8B's gate/up launch: 16 x 256 tiles).
        "skinny-gemm-gated-add-rms-norm-pdl": (
            skinny_gemm._skinny_gemm_kernel,
            dict(BLOCK_N=16, BLOCK_K=256, HAS_BIAS=False, WRITE_PARTIAL=False, NUM_STAGES=4,
                 PROLOGUE=skinny_gemm.ADD_RMS_NORM.value, PDL=True, PRELOAD=2, GATED=True), {},
            dict(launch_pdl=True)),
        "skinny-gemm-fp8-gated-pdl": (
            skinny_gemm._skinny_gemm_kernel,
            dict(BLOCK_N=16, BLOCK_K=256, HAS_BIAS=False, WRITE_PARTIAL=False, NUM_STAGES=5, PDL=True,
                 PRELOAD=2, SCALED=True, GATED=True),
            FP8_WEIGHT, dict(launch_pdl=True)),
        # One row of a 128 x 128 block-scaled weight in one kernel (kernels/fp8_block_gemv.py): tiles of
        # runs inside one block, a scale a run.
        "fp8-block-gemv-pdl": (
            fp8_block_gemv._block_gemv_kernel,
            dict(BLOCK_N=16, GROUPS=2, WIDTH=128, ROWS=128, INPUTS=128, HAS_BIAS=False, WRITE_PARTIAL=False,
                 NUM_STAGES=5, PDL=True, PRELOAD=2),
            {"w_ptr": "*fp8e4nv", "scale_ptr": "*fp32"}, dict(launch_pdl=True)),
        "fp8-block-gemv-gated-pdl": (  # the SiLU-mul epilogue: a scale row a column (gate's and up's)
            fp8_block_gemv._block_gemv_kernel,
            dict(BLOCK_N=16, GROUPS=2, WIDTH=128, ROWS=128, INPUTS=128, HAS_BIAS=False, WRITE_PARTIAL=False,
                 NUM_STAGES=5, PDL=True, PRELOAD=2, GATED=True),
            {"w_ptr": "*fp8e4nv", "scale_ptr": "*fp32"}, dict(launch_pdl=True)),
        "fp8-block-gemv-split": (
            fp8_block_gemv._block_gemv_kernel,
            dict(BLOCK_N=4, GROUPS=8, WIDTH=128, ROWS=128, INPUTS=128, HAS_BIAS=True, WRITE_PARTIAL=True,
                 NUM_STAGES=3, PDL=False, PRELOAD=0),
            {"w_ptr": "*fp8e4nv", "scale_ptr": "*fp32"}),
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
        # W8A16 over float16 rows (layers/fp8_methods.FLOAT16_ROWS): x float16 with a scale a row, the
        # e4m3 tiles widened to float16; fp8_rows_config's 128-input tiles.
        "skinny-rows-fp8-f16": (skinny_rows._skinny_rows_kernel,
                                dict(ROWS_=16, BLOCK_N=64, BLOCK_K=128, HAS_BIAS=False, WRITE_PARTIAL=False,
                                     NUM_STAGES=4, PROLOGUE=skinny_rows.PLAIN.value, PDL=True, PRELOAD=2,
                                     SCALED=True, X_SCALED=True),
                                dict(FP8_WEIGHT, x_ptr="*fp16"), dict(num_warps=4, launch_pdl=True)),
        # W8A8 over e4m3 rows (layers/fp8_methods.W8A8_ROWS): fp8 dots, each tile's sum added in float32.
        "skinny-rows-fp8-e4m3": (skinny_rows._skinny_rows_kernel,
                                 dict(ROWS_=16, BLOCK_N=64, BLOCK_K=128, HAS_BIAS=False, WRITE_PARTIAL=False,
                                      NUM_STAGES=4, PROLOGUE=skinny_rows.PLAIN.value, PDL=True, PRELOAD=2,
                                      SCALED=True, X_SCALED=True),
                                 dict(FP8_WEIGHT, x_ptr="*fp8e4nv"), dict(num_warps=4, launch_pdl=True)),
        # Qwen3-8B's split e4m3 launches (q/k/v, o, down): each column block's last split sums the partials.
        "skinny-rows-fp8-e4m3-split-last": (skinny_rows._skinny_rows_kernel,
                                            dict(ROWS_=16, BLOCK_N=64, BLOCK_K=128, HAS_BIAS=False,
                                                 WRITE_PARTIAL=True, NUM_STAGES=4,
                                                 PROLOGUE=skinny_rows.PLAIN.value, PDL=True, PRELOAD=2,
                                                 SCALED=True, X_SCALED=True, LAST_SPLIT_SUMS=True),
                                            dict(FP8_WEIGHT, x_ptr="*fp8e4nv"),
                                            dict(num_warps=4, launch_pdl=True)),
        "skinny-rows-fp8-rows-kernel-tiles": (skinny_rows._skinny_rows_kernel,
                                              dict(ROWS_=16, BLOCK_N=64, BLOCK_K=128, HAS_BIAS=False,
                                                   WRITE_PARTIAL=False, NUM_STAGES=4,
                                                   PROLOGUE=skinny_rows.PLAIN.value, PDL=True, PRELOAD=2,
                                                   SCALED=True),
                                              FP8_WEIGHT, dict(num_warps=4, launch_pdl=True)),
        "skinny-rows-fp8-blocks-split": (  # 128 x 128 block scales: a tile's product times its block's
            skinny_rows._skinny_rows_kernel,
            dict(ROWS_=16, BLOCK_N=64, BLOCK_K=128, HAS_BIAS=False, WRITE_PARTIAL=True, NUM_STAGES=4,
                 PROLOGUE=skinny_rows.PLAIN.value, PDL=True, PRELOAD=2, SCALED=False, SCALE_GROUP=128,
                 SCALE_ROWS=128), FP8_WEIGHT, dict(num_warps=4, launch_pdl=True)),
        "skinny-rows-fp8-blocks-f16": (  # the same over float16 rows (fp8_methods.FLOAT16_ROWS)
            skinny_rows._skinny_rows_kernel,
            dict(ROWS_=16, BLOCK_N=64, BLOCK_K=128, HAS_BIAS=False, WRITE_PARTIAL=True, NUM_STAGES=4,
                 PROLOGUE=skinny_rows.PLAIN.value, PDL=True, PRELOAD=2, SCALED=False, SCALE_GROUP=128,
                 SCALE_ROWS=128, X_SCALED=True), dict(FP8_WEIGHT, x_ptr="*fp16"),
            dict(num_warps=4, launch_pdl=True)),
        "split-k-reduce": (split_k.split_k_reduce_kernel, dict(SPLIT_K=4, HAS_BIAS=True, BLOCK_N=128)),
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
                                     WRITE_PARTIAL=False, NUM_STAGES=3),
                                dict(FP8_WEIGHT, x_ptr="*fp8e4nv", x_scale_ptr="*fp32"), dict(num_warps=8)),
        "fp8-w8a8-gemm-channel": (fp8_gemm._w8a8_gemm_kernel,
                                  dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, ONE_GROUP=True, HAS_BIAS=False,
                                       WRITE_PARTIAL=False, NUM_STAGES=3),
                                  dict(FP8_WEIGHT, x_ptr="*fp8e4nv", x_scale_ptr="*fp32"), dict(num_warps=4)),
        "fp8-w8a8-gemm-split": (fp8_gemm._w8a8_gemm_kernel,
                                dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, ONE_GROUP=True, HAS_BIAS=True,
                                     WRITE_PARTIAL=True, NUM_STAGES=4),
                                dict(FP8_WEIGHT, x_ptr="*fp8e4nv", x_scale_ptr="*fp32", out_ptr="*fp32"),
                                dict(num_warps=4)),
        "fp8-gemv-block-pdl": (fp8_gemv._fp8_gemv_kernel,
                               dict(ROWS_=16, BLOCK_N=32, BLOCK_K=128, ONE_GROUP=False, HAS_BIAS=True,
                                    NUM_STAGES=4, DOT_PRECISION="tf32", PDL=True),
                               FP8_WEIGHT, dict(num_warps=4, launch_pdl=True)),
        "fp8-gemv-channel": (fp8_gemv._fp8_gemv_kernel,
                             dict(ROWS_=16, BLOCK_N=64, BLOCK_K=256, ONE_GROUP=True, HAS_BIAS=False,
                                  NUM_STAGES=4, DOT_PRECISION="tf32", PDL=False),
                             FP8_WEIGHT, dict(num_warps=4)),
    }
    # 17-64 rows (fp8_methods.W8A8_ROWS_MAX): the split launch above, x padded to 64 rows (wgmma m64n64k32).
    kernel, constexprs, *types = cases["skinny-rows-fp8-e4m3-split-last"]
    cases["skinny-rows-fp8-e4m3-64-rows"] = (kernel, dict(constexprs, ROWS_=64), *types)
    # skinny_rows.FAST_ACCUM at the kernel's widest x: the dots chained over the whole K.
    cases["skinny-rows-fp8-e4m3-128-rows-fast-accum"] = (kernel, dict(constexprs, ROWS_=128, FAST_ACCUM=True),
                                                          *types)
    return cases
