"""The fp8 linear methods of CUDA GPUs (layers/fp8.py has the layout and the dequantizing reference,
Fp8LinearMethod): which kernel a call takes by its row count on Ada and Hopper, for each scale layout, and
`fp8_linear_method`, the choice for a device. GPU kernels are imported when first called (no Triton here).

- `Fp8TritonLinearMethod` (sm_89+): up to 16 rows the W8A16 GEMV (kernels/fp8_gemv.py: the weight
  streamed once in e4m3, activations unrounded), from 17 the W8A8 GEMM (kernels/fp8_gemm.py: the rounding
  of the reference, on fp8 tensor cores).
- `Fp8ScaledMmLinearMethod` (one scale a row, sm_90+): one row through bf16's GEMV over the e4m3 weight
  (kernels/fp8_skinny.py; the norm and SiLU-mul in their own kernels first), two through the few-row GEMV
  over it (W8A16, the activations unrounded), 3 to W8A8_ROWS_MAX through the rows kernel over e4m3 rows
  (W8A8, fp8 dots: layers/fp8_rows_forms.py), then torch._scaled_mm; from 3 rows the norm or SiLU-mul
  before the product writes e4m3 and its scales directly (kernels/norm_quant.py).
- `Fp8BlockScaledMmLinearMethod` (128 x 128 blocks, sm_90): one row through a GEMV with a scale a run of
  each tile, 2-16 rows through bf16's rows kernel over float16 rows with each tile's product times its
  block's scale (both kernels/fp8_skinny.py), then torch's block-scaled GEMM."""

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.layers.fp8 import Fp8LinearMethod, block_scales, fp8_dequant_linear
from nanovllm.layers.fp8_rows_forms import rows_forms
from nanovllm.layers.linear_methods import Bucket, gated_forms, norm_first, rms_norm_kernel, silu_first
from nanovllm.layers.norm_act import silu_and_mul
from nanovllm.utils.config_checks import Fp8Scheme

# Whether fp8's few-row buckets (128 x 128 blocks 2-16 rows; per channel 3-16 without W8A8_ROWS) run the
# rows kernel over bf16 activations as float16 rows times powers of two (exact), so that e4m3 tiles widen
# to float16: 16 streams of Qwen3-8B with fp8 weights 4.97 / 4.98 ms a step against 5.27 / 5.27 (H200,
# 2026-12-05, per channel, before W8A8_ROWS).
FLOAT16_ROWS = True
# Whether per-channel fp8's bucket from 3 rows quantizes its activations to e4m3 rows instead (W8A8, the
# rounding of the rows past it), so that the rows kernel multiplies in fp8 dots, no tile widened (sm_90
# SASS: 87 instructions a K tile against 183). Qwen3-8B, fp8 weights, one H100, 2026-12-05, each way in
# one call: 16 streams 5.269 / 5.280 ms a step against 5.585 / 5.587; 8 streams 4.730 against 5.075; 4
# streams 4.559 against 5.058. Block-scaled weights keep float16 rows (their activations would need a
# scale a 128 inputs).
W8A8_ROWS = True
# The most rows that bucket takes (to 128, x padded to a power of two). Qwen3-8B, one H100: its projections
# 98.0 / 103.7 / 125.0 us a layer at 32 / 64 / 128 rows against torch._scaled_mm's 114.3 / 114.1 / 116.4;
# 32 streams 6.54 ms a step against 6.91 at 16, 64 streams 8.83 against 9.00 (bench.py within 0.1%).
W8A8_ROWS_MAX = 64
FP8_GEMV_MAX_ROWS = 16  # kernels/fp8_gemv.MAX_ROWS (no Triton imported here)
# Whether one-row buckets take the SiLU-mul as gate/up's epilogue (linear_methods.gated_forms): one stream of
# Qwen3-8B, H100, 2026-12-05: a tie per channel (3.622 / 3.624 ms a token), a loss in blocks (3.923 / 4.173).
FP8_GATED_EPILOGUE = False


# The GPU kernels, under the names the kernel table prints (imported when first called: no Triton here).
def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, group: int,
             bias: torch.Tensor | None, pdl: bool = False) -> torch.Tensor:
    from nanovllm.kernels.fp8_gemv import fp8_gemv_linear
    return fp8_gemv_linear(x, weight, weight_scale, group, bias, pdl)


def fp8_skinny(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, group: int,
               bias: torch.Tensor | None, pdl: bool = False) -> torch.Tensor:
    from nanovllm.kernels.fp8_skinny import fp8_skinny_linear
    return fp8_skinny_linear(x, weight, weight_scale, group, bias, pdl)


def fp8_skinny_gated(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, group: int,
                     bias: torch.Tensor | None, pdl: bool = False) -> torch.Tensor:
    """silu(gate) * up of fp8_skinny's product, the SiLU-mul its epilogue (linear_methods.gated_forms)."""
    from nanovllm.kernels.fp8_skinny import fp8_skinny_linear
    return fp8_skinny_linear(x, weight, weight_scale, group, bias, pdl, gated=True)


def fp8_gemv_blocks(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, group: int,
                    bias: torch.Tensor | None, pdl: bool = False) -> torch.Tensor:
    blocks = getattr(weight_scale, "blocks", None)  # Fp8BlockScaledMmLinearMethod's compact scales
    if blocks is None:  # a layer whose scales are not whole 128 x 128 blocks
        return fp8_gemv(x, weight, weight_scale, group, bias, pdl)
    from nanovllm.kernels.fp8_skinny import fp8_block_gemv_linear
    return fp8_block_gemv_linear(x, weight, blocks, BLOCK_SCALED_MM_BLOCK, bias, pdl)


def fp8_gemv_blocks_gated(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, group: int,
                          bias: torch.Tensor | None, pdl: bool = False) -> torch.Tensor:
    """silu(gate) * up of fp8_gemv_blocks' product in the block GEMV's epilogue (gated_forms)."""
    blocks = getattr(weight_scale, "blocks", None)
    if blocks is None:
        from nanovllm.kernels import norm_act
        return norm_act.silu_and_mul(fp8_gemv(x, weight, weight_scale, group, bias, pdl), pdl)
    from nanovllm.kernels.fp8_skinny import fp8_block_gemv_linear
    return fp8_block_gemv_linear(x, weight, blocks, BLOCK_SCALED_MM_BLOCK, bias, pdl, gated=True)


def fp8_rows_blocks(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, group: int,
                    bias: torch.Tensor | None, pdl: bool = False) -> torch.Tensor:
    blocks = getattr(weight_scale, "blocks", None)
    if blocks is None or x.dtype == torch.float32:  # no whole blocks; float32's dot would run as TF32
        return fp8_gemv(x, weight, weight_scale, group, bias, pdl)
    return _rows_blocks_launch(x, weight, weight_scale, group, bias, pdl, None, None)


def fp8_gemv_rows(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, group: int,
                  bias: torch.Tensor | None, pdl: bool = False) -> torch.Tensor:
    from nanovllm.kernels.fp8_skinny import fp8_gemv_rows_linear
    # A plain launch: as a programmatic dependent it took 13.0 / 31.0 us at Qwen3-8B's o and down against
    # 9.4 / 20.1 plain (q/k/v and gate/up the same either way; H200, graph-timed back to back).
    return fp8_gemv_rows_linear(x, weight, weight_scale, group, bias, pdl=False)


def fp8_rows(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, group: int,
             bias: torch.Tensor | None, pdl: bool = False) -> torch.Tensor:
    if x.dtype == torch.float32:  # the rows kernel's dot would round float32 to TF32
        few = x.shape[0] <= FP8_GEMV_MAX_ROWS
        return (fp8_gemv if few else fp8_scaled_mm)(x, weight, weight_scale, group, bias, pdl)
    return _rows_launch(x, weight, weight_scale, group, bias, pdl, None, None)


def _rows_launch(rows, weight, weight_scale, group, bias, pdl, x_scale, out_dtype) -> torch.Tensor:
    from nanovllm.kernels.fp8_skinny import fp8_rows_linear
    return fp8_rows_linear(rows, weight, weight_scale, group, bias, pdl, x_scale, out_dtype,
                           getattr(weight, "split_counters", None))


def _rows_blocks_launch(rows, weight, weight_scale, group, bias, pdl, x_scale, out_dtype) -> torch.Tensor:
    from nanovllm.kernels.fp8_skinny import fp8_rows_block_linear
    return fp8_rows_block_linear(rows, weight, weight_scale.blocks, BLOCK_SCALED_MM_BLOCK, bias, pdl, x_scale,
                                 out_dtype, getattr(weight, "split_counters", None))


# The few-row buckets over e4m3 rows (W8A8_ROWS: bf16 or float16 activations, float32 ones keep fp8_rows)
# and over float16 rows (FLOAT16_ROWS; layers/fp8_rows_forms.py): bf16 activations only
# (float16 rows hold bf16 exactly, not float32), block-scaled weights with their compact blocks.
fp8_rows_f16, fp8_rows_f16_norm, fp8_rows_f16_silu = rows_forms(
    fp8_rows, _rows_launch, lambda x, _: x.dtype == torch.bfloat16)
fp8_rows_e4m3, fp8_rows_e4m3_norm, fp8_rows_e4m3_silu = rows_forms(
    fp8_rows, _rows_launch, lambda x, _: x.dtype in (torch.bfloat16, torch.float16), e4m3=True)
fp8_rows_blocks_f16, fp8_rows_blocks_f16_norm, fp8_rows_blocks_f16_silu = rows_forms(
    fp8_rows_blocks, _rows_blocks_launch,
    lambda x, scale: x.dtype == torch.bfloat16 and getattr(scale, "blocks", None) is not None)


def fp8_gemm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, group: int,
             bias: torch.Tensor | None, pdl: bool = False) -> torch.Tensor:
    from nanovllm.kernels.fp8_gemm import w8a8_block_k, w8a8_linear
    if w8a8_block_k(group, x.shape[1]) is None:  # groups no fp8 dot tiles (16 wide): the same rounding, slow
        return fp8_dequant_linear(x, weight, weight_scale, group, bias)
    return w8a8_linear(x, weight, weight_scale, group, bias)  # a plain launch: many rows gain little by PDL


def fp8_scaled_mm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, group: int,
                  bias: torch.Tensor | None, pdl: bool = False) -> torch.Tensor:
    from nanovllm.kernels.fp8_scaled_mm import scaled_mm_linear
    return scaled_mm_linear(x, weight, weight_scale, group, bias)


def fp8_scaled_mm_norm(x, norm_weight, eps, weight, weight_scale, group, bias, residual, pdl=False
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8_scaled_mm of rms_norm(x + residual), the norm writing e4m3 straight away (kernels/norm_quant.py:
    one kernel and no model-dtype copy where norm and quantize_rows took two; the same bits)."""
    from nanovllm.kernels import fp8_scaled_mm, norm_quant
    if not fp8_scaled_mm.scaled_mm_takes(x, weight, group):
        normed, summed = rms_norm_kernel(x, norm_weight, eps, residual)
        return fp8_scaled_mm.scaled_mm_linear(normed, weight, weight_scale, group, bias), summed
    q, scale, summed = norm_quant.rms_norm_quant(x, norm_weight, eps, residual)
    return fp8_scaled_mm.scaled_mm_quantized(q, scale, weight, weight_scale, bias, x.dtype), summed


def fp8_scaled_mm_silu(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, group: int,
                       bias: torch.Tensor | None, pdl: bool = False) -> torch.Tensor:
    """fp8_scaled_mm of silu(gate) * up, the SiLU-mul writing e4m3 straight away (kernels/norm_quant.py)."""
    from nanovllm.kernels import fp8_scaled_mm, norm_quant
    if not fp8_scaled_mm.scaled_mm_takes(x, weight, group):
        return fp8_scaled_mm.scaled_mm_linear(silu_and_mul(x), weight, weight_scale, group, bias)
    return fp8_scaled_mm.scaled_mm_quantized(*norm_quant.silu_mul_quant(x), weight, weight_scale, bias,
                                             x.dtype)


def fp8_block_scaled_mm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, group: int,
                        bias: torch.Tensor | None, pdl: bool = False) -> torch.Tensor:
    blocks = getattr(weight_scale, "blocks", None)  # Fp8BlockScaledMmLinearMethod's compact scales
    if blocks is None:  # a layer whose scales are not whole 128 x 128 blocks
        return fp8_gemm(x, weight, weight_scale, group, bias, pdl)
    from nanovllm.kernels.fp8_scaled_mm import block_scaled_mm_linear
    return block_scaled_mm_linear(x, weight, blocks, bias)


def fp8_block_scaled_mm_norm(x, norm_weight, eps, weight, weight_scale, group, bias, residual, pdl=False
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8_block_scaled_mm of rms_norm(x + residual), the norm writing e4m3 a scale a row and 128 inputs,
    its rows padded and its scales laid out as torch's block-scaled GEMM takes them (kernels/norm_quant.py:
    one kernel where norm and quantize_rows took two; the same bits)."""
    blocks = getattr(weight_scale, "blocks", None)
    if blocks is None:
        normed, summed = rms_norm_kernel(x, norm_weight, eps, residual)
        return fp8_block_scaled_mm(normed, weight, weight_scale, group, bias), summed
    from nanovllm.kernels import fp8_scaled_mm, norm_quant
    q, scale, summed = norm_quant.rms_norm_quant(x, norm_weight, eps, residual, BLOCK_SCALED_MM_BLOCK[1],
                                                 pad_rows=4)
    out = fp8_scaled_mm.block_scaled_mm_quantized(q, scale, weight, blocks, bias, x.dtype)
    return out[: x.shape[0]], summed


def fp8_block_scaled_mm_silu(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, group: int,
                             bias: torch.Tensor | None, pdl: bool = False) -> torch.Tensor:
    """fp8_block_scaled_mm of silu(gate) * up, the SiLU-mul writing e4m3 as fp8_block_scaled_mm_norm's."""
    blocks = getattr(weight_scale, "blocks", None)
    if blocks is None:
        return fp8_block_scaled_mm(silu_and_mul(x), weight, weight_scale, group, bias)
    from nanovllm.kernels import fp8_scaled_mm, norm_quant
    q, scale = norm_quant.silu_mul_quant(x, BLOCK_SCALED_MM_BLOCK[1], pad_rows=4)
    return fp8_scaled_mm.block_scaled_mm_quantized(q, scale, weight, blocks, bias, x.dtype)[: x.shape[0]]


class Fp8TritonLinearMethod(Fp8LinearMethod):
    """Fp8LinearMethod on CUDA GPUs with fp8 tensor cores (sm_89+: FP8_MIN_CAPABILITY): decode-sized calls
    through the W8A16 GEMV (the e4m3 weight streamed once: half a bf16 weight's bytes), larger ones through
    the W8A8 block-scaled GEMM. The 16-row boundary is the GEMV's limit, not a measurement. Graph-timed on an
    H200 at Qwen3-8B's shapes that GEMV took 1.1-3.4x bf16's time at 1 and 16 rows
    (scripts/fp8_gemm_bench.py; docs/performance-notes.md, "fp8 weights")."""

    BUCKETS = (Bucket(FP8_GEMV_MAX_ROWS, fp8_gemv), Bucket(None, fp8_gemm))


class Fp8ScaledMmLinearMethod(Fp8TritonLinearMethod):
    """Per-channel fp8 (quantization="fp8", per-channel and per-tensor checkpoints) on sm_90+. One row:
    bf16's GEMV over the e4m3 weight (kernels/fp8_skinny.py: 1.5-1.8x faster than bf16's GEMV at Qwen3-8B's
    shapes, where fp8_gemv took 1.3-3.4x bf16's time), the RMSNorm and SiLU-mul in their own kernels first:
    folded in, as bf16 has them, they made it as slow as bf16 (one-stream Qwen3-8B fp8 4.57 ms a token
    against bf16's 4.62). Those kernels launch as programmatic dependents, so that the chain overlaps as
    the GEMVs' does (linear_methods.norm_first; not yet timed against plain launches). Two rows: the CUDA-core
    few-row GEMV over the e4m3 weight (kernels/gemv_rows.py); 3 to W8A8_ROWS_MAX: bf16's rows kernel over
    it with fp8's own tiles (fp8_skinny.fp8_rows_config), the activations as e4m3 rows (W8A8_ROWS). Beyond,
    torch._scaled_mm with row-wise scales (cuBLASLt / CUTLASS, what vLLM runs for this scaling): 0.56-0.72x
    of bf16 cuBLAS's time at 4,096 rows, where the Triton GEMM took 0.8-1.13x (2026-12-03, H200,
    graph-timed); from 3 rows the RMSNorm before q/k/v and gate/up and the SiLU-mul before down quantize
    their own output (kernels/norm_quant.py: the bits of the norm, then quantize_rows, in one kernel)."""

    BUCKETS = (Bucket(1, fp8_skinny, norm_first(fp8_skinny), silu_first(fp8_skinny),
                      *gated_forms(FP8_GATED_EPILOGUE, fp8_skinny_gated)),
               Bucket(2, fp8_gemv_rows),
               Bucket(W8A8_ROWS_MAX, fp8_rows_e4m3, fp8_rows_e4m3_norm, fp8_rows_e4m3_silu) if W8A8_ROWS
               else Bucket(16, fp8_rows_f16, fp8_rows_f16_norm, fp8_rows_f16_silu) if FLOAT16_ROWS
               else Bucket(16, fp8_rows),
               Bucket(None, fp8_scaled_mm, fp8_scaled_mm_norm, fp8_scaled_mm_silu))


class Fp8BlockScaledMmLinearMethod(Fp8TritonLinearMethod):
    """128 x 128 block-scaled checkpoints (Qwen's FP8 releases) on sm_90 where torch has its block-scaled
    GEMM. One row: a GEMV whose tiles are runs inside one block, a scale a run (kernels/fp8_block_gemv.py;
    one stream of Qwen3-8B 3.63 ms a token, 4.53 with x times each block row's scales first and bf16's
    GEMV after, 8.33 through kernels/fp8_gemv.py; per-channel weights 3.09: H200, 2026-12-04). 2-16 rows:
    bf16's rows kernel over the e4m3 weight, each tile's product times its block's scale (at five rows of
    Qwen3-8B's shapes 15.3 / 11.6 / 49.9 / 24.7 us against fp8_gemv's 20.8 / 19.3 / 48.0 / 47.3), float32
    activations through fp8_gemv. From 17, torch.nn.functional.scaled_mm with 1 x 128 activation and 128 x
    128 weight scales (cuBLASLt). Graph-timed on an H200 at Qwen3-8B's shapes it took 0.4-0.5x the Triton
    block GEMM's time at 256 and 4,096 rows, about bf16 cuBLAS's (relative error 2.7-3.0e-3 against the
    dequantized product). The compact scales the three need sit on the weight_scale parameter (`blocks`);
    a layer without whole blocks keeps the Triton kernels. One row's norm and SiLU-mul run as per-channel
    fp8's do: their own kernels, chained to the GEMV as programmatic dependents; from 17 rows they write
    e4m3 and the GEMM's activation scales themselves (kernels/norm_quant.py), as per channel's do."""

    BUCKETS = (Bucket(1, fp8_gemv_blocks, norm_first(fp8_gemv_blocks), silu_first(fp8_gemv_blocks),
                      *gated_forms(FP8_GATED_EPILOGUE, fp8_gemv_blocks_gated)),
               Bucket(16, fp8_rows_blocks_f16, fp8_rows_blocks_f16_norm, fp8_rows_blocks_f16_silu)
               if FLOAT16_ROWS else Bucket(16, fp8_rows_blocks),
               Bucket(None, fp8_block_scaled_mm, fp8_block_scaled_mm_norm, fp8_block_scaled_mm_silu))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        super().process_weights_after_loading(layer)
        layer.weight_scale.blocks = block_scales(layer.weight_scale.data, layer.weight, self.scheme.block)


def block_scaled_mm_available() -> bool:
    """Whether this torch has the block-scaled GEMM (torch.nn.functional.scaled_mm, 1 x 128 and 128 x 128
    scaling types)."""
    scaling = getattr(F, "ScalingType", None)
    names = ("BlockWise1x128", "BlockWise128x128")
    return hasattr(F, "scaled_mm") and all(hasattr(scaling, name) for name in names)


# fp8 e4m3 tensor-core MMA (tl.dot of e4m3 operands) needs Ada (sm_89) or Hopper (sm_90) and later;
# torch._scaled_mm's row-wise scaling, Hopper.
FP8_MIN_CAPABILITY = (8, 9)
ROWWISE_SCALED_MM_MIN_CAPABILITY = (9, 0)
# The only block torch's block-scaled GEMM takes (the block of Qwen's and DeepSeek's checkpoints), and the
# architecture it was measured on (Hopper; elsewhere the Triton GEMM, which runs on any fp8 GPU).
BLOCK_SCALED_MM_BLOCK = (128, 128)
BLOCK_SCALED_MM_MAJOR = 9


def fp8_linear_method(scheme: Fp8Scheme, device: torch.device, pdl: bool = False,
                      capability: tuple[int, int] | None = None) -> Fp8LinearMethod:
    """The fp8 method for `device`: the Triton kernels' on a CUDA GPU of FP8_MIN_CAPABILITY or later (its
    capability read from the device when None), with torch._scaled_mm for per-channel scales on Hopper and
    torch's block-scaled GEMM for 128 x 128 blocks there; else the dequantizing reference."""
    if device.type != "cuda":
        return Fp8LinearMethod(scheme, pdl)
    capability = tuple(capability or torch.cuda.get_device_capability(device))
    if capability >= ROWWISE_SCALED_MM_MIN_CAPABILITY and scheme.block is None:
        return Fp8ScaledMmLinearMethod(scheme, pdl)
    if (capability[0] == BLOCK_SCALED_MM_MAJOR and scheme.block == BLOCK_SCALED_MM_BLOCK
            and block_scaled_mm_available()):
        return Fp8BlockScaledMmLinearMethod(scheme, pdl)
    method = Fp8TritonLinearMethod if capability >= FP8_MIN_CAPABILITY else Fp8LinearMethod
    return method(scheme, pdl)
