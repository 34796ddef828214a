"""kernels/prev_tokens.py against indexing in PyTorch, on CPU tensors through the Triton interpreter (or on
CUDA with TRITON_INTERPRET=0): only the rows with a previous row change, and every row count."""

import pytest
import torch
from conftest import triton_test_device

pytest.importorskip("triton")

from nanovllm.kernels.prev_tokens import take_prev_tokens  # noqa: E402

DEVICE = triton_test_device()


@pytest.mark.parametrize("n", [1, 5, 1024, 1500])
def test_rows_with_a_previous_row_take_its_token(n: int):
    gen = torch.Generator().manual_seed(n)
    input_ids = torch.randint(0, 1000, (n,), generator=gen, dtype=torch.int32)
    prev_rows = torch.randint(-1, 7, (n,), generator=gen, dtype=torch.int32)
    sampled = torch.randint(1000, 2000, (7,), generator=gen, dtype=torch.int64)
    want = input_ids.clone()
    want[prev_rows >= 0] = sampled[prev_rows[prev_rows >= 0].long()].to(torch.int32)
    got = input_ids.clone().to(DEVICE)
    take_prev_tokens(got, prev_rows.to(DEVICE), sampled.to(DEVICE))
    assert torch.equal(got.cpu(), want)
    assert (got.cpu() != input_ids).sum() == (prev_rows >= 0).sum()  # tokens 1000+: every taken row changed


def test_shapes_are_checked():
    ids = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="prev_rows"):
        take_prev_tokens(ids, torch.zeros(2, dtype=torch.int32, device=DEVICE), torch.zeros(2, device=DEVICE))
