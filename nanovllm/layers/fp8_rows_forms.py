"""fp8's few-row kernels over rows the kernel before writes for them (the forms fp8_methods picks with
FLOAT16_ROWS and W8A8_ROWS).

Float16 rows: bf16 activations written as float16 times a power of two a row, exactly (bf16's significand
fits float16's; kernels/float16_rows.py), so that the rows kernel widens its e4m3 weight tiles to float16
(one conversion a pair, where widening to bf16 takes three instructions) and multiplies each row's sums by
its scale at the end: the bf16 form's products and sums, bit for bit (W8A16).

e4m3 rows: the activations quantized to e4m3, a scale a row (W8A8: the rounding of the GEMMs past the bucket
and of the CPU's reference), which the rows kernel multiplies by the e4m3 tiles in fp8 dots, nothing
widened.

Either way the RMSNorm before q/k/v and gate/up and the SiLU-mul before down write the rows and their
scales themselves (kernels/norm_quant.py: no launch added); other inputs (o_proj's) take a float16_rows or
quantize_rows launch first."""

from collections.abc import Callable

import torch

from nanovllm.layers.linear_methods import Kernel, NormedKernel, SiluKernel, norm_first, silu_first

# (rows, weight, weight_scale, group, bias, pdl, x_scale, out_dtype) -> the rows kernel's output
RowsLaunch = Callable[..., torch.Tensor]
# (x, weight_scale) -> whether a call can run over the form's rows
Takes = Callable[[torch.Tensor, torch.Tensor], bool]


def rows_forms(fallback: Kernel, launch: RowsLaunch, takes: Takes, e4m3: bool = False
               ) -> tuple[Kernel, NormedKernel, SiluKernel]:
    """A few-row bucket's plain, norm and SiLU-mul kernels over float16 rows, or e4m3 rows with `e4m3`:
    `launch` runs the rows kernel over them; a call `takes` refuses (float32 activations, which float16
    cannot hold exactly; weights without what the launch needs) runs `fallback`, the bucket's plain form,
    with its norm and SiLU-mul in their own kernels first."""
    fallback_norm, fallback_silu = norm_first(fallback), silu_first(fallback)
    float16 = not e4m3

    def plain(x, weight, weight_scale, group, bias, pdl=False):
        if not takes(x, weight_scale):
            return fallback(x, weight, weight_scale, group, bias, pdl)
        if e4m3:
            from nanovllm.kernels.fp8_gemm import quantize_rows
            rows, scale = quantize_rows(x, x.shape[1])
        else:
            from nanovllm.kernels.float16_rows import float16_rows
            rows, scale = float16_rows(x)
        return launch(rows, weight, weight_scale, group, bias, pdl, scale, x.dtype)

    def norm(x, norm_weight, eps, weight, weight_scale, group, bias, residual, pdl=False):
        if not takes(x, weight_scale):
            return fallback_norm(x, norm_weight, eps, weight, weight_scale, group, bias, residual, pdl)
        from nanovllm.kernels.norm_quant import rms_norm_quant
        rows, scale, summed = rms_norm_quant(x, norm_weight, eps, residual, float16=float16)
        return launch(rows, weight, weight_scale, group, bias, pdl, scale, x.dtype), summed

    def silu(x, weight, weight_scale, group, bias, pdl=False):
        if not takes(x, weight_scale):
            return fallback_silu(x, weight, weight_scale, group, bias, pdl)
        from nanovllm.kernels.norm_quant import silu_mul_quant
        rows, scale = silu_mul_quant(x, float16=float16)
        return launch(rows, weight, weight_scale, group, bias, pdl, scale, x.dtype)

    plain.__name__ = f"{fallback.__name__}_{'e4m3' if e4m3 else 'f16'}"
    norm.__name__, silu.__name__ = f"{plain.__name__}_norm", f"{plain.__name__}_silu"
    return plain, norm, silu
