"""The fused MoE with fp8 experts (e4m3 weights, float32 scales per row and K group: layers/fp8.py's
layout) against the torch path on the exactly dequantized weights with unrounded activations (W8A16), on
CPU tensors through the Triton interpreter (or on CUDA with TRITON_INTERPRET=0): 128-wide scale groups
(a block-wise checkpoint's) and one scale a row (per channel), few and many tokens; and the misuse it
refuses."""

import pytest
import torch
from conftest import triton_test_device

pytest.importorskip("triton")

from nanovllm.kernels.fused_moe import MoeConfig, fused_moe  # noqa: E402
from nanovllm.layers.fp8 import dequantize, quantize_groups  # noqa: E402
from nanovllm.layers.fused_moe import route, torch_moe  # noqa: E402

DEVICE = triton_test_device()
# K = 320 for gate/up (128-wide groups: two and a partial one), 124 for down (one partial group); N not a
# multiple of the column tiles.
NUM_EXPERTS, HIDDEN, INTERMEDIATE = 4, 320, 128
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])
# float32: the same products, summed in another order. bf16: each weight tile widened to bf16 in
# registers (the block-wise case) and bf16 activations, against a float32 reference.
TOLERANCES = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


def fp8_experts(group13: int, group2: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(NUM_EXPERTS, 2 * INTERMEDIATE - 8, HIDDEN, generator=gen) / HIDDEN**0.5
    w2 = torch.randn(NUM_EXPERTS, HIDDEN, INTERMEDIATE - 4, generator=gen) / INTERMEDIATE**0.5
    (q13, s13), (q2, s2) = quantize_groups(w13, group13), quantize_groups(w2, group2)
    return (q13.contiguous().to(DEVICE), s13.to(DEVICE), q2.contiguous().to(DEVICE), s2.to(DEVICE))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("grouping", ["block-128", "per-channel"])
@pytest.mark.parametrize("num_tokens", [1, 5, 40])
def test_fp8_experts_match_the_dequantized_weights(num_tokens, grouping, dtype):
    # The down projection's K is 124: per channel one group, block-wise a single partial 128 group.
    groups = (128, 128) if grouping == "block-128" else (HIDDEN, INTERMEDIATE - 4)
    q13, s13, q2, s2 = fp8_experts(*groups)
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, HIDDEN, generator=gen).to(DEVICE, dtype)
    topk_weights, topk_ids = route(torch.randn(num_tokens, NUM_EXPERTS, generator=gen).to(DEVICE), 2, True)
    config = MoeConfig(16, 32, 64 if dtype == torch.float32 else 128)
    out = fused_moe(x, q13, q2, topk_weights, topk_ids, config, w13_scale=s13, w2_scale=s2,
                    scale_groups=groups)
    ref = torch_moe(x.float(), dequantize(q13, s13, groups[0]), dequantize(q2, s2, groups[1]), topk_weights,
                    topk_ids)
    assert out.dtype == dtype and out.shape == x.shape
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


def test_fp8_experts_without_scales_or_with_odd_groups_are_refused():
    q13, s13, q2, s2 = fp8_experts(128, 128)
    x = torch.randn(3, HIDDEN).to(DEVICE)
    topk_weights, topk_ids = route(torch.randn(3, NUM_EXPERTS).to(DEVICE), 2, True)
    with pytest.raises(ValueError, match="need their scales"):
        fused_moe(x, q13, q2, topk_weights, topk_ids)
    _, s13_odd, _, _ = fp8_experts(96, 128)  # 96-wide groups: not a whole number of 64-wide K tiles
    with pytest.raises(ValueError, match="do not split into"):
        fused_moe(x, q13, q2, topk_weights, topk_ids, MoeConfig(16, 32, 64), w13_scale=s13_odd, w2_scale=s2,
                  scale_groups=(96, 128))
    with pytest.raises(ValueError, match="one column per 64"):
        fused_moe(x, q13, q2, topk_weights, topk_ids, MoeConfig(16, 32, 64), w13_scale=s13, w2_scale=s2,
                  scale_groups=(64, 128))
