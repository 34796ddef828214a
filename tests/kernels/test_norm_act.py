"""The RMSNorm, add+RMSNorm and SiLU-mul kernels against the PyTorch functions the CPU path runs (the
same roundings), on CPU tensors through the Triton interpreter (or on CUDA with TRITON_INTERPRET=0)."""

import pytest
import torch
import torch.nn.functional as F
from conftest import triton_test_device

pytest.importorskip("triton")

from nanovllm.attention.layer import rms_norm  # noqa: E402
from nanovllm.kernels import norm_act  # noqa: E402

DEVICE = triton_test_device()
EPS = 1e-6


def tensors(rows, cols, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen).to(DEVICE, dtype)
    residual = torch.randn(rows, cols, generator=gen).to(DEVICE, dtype)
    weight = (1 + 0.1 * torch.randn(cols, generator=gen)).to(DEVICE, dtype)
    return x, residual, weight


def assert_matches(got, want, dtype):
    assert got.dtype == want.dtype and got.shape == want.shape
    # Only the order of the float32 sum of squares differs: at most one rounding step of the output.
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows,cols", [(1, 64), (5, 96), (3, 1024)])
def test_rms_norm_matches_pytorch(dtype, rows, cols):
    x, _, weight = tensors(rows, cols, dtype)
    assert_matches(norm_act.rms_norm(x, weight, EPS), rms_norm(x, weight, EPS), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_returns_the_norm_and_the_sum(dtype):
    x, residual, weight = tensors(4, 128, dtype, seed=1)
    out, summed = norm_act.add_rms_norm(x, residual, weight, EPS)
    want_sum = x + residual
    if DEVICE == "cuda" or dtype == torch.float32:
        assert torch.equal(summed, want_sum)  # one rounding of the exact sum, as PyTorch's add
    else:  # the interpreter casts float32 to bfloat16 by truncation: one unit in the last place off
        torch.testing.assert_close(summed.float(), want_sum.float(), rtol=2**-7, atol=0)
    assert_matches(out, rms_norm(want_sum, weight, EPS), dtype)


def test_rms_norm_takes_3d_inputs_and_strided_rows():
    x, _, weight = tensors(6, 64, torch.float32, seed=2)
    wide = torch.cat([x, x], dim=1)[:, :64]  # rows with a stride of 128, contiguous last dim
    assert_matches(norm_act.rms_norm(wide, weight, EPS), rms_norm(x, weight, EPS), torch.float32)
    out = norm_act.rms_norm(x.view(2, 3, 64), weight, EPS)
    assert out.shape == (2, 3, 64)
    assert_matches(out.view(6, 64), rms_norm(x, weight, EPS), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,n", [(1, 48), (3, 1500)])
def test_silu_and_mul_matches_pytorch(dtype, rows, n):
    gen = torch.Generator().manual_seed(n)
    x = (4 * torch.randn(rows, 2 * n, generator=gen)).to(DEVICE, dtype)
    want = (F.silu(x[:, :n].float()) * x[:, n:].float()).to(dtype)  # float32 inside, one rounding
    got = norm_act.silu_and_mul(x)
    assert got.shape == (rows, n)
    assert_matches(got, want, dtype)


def test_empty_batches_and_bad_arguments():
    x, residual, weight = tensors(0, 64, torch.float32)
    assert norm_act.rms_norm(x, weight, EPS).shape == (0, 64)
    assert norm_act.silu_and_mul(torch.empty(0, 64, device=DEVICE)).shape == (0, 32)
    x, residual, weight = tensors(2, 64, torch.float32)
    with pytest.raises(ValueError, match="weight"):
        norm_act.rms_norm(x, weight[:32], EPS)
    with pytest.raises(ValueError, match="residual"):
        norm_act.add_rms_norm(x, residual[:1], weight, EPS)
    with pytest.raises(ValueError, match="odd"):
        norm_act.silu_and_mul(x[:, :63])
