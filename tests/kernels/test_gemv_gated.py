"""The one-row GEMV with the SiLU-mul after a gated MLP's gate/up projection folded in as its epilogue
(kernels/gemv_folds.py; the fp8 one-row GEMVs' gated=True) gives the bits of the GEMV and then the SiLU-mul
kernel: bf16-style weights with and without the RMSNorm prologue, e4m3 weights with a scale a row or a
block (gate and up rows in two block rows, or in one), ragged
halves, a bias, shapes that ask for split-K (the two kernels then), and the argument checks. On CPU
tensors through the Triton interpreter, or on CUDA when TRITON_INTERPRET=0 (under PDL and in a CUDA graph:
tests/kernels/test_skinny_gemm.py)."""

import pytest
import torch
from conftest import triton_test_device

pytest.importorskip("triton")

from nanovllm.kernels.fp8_skinny import fp8_block_gemv_linear, fp8_skinny_linear  # noqa: E402
from nanovllm.kernels.gemv_folds import skinny_gated_linear, skinny_norm_linear  # noqa: E402
from nanovllm.kernels.norm_act import silu_and_mul  # noqa: E402
from nanovllm.kernels.skinny_gemm import skinny_linear  # noqa: E402
from nanovllm.kernels.skinny_launch import skinny_config  # noqa: E402
from nanovllm.layers.fp8 import quantize_blocks, quantize_groups  # noqa: E402

DEVICE = triton_test_device()
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
# (I, K), a weight of 2I rows: halves of 64 and of 52 (ragged for every column block), and 8 x 4,096,
# so few column blocks that the shapes ask for split-K.
SHAPES = [(64, 32), (52, 80), (8, 4096)]


def make(inner: int, k: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, k, generator=gen)
    weight = torch.randn(2 * inner, k, generator=gen) / k**0.5
    bias = torch.randn(2 * inner, generator=gen)
    return x.to(DEVICE, dtype), weight.to(DEVICE, dtype), bias.to(DEVICE, dtype)


def test_a_shape_below_asks_for_split_k():
    assert skinny_config(16, 4096, 4).split_k > 1 and skinny_config(128, 32, 4).split_k == 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inner,k", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_gated_gemv_gives_the_gemv_then_silu_mul(inner: int, k: int, dtype: torch.dtype, with_bias: bool):
    x, weight, bias = make(inner, k, dtype)
    bias = bias if with_bias else None
    out = skinny_gated_linear(x, weight, bias)
    assert out.shape == (1, inner) and out.dtype == dtype
    assert torch.equal(out, silu_and_mul(skinny_linear(x, weight, bias)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("inner,k", SHAPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_norm_prologue_and_gated_epilogue_in_one_kernel(inner: int, k: int, dtype: torch.dtype,
                                                        with_residual: bool):
    x, weight, bias = make(inner, k, dtype, seed=1)
    gen = torch.Generator().manual_seed(2)
    residual = torch.randn(1, k, generator=gen).to(DEVICE, dtype) if with_residual else None
    norm_weight = (1 + torch.rand(k, generator=gen)).to(DEVICE, dtype)
    out, summed = skinny_norm_linear(x, norm_weight, 1e-6, weight, bias, residual, gated=True)
    plain, plain_summed = skinny_norm_linear(x, norm_weight, 1e-6, weight, bias, residual)
    assert torch.equal(summed, plain_summed)
    assert torch.equal(out, silu_and_mul(plain))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inner,k", SHAPES)
def test_fp8_gated_gemv_gives_the_fp8_gemv_then_silu_mul(inner: int, k: int, dtype: torch.dtype):
    x, weight, bias = make(inner, k, dtype, seed=3)
    q, scale = quantize_groups(weight.float().cpu(), k)
    q, scale = q.to(DEVICE), scale.to(DEVICE)
    out = fp8_skinny_linear(x, q, scale, k, bias, gated=True)
    assert out.shape == (1, inner)
    assert torch.equal(out, silu_and_mul(fp8_skinny_linear(x, q, scale, k, bias)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inner,k,block", [(128, 384, (128, 128)), (32, 96, (16, 32)), (32, 80, (64, 32)),
                                           (64, 4096, (128, 128))])
def test_block_scaled_gated_gemv_gives_the_block_gemv_then_silu_mul(inner, k, block, dtype):
    """128 x 128 blocks (Qwen's FP8 layout, K's 3 groups padded to 4); 16 x 32 blocks, gate and up each
    two block rows; 64-row blocks holding both gate and up; a long K that asks for split-K."""
    x, weight, bias = make(inner, k, dtype, seed=4)
    q, blocks = quantize_blocks(weight.float().cpu(), block)
    scales = torch.nn.functional.pad(blocks, (0, -blocks.shape[1] % 4)).to(DEVICE)  # as the method keeps them
    q = q.to(DEVICE)
    out = fp8_block_gemv_linear(x, q, scales, block, bias, gated=True)
    assert out.shape == (1, inner)
    assert torch.equal(out, silu_and_mul(fp8_block_gemv_linear(x, q, scales, block, bias)))


def test_gated_forms_refuse_a_weight_that_does_not_halve():
    x, weight, _ = make(8, 32, torch.float32)
    odd = weight[:15]
    with pytest.raises(ValueError, match="15 rows do not halve"):
        skinny_gated_linear(x, odd)
    with pytest.raises(ValueError, match="15 rows do not halve"):
        skinny_norm_linear(x, torch.ones(32, device=DEVICE), 1e-6, odd, gated=True)
    q, scale = quantize_groups(odd.cpu(), 32)
    with pytest.raises(ValueError, match="15 rows do not halve"):
        fp8_skinny_linear(x, q.to(DEVICE), scale.to(DEVICE), 32, gated=True)
    with pytest.raises(ValueError, match="bias must be contiguous"):
        skinny_gated_linear(x, weight, torch.zeros(8, device=DEVICE))

