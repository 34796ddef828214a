"""The kernel plan (layers/kernel_plan.py): torch everywhere on the CPU, the decode-sized Triton kernels on a
half-precision GPU, as one table (kernel_table) the engine can log; and at one rank a forward never calls
into layers/parallel.py."""

import os
import sys

import pytest
import torch
from transformers import AutoConfig, Qwen3Config

from nanovllm.attention.layer import Attention
from nanovllm.attention.metadata import AttentionMetadata
from nanovllm.attention.torch_backend import TorchBackend
from nanovllm.layers.kernel_plan import KernelPlan, kernel_table
from nanovllm.layers.linear_methods import SkinnyLinearMethod, SkinnyLMHeadMethod, UnquantizedLinearMethod
from nanovllm.models.qwen3 import Qwen3ForCausalLM
from nanovllm.utils.loader import init_dummy_weights

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "configs")
ROWS = (1, 2, 16, 256)


def tiny_model() -> Qwen3ForCausalLM:
    config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
    model = Qwen3ForCausalLM(config, KernelPlan.for_device(torch.device("cpu"), torch.float32, True))
    init_dummy_weights(model, std=0.1, seed=0)
    for layer in model.modules():
        if isinstance(layer, Attention):
            layer.backend = TorchBackend()
            layer.k_cache, layer.v_cache = torch.zeros(2, 2, 4, 2, 8)  # [blocks, block_size, Hkv, D] each
    return model


def test_the_cpu_plan_runs_torch_at_every_row_count():
    plan = KernelPlan.for_device(torch.device("cpu"), torch.float32, skinny_gemm=True)
    assert type(plan.linear) is UnquantizedLinearMethod and type(plan.lm_head) is UnquantizedLinearMethod
    table = kernel_table(tiny_model(), TorchBackend(), ROWS).splitlines()
    assert table[0].split() == ["rows", "1", "2", "16", "256"]
    assert [line.split("  ")[0].split(" (")[0] for line in table[1:]] == [
        "self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj", "lm_head", "attention"]
    qkv, o_proj, gate_up, down, head, _ = table[1:]
    assert qkv.count("rms_norm, torch_linear") == 4 and gate_up.count("rms_norm, torch_linear") == 4
    assert o_proj.count("torch_linear") == 4 and head.count("torch_linear") == 4
    assert down.count("silu_and_mul, torch_linear") == 4


@pytest.mark.parametrize("dtype,skinny_gemm", [(torch.float32, True), (torch.bfloat16, False)])
def test_a_gpu_without_the_kernels_plans_torch(dtype, skinny_gemm):
    plan = KernelPlan.for_device(torch.device("cuda"), dtype, skinny_gemm, capability=(9, 0))
    assert type(plan.linear) is UnquantizedLinearMethod


def test_the_sm90_plan_for_qwen3_0_6b():
    pytest.importorskip("triton")
    from nanovllm.attention.triton_backend import TritonBackend

    plan = KernelPlan.for_device(torch.device("cuda"), torch.bfloat16, True, capability=(9, 0))
    assert type(plan.linear) is SkinnyLinearMethod and type(plan.lm_head) is SkinnyLMHeadMethod
    assert plan.linear.pdl and plan.lm_head.pdl
    ampere = KernelPlan.for_device(torch.device("cuda"), torch.bfloat16, True, capability=(8, 0))
    assert not ampere.linear.pdl
    config = AutoConfig.from_pretrained(os.path.join(CONFIGS, "Qwen3-0.6B"))
    config.num_hidden_layers = 1
    with torch.device("meta"):  # shapes only
        model = Qwen3ForCausalLM(config, plan)
    backend = TritonBackend(8, config.num_key_value_heads, torch.device("cpu"))
    backend.pdl, backend.one_row = True, object()  # as on an sm_90 GPU, where the CUDA kernel compiled
    table = kernel_table(model, backend, ROWS)
    rows = {line.split(" (")[0]: [cell.strip() for cell in line.split("  ") if cell.strip()][1:]
            for line in table.splitlines()}
    normed = ["gemv_norm", "mma_rows_norm", "mma_rows_norm", "rms_norm, torch_linear"]
    assert rows["self_attn.qkv_proj"] == normed
    assert rows["self_attn.o_proj"] == ["gemv", "gemv_rows", "mma_rows", "torch_linear"]
    # One row: the SiLU-mul is gate/up's epilogue (GATED_EPILOGUE), so down_proj's GEMV runs plain
    assert rows["mlp.gate_up_proj"] == ["gemv_norm_gated", *normed[1:]]
    assert rows["mlp.down_proj"] == ["gemv", "gemv_rows_silu", "silu_and_mul, mma_rows",
                                     "silu_and_mul, torch_linear"]
    assert rows["lm_head"] == ["gemv", "torch_linear", "torch_linear", "torch_linear"]
    assert rows["attention"] == ["cuda_decode_rope where it applies, else decode_rope",
                                 "decode_rope, late PDL trigger", "decode_rope, late PDL trigger",
                                 "rope_store, decode_attention (split-KV)"]


def test_one_rank_never_calls_the_collectives():
    """At tensor_parallel_size=1 the layers decided at build time that no all-reduce or gather is needed:
    a prefill and the logits run through no function of layers/parallel.py."""
    model = tiny_model()
    meta = AttentionMetadata(is_prefill=True, slot_mapping=torch.arange(3), seqlens_k=torch.tensor([3]),
                             block_tables=torch.zeros(1, 2, dtype=torch.int32),
                             cu_seqlens_q=torch.tensor([0, 3]), cu_seqlens_k=torch.tensor([0, 3]),
                             max_seqlen_q=3, max_seqlen_k=3,
                             cu_seqlens_q_host=[0, 3], seqlens_k_host=[3])
    files = set()

    def profile(frame, event, arg):
        if event == "call":
            files.add(frame.f_code.co_filename)

    sys.setprofile(profile)
    try:
        with torch.inference_mode():
            logits = model.compute_logits(model(torch.tensor([1, 2, 3]), torch.arange(3), meta))
    finally:
        sys.setprofile(None)
    assert logits.shape == (3, 64)
    ours = {os.path.relpath(f, os.path.dirname(os.path.dirname(__import__("nanovllm").__file__)))
            for f in files if "nanovllm" in f}
    assert os.path.join("nanovllm", "models", "decoder.py") in ours  # the profile saw the forward
    assert os.path.join("nanovllm", "layers", "parallel.py") not in ours


def test_the_sm90_fp8_plan_runs_the_fp8_kernels():
    pytest.importorskip("triton")
    from nanovllm.attention.triton_backend import TritonBackend
    from nanovllm.layers.fp8 import Fp8LinearMethod
    from nanovllm.layers.fp8_methods import Fp8ScaledMmLinearMethod

    config = AutoConfig.from_pretrained(os.path.join(CONFIGS, "Qwen3-0.6B"))
    config.num_hidden_layers = 1
    plan = KernelPlan.for_device(torch.device("cuda"), torch.bfloat16, True, capability=(9, 0),
                                 quantization="fp8", hf_config=config)
    # quantization="fp8": per-channel scales, so past the rows bucket torch._scaled_mm's row-wise fp8 GEMM.
    assert type(plan.linear) is Fp8ScaledMmLinearMethod and type(plan.lm_head) is SkinnyLMHeadMethod
    ampere = KernelPlan.for_device(torch.device("cuda"), torch.bfloat16, True, capability=(8, 0),
                                   quantization="fp8", hf_config=config)
    assert type(ampere.linear) is Fp8LinearMethod  # no fp8 tensor cores: the dequantizing reference
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config, plan)
    table = kernel_table(model, TritonBackend(8, config.num_key_value_heads, torch.device("cpu")), ROWS)
    rows = {line.split(" (")[0]: [cell.strip() for cell in line.split("  ") if cell.strip()][1:]
            for line in table.splitlines()}
    # One row the fp8 GEMV, the norm or SiLU-mul before it in its own kernel, chained as dependents; two
    # the few-row GEMV, the norm or SiLU-mul before it in its own kernel; 3 to W8A8_ROWS_MAX the rows kernel
    # over e4m3 rows, which the norm or SiLU-mul write; all over the e4m3 weight; past it torch._scaled_mm,
    # the norm or SiLU-mul quantizing their own output.
    plain = ["fp8_skinny", "fp8_gemv_rows", "fp8_rows_e4m3", "fp8_scaled_mm"]
    for name in ("self_attn.qkv_proj", "mlp.gate_up_proj"):
        assert rows[name] == ["fp8_skinny_norm", "rms_norm, fp8_gemv_rows", "fp8_rows_e4m3_norm",
                              "fp8_scaled_mm_norm"]
    assert rows["mlp.down_proj"] == ["fp8_skinny_silu", "silu_and_mul, fp8_gemv_rows", "fp8_rows_e4m3_silu",
                                     "fp8_scaled_mm_silu"]
    assert rows["self_attn.o_proj"] == plain
