"""fp8 weights with static activation scales (utils/config_checks.Fp8Scheme.static_input): checkpoints that
carry a calibrated `input_scale` per layer (the "fp8" method's activation_scheme "static", AutoFP8's
layout; compressed-tensors' static per-tensor input activations). An activation is rounded to e4m3 as
x / input_scale, clamped to the e4m3 range, and the product scaled back, one scale for every token:

    y = (e4m3(x / s_in) @ weight^T) * s_in * weight_scale        (weight_scale per channel or tensor)

A fused projection (q/k/v, gate/up) reads one input_scale per checkpoint layer and keeps the largest:
its parts see the same input, and none then clips harder than it was calibrated to (vLLM does the same).

- `Fp8StaticLinearMethod`: the dequantizing reference (the CPU's, and CUDA GPUs' before Hopper).
- `Fp8StaticScaledMmLinearMethod` (sm_90+): up to 16 rows per-channel fp8's W8A16 kernels
  (layers/fp8_methods.py), which stream the e4m3 weight and leave the activations unrounded (a static
  scale exists to feed an fp8 GEMM; without one the product is closer to the float model's); from 17
  rows x rounded with the static scale, then torch._scaled_mm with per-row scales, as dynamic per-channel
  fp8 runs it."""

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.layers.fp8 import FP8, FP8_MAX, Fp8LinearMethod, dequantize
from nanovllm.layers.fp8_methods import (
    ROWWISE_SCALED_MM_MIN_CAPABILITY,
    fp8_gemv_rows,
    fp8_rows,
    fp8_skinny,
)
from nanovllm.layers.linear_methods import Bucket, Kernel, norm_first, silu_first
from nanovllm.utils.config_checks import Fp8Scheme


def quantize_static(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] as e4m3 with the one activation scale input_scale [1]: x / input_scale, clamped."""
    return (x.float() / input_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


# The kernels, under the names the kernel table prints: (x, weight, weight_scale, group, input_scale,
# bias, pdl) -> x @ weight^T (+ bias).
def fp8_static_dequant_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, group: int,
                              input_scale: torch.Tensor, bias: torch.Tensor | None, pdl: bool = False
                              ) -> torch.Tensor:
    rounded = (quantize_static(x, input_scale).float() * input_scale).to(x.dtype)
    return F.linear(rounded, dequantize(weight, weight_scale, group).to(x.dtype), bias)


def fp8_static_scaled_mm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, group: int,
                         input_scale: torch.Tensor, bias: torch.Tensor | None, pdl: bool = False
                         ) -> torch.Tensor:
    from nanovllm.kernels.fp8_scaled_mm import scaled_mm_quantized, scaled_mm_takes
    if not scaled_mm_takes(x, weight, group):
        return fp8_static_dequant_linear(x, weight, weight_scale, group, input_scale, bias)
    # Row-wise scaling (per-channel weight scales) wants one activation scale a row: the static one.
    row_scales = input_scale.expand(x.shape[0], 1).contiguous()
    q = quantize_static(x, input_scale)
    return scaled_mm_quantized(q, row_scales, weight, weight_scale, bias, x.dtype)


def unrounded(kernel: Kernel) -> Kernel:
    """A per-channel fp8 W8A16 kernel taking the static method's weights, its input scale unused."""

    @functools.wraps(kernel)  # its name in the kernel table, and __wrapped__
    def run(x, weight, weight_scale, group, input_scale, bias, pdl=False):
        return kernel(x, weight, weight_scale, group, bias, pdl)

    return run


def scalar_view(rows_of: Callable[[object], int]) -> Callable[..., torch.Tensor]:
    """An input_scale's checkpoint_view: [] or [1] -> [rows] (one copy for each output row of its part
    of a fused projection, which the layer's loader shards and places as a weight's rows)."""

    def view(loaded: torch.Tensor, shard_id: object = None) -> torch.Tensor:
        if loaded.numel() != 1:
            raise ValueError(f"fp8 input_scale of shape {tuple(loaded.shape)} is not one scale a layer")
        return loaded.float().reshape(1).expand(rows_of(shard_id)).contiguous()

    return view


class Fp8StaticLinearMethod(Fp8LinearMethod):
    """Static activation scales through the dequantizing reference (see the module docstring)."""

    BUCKETS = (Bucket(None, fp8_static_dequant_linear),)

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int,
                       weight_loader: Callable[..., None]) -> None:
        super().create_weights(layer, input_size, output_size, weight_loader)
        scale = nn.Parameter(torch.empty(output_size, dtype=torch.float32), requires_grad=False)
        scale.checkpoint_view = scalar_view(lambda shard_id: layer.checkpoint_shapes(scale)[shard_id][0])
        scale.weight_loader = weight_loader
        layer.input_scale = scale

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        super().process_weights_after_loading(layer)
        layer.input_scale = nn.Parameter(layer.input_scale.data.max().reshape(1), requires_grad=False)

    def weights(self, layer: nn.Module) -> tuple:
        return layer.weight, layer.weight_scale, self.group(layer), layer.input_scale


class Fp8StaticScaledMmLinearMethod(Fp8StaticLinearMethod):
    """Static activation scales on sm_90+ (see the module docstring): per-channel fp8's W8A16 kernels up
    to 16 rows, then torch._scaled_mm of x rounded with its static scale (the norm and SiLU-mul in their
    own kernels first)."""

    BUCKETS = (Bucket(1, unrounded(fp8_skinny), norm_first(unrounded(fp8_skinny)),
                      silu_first(unrounded(fp8_skinny))),
               Bucket(2, unrounded(fp8_gemv_rows)), Bucket(16, unrounded(fp8_rows)),
               Bucket(None, fp8_static_scaled_mm))


def static_linear_method(scheme: Fp8Scheme, device: torch.device, pdl: bool = False,
                         capability: tuple[int, int] | None = None) -> Fp8StaticLinearMethod:
    """The method for static activation scales on `device`: the kernels on CUDA GPUs with row-wise
    torch._scaled_mm (Hopper on; capability read from the device when None), else the reference."""
    if device.type == "cuda":
        capability = tuple(capability or torch.cuda.get_device_capability(device))
        if capability >= ROWWISE_SCALED_MM_MIN_CAPABILITY:
            return Fp8StaticScaledMmLinearMethod(scheme, pdl)
    return Fp8StaticLinearMethod(scheme, pdl)
