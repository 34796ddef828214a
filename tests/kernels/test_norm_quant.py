"""The RMSNorm and SiLU-mul kernels that write e4m3 (kernels/norm_quant.py) against the two kernels they
replace, norm_act's then fp8_gemm.quantize_rows, bit for bit (a scale a row, and a scale a row and 128
inputs with the block-scaled GEMM's padding and layout), on CPU tensors through the Triton interpreter
(or on CUDA with TRITON_INTERPRET=0); and both sm_90 fp8 methods taking them past their few-row buckets, with
the layer's result unchanged."""

import pytest
import torch
from conftest import triton_test_device

pytest.importorskip("triton")

from nanovllm.kernels import norm_act, norm_quant  # noqa: E402
from nanovllm.kernels.fp8_gemm import quantize_rows  # noqa: E402
from nanovllm.layers.fp8 import quantize_groups  # noqa: E402
from nanovllm.layers.fp8_methods import Fp8ScaledMmLinearMethod  # noqa: E402
from nanovllm.layers.linear import ReplicatedLinear  # noqa: E402
from nanovllm.layers.norm_act import RMSNorm  # noqa: E402
from nanovllm.utils.config_checks import Fp8Scheme  # noqa: E402

DEVICE = triton_test_device()
EPS = 1e-6


def rows(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    # magnitudes spread over rows, so that the rows' scales differ; one all-zero row (the MIN_AMAX floor)
    x = torch.randn(m, k, generator=gen) * torch.logspace(-2, 0.5, m)[:, None]
    x[m // 2] = 0.0
    return x.to(DEVICE, dtype)


def assert_same_bits(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    (q, scale), (want_q, want_scale) = got, want
    assert q.dtype == want_q.dtype and q.shape == want_q.shape and scale.shape == want_scale.shape
    assert torch.equal(scale, want_scale)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True], ids=["norm", "add-norm"])
def test_rms_norm_quant_is_the_norm_then_quantize_rows(dtype, with_residual):
    x, residual = rows(7, 320, dtype, 0), (rows(7, 320, dtype, 1) if with_residual else None)
    weight = (1 + 0.1 * torch.randn(320, generator=torch.Generator().manual_seed(2))).to(DEVICE, dtype)
    q, scale, summed = norm_quant.rms_norm_quant(x, weight, EPS, residual)
    if with_residual:
        normed, want_sum = norm_act.add_rms_norm(x, residual, weight, EPS)
        assert torch.equal(summed, want_sum)
    else:
        normed = norm_act.rms_norm(x, weight, EPS)
        assert summed is x
    assert_same_bits((q, scale), quantize_rows(normed, 320))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [96, norm_quant.ACT_BLOCK + 100, norm_quant.ROW_BLOCK + 100],
                         ids=["one-block", "whole-row", "two-passes"])
def test_silu_mul_quant_is_the_silu_mul_then_quantize_rows(dtype, width):
    gate_up = rows(5, 2 * width, dtype, 3)
    assert_same_bits(norm_quant.silu_mul_quant(gate_up), quantize_rows(norm_act.silu_and_mul(gate_up), width))


@pytest.mark.parametrize("width", [96, norm_quant.ACT_BLOCK + 100, norm_quant.ROW_BLOCK + 100],
                         ids=["one-block", "whole-row", "two-passes"])
def test_silu_mul_float16_rows_are_the_silu_mul_then_float16_rows(width):
    """The float16 mode (W8A16 over float16 rows, 3-16 rows): float16_rows of the SiLU-mul's output."""
    from nanovllm.kernels.float16_rows import float16_rows

    gate_up = rows(4, 2 * width, torch.bfloat16, 5)
    got, want = norm_quant.silu_mul_quant(gate_up, float16=True), float16_rows(norm_act.silu_and_mul(gate_up))
    assert got[0].dtype == want[0].dtype == torch.float16
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("rows_count", [5, 8])
def test_groups_of_128_with_rows_padded_to_4_are_quantize_rows_of_the_real_rows(rows_count):
    """The block-scaled GEMM's inputs: scales a row and 128 inputs, column-major, rows padded to a multiple
    of 4 (copies of the last real row, whose products the GEMM's caller drops); the real rows' bits are
    quantize_rows(y, 128)'s."""
    x, residual = rows(rows_count, 384, torch.bfloat16, 9), rows(rows_count, 384, torch.bfloat16, 10)
    weight = (1 + 0.1 * torch.randn(384, generator=torch.Generator().manual_seed(11))).to(DEVICE, x.dtype)
    q, scale, summed = norm_quant.rms_norm_quant(x, weight, EPS, residual, group=128, pad_rows=4)
    normed, want_sum = norm_act.add_rms_norm(x, residual, weight, EPS)
    assert torch.equal(summed, want_sum)
    padded = -(-rows_count // 4) * 4
    assert q.shape == (padded, 384) and scale.shape == (padded, 3) and scale.stride() == (1, padded)
    assert_same_bits((q[:rows_count], scale[:rows_count]), quantize_rows(normed, 128))
    gate_up = rows(rows_count, 2 * 2304, torch.bfloat16, 12)  # 18 groups: two blocks of the loop, one partial
    q, scale = norm_quant.silu_mul_quant(gate_up, group=128, pad_rows=4)
    assert q.shape == (padded, 2304) and scale.stride() == (1, padded)
    assert_same_bits((q[:rows_count], scale[:rows_count]), quantize_rows(norm_act.silu_and_mul(gate_up), 128))
    with pytest.raises(ValueError, match="power of two dividing"):
        norm_quant.rms_norm_quant(x, weight, EPS, group=96)


def assert_folds_equal_the_unfused_calls(method, layer, m: int, monkeypatch) -> None:
    """m rows through the method's norm and SiLU-mul folds give the unfused calls' bits (the norm's or
    SiLU-mul's kernel, then the layer), with no quantize_rows of their own."""
    from nanovllm.kernels import fp8_scaled_mm

    k = layer.weight.shape[1]
    norm = RMSNorm(k)
    norm.weight.data.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(m))
    layer.to(DEVICE), norm.to(DEVICE)
    if getattr(layer.weight_scale, "blocks", None) is not None:
        layer.weight_scale.blocks = layer.weight_scale.blocks.to(DEVICE)
    x, residual = rows(m, k, torch.float32, 6), rows(m, k, torch.float32, 7)
    gate_up = rows(m, 2 * k, torch.float32, 8)
    normed, want_sum = norm_act.add_rms_norm(x, residual, norm.weight, norm.eps)
    want = method.apply(layer, normed, layer.bias)
    want_down = method.apply(layer, norm_act.silu_and_mul(gate_up), layer.bias)
    called = []
    quantize = fp8_scaled_mm.quantize_rows
    monkeypatch.setattr(fp8_scaled_mm, "quantize_rows",
                        lambda *a: called.append("quantize_rows") or quantize(*a))
    out, summed = method.apply_normed(layer, x, norm, residual)
    assert out.shape == want.shape and torch.equal(summed, want_sum) and torch.equal(out, want)
    assert torch.equal(method.apply_silu(layer, gate_up, layer.bias), want_down)
    assert called == []  # the norm and the SiLU-mul quantized their own outputs


def test_the_per_channel_method_folds_the_quantize_into_the_norm_and_the_silu_past_its_rows_bucket(
        monkeypatch):
    """Past its rows bucket (fp8_methods.W8A8_ROWS_MAX) Fp8ScaledMmLinearMethod hands q/k/v and gate/up
    their RMSNorm, and down_proj its SiLU-mul, writing e4m3 (one kernel each, not the norm's or the
    SiLU-mul's own then quantize_rows): the layer's outputs equal those of the unfused calls exactly."""
    from nanovllm.layers.fp8_methods import W8A8_ROWS_MAX

    method = Fp8ScaledMmLinearMethod(Fp8Scheme(None, True))
    assert method.bucket(W8A8_ROWS_MAX + 1).normed.__name__ == "fp8_scaled_mm_norm"
    assert method.bucket(W8A8_ROWS_MAX + 1).silu.__name__ == "fp8_scaled_mm_silu"
    layer = ReplicatedLinear(256, 96, bias=True, quant_method=method)
    weight, scale = quantize_groups(torch.randn(96, 256, generator=torch.Generator().manual_seed(4)), 256)
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    layer.weight_scale = torch.nn.Parameter(scale, requires_grad=False)
    layer.bias = torch.nn.Parameter(torch.randn(96), requires_grad=False)
    assert_folds_equal_the_unfused_calls(method, layer, W8A8_ROWS_MAX + 4, monkeypatch)


def fake_block_scaled_mm(a, b, scale_a, kind_a, scale_b, kind_b, output_dtype):
    """torch's block-scaled GEMM as its arguments mean it (the CPU has none): a [M, K] e4m3 with scales a
    row and 128 inputs, b = weight^T with one scale a 128 x 128 block (scale_b its [K / 128, N / 128])."""
    a = a.float() * scale_a.repeat_interleave(128, dim=1)
    kb, nb = b.shape[0] // 128, b.shape[1] // 128
    b = b.float() * scale_b[:kb, :nb].repeat_interleave(128, dim=0).repeat_interleave(128, dim=1)
    return (a @ b).to(output_dtype)


def test_the_block_method_folds_the_quantize_into_the_norm_and_the_silu_from_17_rows(monkeypatch):
    """Fp8BlockScaledMmLinearMethod from 17 rows: the norm and the SiLU-mul hand torch's block-scaled GEMM
    their e4m3 rows, padded and scaled as it takes them; the layer's outputs equal the unfused calls'."""
    import torch.nn.functional as F

    from nanovllm.layers.fp8 import quantize_blocks
    from nanovllm.layers.fp8_methods import Fp8BlockScaledMmLinearMethod

    monkeypatch.setattr(F, "scaled_mm", fake_block_scaled_mm, raising=False)
    scaling = type("ScalingType", (), {"BlockWise1x128": 0, "BlockWise128x128": 1})
    monkeypatch.setattr(F, "ScalingType", scaling, raising=False)
    method = Fp8BlockScaledMmLinearMethod(Fp8Scheme((128, 128), True))
    assert method.bucket(17).normed.__name__ == "fp8_block_scaled_mm_norm"
    assert method.bucket(17).silu.__name__ == "fp8_block_scaled_mm_silu"
    layer = ReplicatedLinear(256, 256, bias=True, quant_method=method)
    weight, blocks = quantize_blocks(torch.randn(256, 256, generator=torch.Generator().manual_seed(13)),
                                     (128, 128))
    layer.weight.data.copy_(weight)
    layer.weight_scale_inv.data.copy_(blocks.repeat_interleave(128, dim=0))
    method.process_weights_after_loading(layer)
    layer.bias = torch.nn.Parameter(torch.randn(256), requires_grad=False)
    assert_folds_equal_the_unfused_calls(method, layer, 19, monkeypatch)  # 19 rows: padded to 20
