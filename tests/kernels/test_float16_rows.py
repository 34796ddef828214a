"""kernels/float16_rows.py: bf16 rows as float16 times a power of two a row, bit for bit, on CPU tensors
through the Triton interpreter (or on CUDA with TRITON_INTERPRET=0): rows of any magnitude bf16 holds,
a zero row, a row whose largest value sits on a power of two, and strided rows."""

import pytest
import torch
from conftest import triton_test_device

pytest.importorskip("triton")

from nanovllm.kernels.float16_rows import float16_rows  # noqa: E402

DEVICE = triton_test_device()


def test_bf16_rows_come_back_bit_for_bit_from_float16_times_their_scale():
    gen = torch.Generator().manual_seed(3)
    magnitudes = torch.tensor([1e-30, 1e-3, 1.0, 100.0, 3e4, 1e6, 1e30, 0.0])
    x = (torch.randn(8, 1500, generator=gen) * magnitudes[:, None]).to(torch.bfloat16)
    x[6, 7] = 2.0**100  # the largest value a power of two: scaled to 2^14, not past 2^15
    wide = torch.empty(8, 2000, dtype=torch.bfloat16)
    wide[:, :1500] = x  # rows 2,000 apart: the kernel follows the stride
    values, scales = float16_rows(wide[:, :1500].to(DEVICE))
    values, scales = values.cpu(), scales.cpu()
    assert values.dtype == torch.float16 and scales.shape == (8, 1)
    assert torch.equal((values.float() * scales), x.float())
    assert (scales == torch.exp2(torch.log2(scales).round())).all()  # powers of two
    top = values.float().abs().amax(dim=1)
    assert ((top[:7] >= 2**14) & (top[:7] < 2**15)).all()  # each row's largest in [2^14, 2^15)
    assert scales[7].item() == 1.0 and not values[7].any()
