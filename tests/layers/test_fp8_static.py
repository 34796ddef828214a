"""fp8 weights with static activation scales (layers/fp8_static.py): the method a device takes, the GPU's
large-batch product (torch._scaled_mm, which also runs on the CPU) against the dequantizing reference,
the W8A16 buckets' indifference to the input scale, and the static checkpoints nanovllm refuses (MoE
experts' static scales: tests/models/test_fp8_checkpoints.py)."""

import json
import os
import shutil

import pytest
import torch
from conftest import make_model_dir
from fp8_files import compressed_tensors_config, write_fp8_checkpoint
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config

from nanovllm import LLM, SamplingParams
from nanovllm.layers import fp8_methods, fp8_static
from nanovllm.layers.fp8 import quantize_groups
from nanovllm.layers.fp8_methods import Fp8ScaledMmLinearMethod
from nanovllm.layers.fp8_static import (
    Fp8StaticLinearMethod,
    Fp8StaticScaledMmLinearMethod,
    fp8_static_dequant_linear,
    fp8_static_scaled_mm,
    static_linear_method,
)
from nanovllm.layers.kernel_plan import KernelPlan
from nanovllm.utils.config_checks import Fp8Scheme

ENGINE = dict(kvcache_block_size=4, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=512,
              device="cpu", dtype="float32")
STATIC = Fp8Scheme(block=None, serialized=True, static_input=True)


def test_each_device_takes_its_method():
    cuda = torch.device("cuda")
    assert type(static_linear_method(STATIC, torch.device("cpu"))) is Fp8StaticLinearMethod
    assert type(static_linear_method(STATIC, cuda, capability=(9, 0))) is Fp8StaticScaledMmLinearMethod
    assert type(static_linear_method(STATIC, cuda, capability=(8, 9))) is Fp8StaticLinearMethod
    # The kernel plan takes them for a static checkpoint's config, and not for a dynamic one's.
    hf = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=256)
    choices = (("static", Fp8StaticScaledMmLinearMethod), ("dynamic", Fp8ScaledMmLinearMethod))
    for activations, expected in choices:
        hf.quantization_config = {"quant_method": "fp8", "activation_scheme": activations}
        plan = KernelPlan.for_device(cuda, torch.bfloat16, True, capability=(9, 0), hf_config=hf)
        assert type(plan.linear) is expected and plan.quantization.static_input == (activations == "static")
    kernels = [Fp8StaticScaledMmLinearMethod(STATIC).bucket(rows).plain.__name__ for rows in (1, 2, 16, 17)]
    assert kernels == ["fp8_skinny", "fp8_gemv_rows", "fp8_rows", "fp8_static_scaled_mm"]


def test_scaled_mm_rounds_as_the_reference():
    """From 17 rows: x rounded with the static scale (clamped: some inputs exceed 448 x scale), the
    per-channel e4m3 weight, torch._scaled_mm's float32 sums (on the CPU, or a GPU where the tests see
    one); the reference's product to bf16 rounding."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(40, 256, generator=gen) * 3).to(torch.bfloat16)
    weight, weight_scale = quantize_groups(torch.randn(96, 256, generator=gen), 256)
    input_scale = torch.tensor([0.01])
    bias = torch.randn(96, generator=gen).to(torch.bfloat16)
    on = [t.to(device) for t in (x, weight, weight_scale, input_scale, bias)]
    out = fp8_static_scaled_mm(on[0], on[1], on[2], 256, on[3], on[4])
    ref = fp8_static_dequant_linear(x.float(), weight, weight_scale, 256, input_scale, bias.float())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float().cpu(), ref, atol=0.05, rtol=1e-2)
    assert (x.float().abs() > 448 * 0.01).any()  # the clamp is exercised


def test_few_rows_leave_the_activations_unrounded():
    """Up to 16 rows the static method runs per-channel fp8's W8A16 kernels, the input scale unused."""
    method = Fp8StaticScaledMmLinearMethod(STATIC)
    wrapped = [method.bucket(rows).plain.__wrapped__ for rows in (1, 2, 16)]
    assert wrapped == [fp8_methods.fp8_skinny, fp8_methods.fp8_gemv_rows, fp8_methods.fp8_rows]
    seen = []
    fp8_static.unrounded(lambda *args: seen.append(args))("x", "w", "ws", 128, "input_scale", "bias", True)
    assert seen == [("x", "w", "ws", 128, "bias", True)]


@pytest.fixture(scope="module")
def static_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8_static")
    make_model_dir(str(root / "fp32"))
    write_fp8_checkpoint(str(root / "fp32"), str(root / "static"), "channel", static=True)
    return root


def changed(src: str, dst: str, quant: dict | None = None, tensors: dict | None = None) -> str:
    shutil.copytree(src, dst)
    if quant is not None:
        with open(os.path.join(dst, "config.json")) as f:
            config = json.load(f)
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump({**config, "quantization_config": quant}, f)
    if tensors is not None:
        file = os.path.join(dst, "model.safetensors")
        weights = {**load_file(file), **tensors}
        save_file({k: v for k, v in weights.items() if v is not None}, file, metadata={"format": "pt"})
    return dst


def test_static_checkpoints_nanovllm_cannot_read_are_refused(static_dir, tmp_path):
    src = str(static_dir / "static")
    name = "model.layers.0.self_attn.o_proj.input_scale"
    with pytest.raises(ValueError, match=rf"'{name}'.*input_scale of shape \(3,\) is not one scale a layer"):
        LLM(changed(src, str(tmp_path / "wide"), tensors={name: torch.ones(3)}), **ENGINE)
    with pytest.raises(ValueError, match=rf"lacks 1 tensors the model needs: \['{name}'\]"):
        LLM(changed(src, str(tmp_path / "missing"), tensors={name: None}), **ENGINE)
    block = {"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]}
    with pytest.raises(ValueError, match="static activation scales with block-scaled fp8 weights"):
        LLM(changed(src, str(tmp_path / "block"), quant=block), **ENGINE)
    per_token = compressed_tensors_config("channel", static=True)
    per_token["config_groups"]["group_0"]["input_activations"]["strategy"] = "token"
    with pytest.raises(ValueError, match="static input activation scales per 'token'"):
        LLM(changed(src, str(tmp_path / "per_token"), quant=per_token), **ENGINE)


def test_tp2_holds_the_scales_tp1_holds(static_dir):
    """Each rank's q/k/v and gate/up keep the largest of their parts' scales, as one rank does."""

    def outputs(llm):
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        return [o["token_ids"] for o in llm.generate(["a b c d", "the static scale"], params, use_tqdm=False)]

    tp1 = outputs(LLM(str(static_dir / "static"), **ENGINE))
    with LLM(str(static_dir / "static"), **ENGINE, tensor_parallel_size=2) as llm:
        assert outputs(llm) == tp1
