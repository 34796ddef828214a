"""runner/warm_up.py builds each linear method's folded kernels (the RMSNorm or SiLU-mul inside the
few-row kernel) before the decode graphs are captured. Their activations are in the model's dtype, not the
weight's: with fp8 weights (quantization="fp8") the one-row fp8 kernels are built with bf16 / fp32 rows.
On the CPU through Triton's interpreter; on CUDA with TRITON_INTERPRET=0."""

import pytest
import torch
from conftest import triton_test_device

pytest.importorskip("triton")

from nanovllm.kernels import fp8_skinny  # noqa: E402
from nanovllm.layers.fp8 import Fp8ScaledMmLinearMethod  # noqa: E402
from nanovllm.layers.linear import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from nanovllm.runner import warm_up  # noqa: E402
from nanovllm.utils.config_checks import Fp8Scheme  # noqa: E402

DEVICE = triton_test_device()


def test_the_fp8_folds_are_built_with_rows_in_the_models_dtype(monkeypatch):
    seen = []
    for name in ("fp8_skinny_norm_linear", "fp8_skinny_silu_linear"):
        kernel = getattr(fp8_skinny, name)
        monkeypatch.setattr(fp8_skinny, name,
                            lambda x, *args, kernel=kernel, name=name: seen.append((name, x.dtype)) or
                            kernel(x, *args))
    method = Fp8ScaledMmLinearMethod(Fp8Scheme(None, serialized=False))  # quantized at load, per channel
    torch.manual_seed(0)
    with torch.device(DEVICE):
        up = ColumnParallelLinear(128, 192, quant_method=method)
        down = RowParallelLinear(128, 64, quant_method=method)
    for layer in (up, down):
        layer.weight.data.normal_(std=0.1)
        method.process_weights_after_loading(layer)
        assert layer.weight.dtype == torch.float8_e4m3fn
        warm_up._fused_variants(layer, torch.float32)
    # The norm fold with and without a residual, then the SiLU-mul fold; every row float32.
    norm, silu = ("fp8_skinny_norm_linear", torch.float32), ("fp8_skinny_silu_linear", torch.float32)
    assert seen == [norm, norm, silu]
