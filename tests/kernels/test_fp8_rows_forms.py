"""The fp8 rows kernel over the rows the kernel before writes (layers/fp8_rows_forms.py). Over float16
rows (kernels/fp8_skinny's x_scale; the linear methods' fp8_rows_f16 kernels, the RMSNorm and SiLU-mul
writing those rows, per channel and for block-scaled weights): bf16 activations as float16 times a power
of two a row give the bf16 rows kernel's outputs bit for bit (the same products and sums a power of two
apart; the interpreter sums float16 dots as bf16 ones), on CPU tensors through the Triton interpreter (or
on CUDA when TRITON_INTERPRET=0, to a row's rounding); rows thousands of times apart in magnitude, split-K
and single launches, a bias; and the argument checks. Over e4m3 rows (fp8_rows_e4m3: W8A8, fp8 dots) the
kernel gives the dequantizing reference's product of the same rounded activations, and its norm and
SiLU-mul forms the plain form's outputs of their rows."""

import pytest
import torch
import torch.nn.functional as F
from conftest import triton_test_device

pytest.importorskip("triton")

from nanovllm.kernels import norm_act  # noqa: E402
from nanovllm.kernels.float16_rows import float16_rows  # noqa: E402
from nanovllm.kernels.fp8_skinny import fp8_rows_block_linear, fp8_rows_linear  # noqa: E402
from nanovllm.layers import fp8_methods  # noqa: E402
from nanovllm.layers.fp8 import dequantize, quantize_activations, quantize_blocks, quantize_groups  # noqa: E402
from nanovllm.layers.fp8_methods import (  # noqa: E402
    fp8_rows,
    fp8_rows_e4m3,
    fp8_rows_e4m3_norm,
    fp8_rows_e4m3_silu,
    fp8_rows_f16,
    fp8_rows_f16_norm,
    fp8_rows_f16_silu,
)

DEVICE = triton_test_device()
BF16 = torch.bfloat16
# (N, K): ragged; 16 rows of a long K over few column blocks (split-K).
SHAPES = [(200, 300), (16, 4096)]


def make(n: int, k: int, rows: int, width: int | None = None, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    magnitudes = torch.logspace(4, -3, rows)[:, None]
    x = (torch.randn(rows, width or k, generator=gen) * magnitudes).to(DEVICE, BF16)
    weight, scale = quantize_groups(torch.randn(n, k, generator=gen) / k**0.5, k)
    return x, weight.to(DEVICE), scale.to(DEVICE), torch.randn(n, generator=gen).to(DEVICE, BF16)


def assert_same(out: torch.Tensor, expected: torch.Tensor) -> None:
    assert out.dtype == expected.dtype == BF16
    if DEVICE == "cpu":
        assert torch.equal(out, expected)
    else:  # the GPU's float16 and bf16 tensor cores may sum in other orders: a row's rounding apart
        rows = expected.float().abs().amax(dim=1, keepdim=True)
        assert ((out.float() - expected.float()).abs() / rows).max() < 1e-2


def blocked(n: int, k: int, seed: int = 4):
    """A block-scaled weight in the layer's layout: scales repeated per row, the compact blocks beside."""
    gen = torch.Generator().manual_seed(seed)
    weight, block_scale = quantize_blocks(torch.randn(n, k, generator=gen) / k**0.5, (128, 128))
    per_row = block_scale.repeat_interleave(128, dim=0).to(DEVICE)
    per_row.blocks = block_scale.to(DEVICE)
    return weight.to(DEVICE), per_row


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", [3, 16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_float16_rows_give_the_bf16_rows_kernel_bit_for_bit(n, k, rows, with_bias):
    x, weight, scale, bias = make(n, k, rows)
    bias = bias if with_bias else None
    expected = fp8_rows_linear(x, weight, scale, k, bias)
    rows16, row_scale = float16_rows(x)
    assert_same(fp8_rows_linear(rows16, weight, scale, k, bias, x_scale=row_scale, out_dtype=BF16), expected)
    assert_same(fp8_rows_f16(x, weight, scale, k, bias), expected)  # the linear methods' kernel


@pytest.mark.parametrize("rows", [2, 16])
def test_float16_rows_give_the_block_scaled_rows_kernel_bit_for_bit(rows):
    n, k = 256, 384
    x, _, _, _ = make(n, k, rows)
    weight, per_row = blocked(n, k)
    expected = fp8_rows_block_linear(x, weight, per_row.blocks, (128, 128))
    rows16, row_scale = float16_rows(x)
    assert_same(fp8_rows_block_linear(rows16, weight, per_row.blocks, (128, 128), x_scale=row_scale,
                                      out_dtype=BF16), expected)
    assert_same(fp8_methods.fp8_rows_blocks_f16(x, weight, per_row, 128, None), expected)


# (a form's norm and SiLU-mul kernels, the plain kernel they must equal after the norm or SiLU-mul, the
# weight): float16 rows per scale layout equal the bf16 form; e4m3 rows their own plain form
FORMS = {"channel": ((fp8_rows_f16_norm, fp8_rows_f16_silu), fp8_rows, lambda n, k: make(n, k, 1)[1:3]),
         "blocks": ((fp8_methods.fp8_rows_blocks_f16_norm, fp8_methods.fp8_rows_blocks_f16_silu),
                    fp8_methods.fp8_rows_blocks, blocked),
         "channel, e4m3": ((fp8_rows_e4m3_norm, fp8_rows_e4m3_silu), fp8_rows_e4m3,
                           lambda n, k: make(n, k, 1)[1:3])}


@pytest.mark.parametrize("layout", FORMS)
@pytest.mark.parametrize("with_residual", [False, True])
def test_the_norm_writes_the_rows_the_rows_kernel_takes(layout, with_residual):
    (normed_kernel, _), plain_kernel, weights = FORMS[layout]
    x, _, _, _ = make(128, 256, 5)
    weight, scale = weights(128, 256)
    gen = torch.Generator().manual_seed(9)
    norm_weight = (torch.rand(256, generator=gen) * 3).to(DEVICE, BF16)
    residual = torch.randn(5, 256, generator=gen).to(DEVICE, BF16) if with_residual else None
    out, summed = normed_kernel(x, norm_weight, 1e-6, weight, scale, 256, None, residual)
    if residual is None:
        normed, expected_sum = norm_act.rms_norm(x, norm_weight, 1e-6), x
    else:
        normed, expected_sum = norm_act.add_rms_norm(x, residual, norm_weight, 1e-6)
    assert_same(out, plain_kernel(normed, weight, scale, 256, None))
    assert torch.equal(summed, expected_sum)


@pytest.mark.parametrize("layout", FORMS)
def test_the_silu_mul_writes_the_rows_the_rows_kernel_takes(layout):
    (_, silu_kernel), plain_kernel, weights = FORMS[layout]
    x, _, _, _ = make(128, 256, 7, width=512)
    weight, scale = weights(128, 256)
    out = silu_kernel(x / 100, weight, scale, 256, None)  # silu(gate) * up: squares x's magnitudes
    assert_same(out, plain_kernel(norm_act.silu_and_mul(x / 100), weight, scale, 256, None))


@pytest.mark.parametrize("n,k", SHAPES)
# The method's bucket takes 3 to fp8_methods.W8A8_ROWS_MAX; the kernel any of 1-128 (x padded to 16, 32,
# 64 or 128 rows)
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 64, 128])
@pytest.mark.parametrize("with_bias", [False, True])
def test_e4m3_rows_give_the_w8a8_reference(n, k, rows, with_bias):
    x, weight, scale, bias = make(n, k, rows)
    bias = bias if with_bias else None
    out = fp8_rows_e4m3(x, weight, scale, k, bias)
    expected = F.linear(quantize_activations(x.float(), k), dequantize(weight, scale, k),
                        None if bias is None else bias.float())
    assert out.dtype == BF16
    # bf16's rounding of each output (a float32 sum's order aside): under 2^-8 of its row's largest
    rows_max = expected.abs().amax(dim=1, keepdim=True)
    assert ((out.float() - expected).abs() / rows_max).max() < 2**-8


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", [3, 64])
def test_e4m3_rows_chained_over_k_give_the_w8a8_reference(monkeypatch, n, k, rows):
    """skinny_rows.FAST_ACCUM: the fp8 dots chained in the accumulator over the whole K (on sm_90, its ~14
    bits while it sums, as torch._scaled_mm's fast accumulation) stay within the W8A8 reference's bound."""
    from nanovllm.kernels import skinny_rows

    monkeypatch.setattr(skinny_rows, "FAST_ACCUM", True)
    test_e4m3_rows_give_the_w8a8_reference(n, k, rows, with_bias=True)


def test_e4m3_rows_need_their_scales_and_an_output_dtype():
    x, weight, scale, _ = make(96, 256, 3)
    q, row_scale = quantize_groups(x.float(), 256)
    q, row_scale = q.to(DEVICE), row_scale.to(DEVICE)
    with pytest.raises(ValueError, match="need their scales"):
        fp8_rows_linear(q, weight, scale, 256, out_dtype=BF16)
    with pytest.raises(ValueError, match="need their scales"):
        fp8_rows_linear(q, weight, scale, 256, x_scale=row_scale)
    # float32 activations keep the rows kernel's unrounded path, as the float16 form's do: the W8A16 GEMV
    # to 16 rows, then fp8_methods.fp8_scaled_mm
    x32 = x.float()
    assert torch.equal(fp8_rows_e4m3(x32, weight, scale, 256, None), fp8_rows(x32, weight, scale, 256, None))
    x32 = make(96, 256, 24)[0].float()
    expected = fp8_methods.fp8_scaled_mm(x32, weight, scale, 256, None)
    assert torch.equal(fp8_rows_e4m3(x32, weight, scale, 256, None), expected)


def test_float16_rows_refuse_other_activations():
    x, weight, scale, _ = make(96, 256, 3)
    rows, row_scale = float16_rows(x)
    with pytest.raises(ValueError, match="rows with contiguous float32 scales"):
        fp8_rows_linear(x, weight, scale, 256, x_scale=row_scale)
    with pytest.raises(ValueError, match=r"float32 scales \(3, 1\)"):
        fp8_rows_linear(rows, weight, scale, 256, x_scale=row_scale[:2])
    # float32 activations are not exact in float16 rows: the methods' kernel keeps the rows kernel's path
    x32 = x.float()
    assert torch.equal(fp8_rows_f16(x32, weight, scale, 256, None), fp8_rows(x32, weight, scale, 256, None))
