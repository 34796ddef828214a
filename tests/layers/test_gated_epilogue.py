"""The SiLU-mul folded into the gate/up projection's one-row GEMV as its epilogue (linear_methods'
gated_forms; kernels/gemv_folds.py): the kernel table says so (down_proj then plain), and
per-channel fp8's one-row gate/up gives the fp8 GEMV then the SiLU-mul bit for bit. The whole engine's
tokens with it: tests/runner/test_skinny_decode.py."""

import dataclasses
import os

import pytest
import torch
from conftest import triton_test_device
from transformers import AutoConfig

from nanovllm.layers import linear_methods
from nanovllm.layers.linear_methods import SkinnyLinearMethod

pytest.importorskip("triton")

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "configs")


def gated(method_class) -> tuple:
    """method_class's buckets with the first (one row) folding the SiLU-mul into gate/up's kernel, as
    linear_methods.gated_forms gives them where a method's switch is on."""
    from nanovllm.layers import fp8_methods

    forms = {"gemv": (linear_methods.gemv_gated, linear_methods.gemv_norm_gated),
             "fp8_skinny": (fp8_methods.fp8_skinny_gated, None),
             "fp8_gemv_blocks": (fp8_methods.fp8_gemv_blocks_gated, None)}
    one_row = method_class.BUCKETS[0]
    form, normed = linear_methods.gated_forms(True, *forms[one_row.plain.__name__])
    return (dataclasses.replace(one_row, gated=form, normed_gated=normed), *method_class.BUCKETS[1:])


def test_the_kernel_table_shows_the_silu_mul_in_gate_up(monkeypatch):
    from nanovllm.attention.triton_backend import TritonBackend
    from nanovllm.layers.fp8_methods import Fp8ScaledMmLinearMethod
    from nanovllm.layers.kernel_plan import KernelPlan, kernel_table
    from nanovllm.models.qwen3 import Qwen3ForCausalLM

    monkeypatch.setattr(SkinnyLinearMethod, "BUCKETS", gated(SkinnyLinearMethod))
    monkeypatch.setattr(Fp8ScaledMmLinearMethod, "BUCKETS", gated(Fp8ScaledMmLinearMethod))
    config = AutoConfig.from_pretrained(os.path.join(CONFIGS, "Qwen3-0.6B"))
    config.num_hidden_layers = 1
    for quantization, gate_up, down in ((None, "gemv_norm_gated", "gemv"),
                                        ("fp8", "fp8_skinny_gated_norm", "fp8_skinny")):
        plan = KernelPlan.for_device(torch.device("cuda"), torch.bfloat16, True, capability=(9, 0),
                                     quantization=quantization, hf_config=config)
        with torch.device("meta"):
            model = Qwen3ForCausalLM(config, plan)
        table = kernel_table(model, TritonBackend(8, config.num_key_value_heads, torch.device("cpu")), (1, 2))
        rows = {line.split(" (")[0]: [cell.strip() for cell in line.split("  ") if cell.strip()][1:]
                for line in table.splitlines()}
        assert rows["mlp.gate_up_proj"][0] == gate_up and rows["mlp.down_proj"][0] == down
        assert "silu" in rows["mlp.down_proj"][1]  # two rows: the SiLU-mul stays with down_proj


@pytest.mark.parametrize("block", [None, (128, 128)])
def test_fp8_one_row_gate_up_gives_the_gemv_then_the_silu_mul(monkeypatch, block):
    """The sm_90 fp8 methods (per channel: Fp8ScaledMmLinearMethod; 128 x 128 blocks:
    Fp8BlockScaledMmLinearMethod, its compact scales) with the gated bucket: gate/up's one row runs the
    norm's kernel, then the fp8 GEMV with the SiLU-mul as its epilogue: the bits of the norm, the GEMV and
    the SiLU-mul kernel."""
    from nanovllm.kernels import norm_act
    from nanovllm.layers.fp8 import quantize_blocks, quantize_groups
    from nanovllm.layers.fp8_methods import Fp8BlockScaledMmLinearMethod, Fp8ScaledMmLinearMethod
    from nanovllm.layers.linear import MergedColumnParallelLinear
    from nanovllm.layers.norm_act import RMSNorm
    from nanovllm.utils.config_checks import Fp8Scheme

    device = triton_test_device()
    method_class = Fp8ScaledMmLinearMethod if block is None else Fp8BlockScaledMmLinearMethod
    monkeypatch.setattr(method_class, "BUCKETS", gated(method_class))
    method = method_class(Fp8Scheme(block, True))
    layer = MergedColumnParallelLinear(256, [128, 128], quant_method=method)
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(256, 256, generator=gen) / 16
    if block is None:
        weight, scale = quantize_groups(w, 256)
        layer.weight_scale = torch.nn.Parameter(scale, requires_grad=False)
    else:  # the checkpoint's layout, then the method's compact scales
        weight, blocks = quantize_blocks(w, block)
        layer.weight_scale_inv.data.copy_(blocks.repeat_interleave(128, dim=0))
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    norm = RMSNorm(256)
    norm.weight.data.uniform_(0.5, 1.5, generator=gen)
    layer.to(device), norm.to(device)
    if block is not None:
        method.process_weights_after_loading(layer)
    x, residual = (torch.randn(1, 256, generator=gen).to(device) for _ in range(2))
    out, summed = layer.gated(x, norm, residual)
    plain, expected_sum = layer(x, norm=norm, residual=residual)
    assert out.shape == (1, 128) and torch.equal(summed, expected_sum)
    assert torch.equal(out, norm_act.silu_and_mul(plain))
    assert layer.gated(torch.randn(2, 256, generator=gen).to(device), norm, residual) is None  # two rows
    with pytest.raises(ValueError, match="two equal parts"):
        MergedColumnParallelLinear(256, [64, 128], quant_method=method).gated(x)
