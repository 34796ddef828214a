"""kernels/decode_inputs.py against copying and indexing in PyTorch, on CPU tensors through the Triton
interpreter (or on CUDA with TRITON_INTERPRET=0): the whole staged copy lands, and among the input ids
only the rows with a previous row take a sampled token; at every size."""

import pytest
import torch
from conftest import triton_test_device

pytest.importorskip("triton")

from nanovllm.kernels.decode_inputs import place_decode_inputs  # noqa: E402

DEVICE = triton_test_device()


@pytest.mark.parametrize("rows", [1, 5, 1024, 1500])
def test_inputs_land_and_rows_with_a_previous_row_take_its_token(rows: int):
    """Layout as the decode graphs': input ids first, a prev_rows field at prev_offset, other fields after."""
    gen = torch.Generator().manual_seed(rows)
    prev_offset, used = 2 * rows, 3 * rows + 17
    staged = torch.randint(0, 1000, (used,), generator=gen, dtype=torch.int32)
    staged[prev_offset : prev_offset + rows] = torch.randint(-1, 7, (rows,), generator=gen, dtype=torch.int32)
    sampled = torch.randint(1000, 2000, (7,), generator=gen, dtype=torch.int64)
    static = torch.full((used + 5,), -7, dtype=torch.int32)
    want = static.clone()
    want[:used] = staged
    prev_rows = staged[prev_offset : prev_offset + rows]
    take = prev_rows >= 0
    want[:rows][take] = sampled[prev_rows[take].long()].to(torch.int32)
    got = static.to(DEVICE)
    place_decode_inputs(got, staged.to(DEVICE), rows, prev_offset, sampled.to(DEVICE))
    assert torch.equal(got.cpu(), want)
    assert (got.cpu()[:rows] != staged[:rows]).sum() == take.sum()  # tokens 1000+: every taken row changed


def test_no_previous_rows_is_a_plain_copy():
    staged = torch.arange(40, dtype=torch.int32)
    staged[10:20] = -1
    static = torch.zeros(64, dtype=torch.int32, device=DEVICE)
    place_decode_inputs(static, staged.to(DEVICE), 10, 10, torch.zeros(1, dtype=torch.int64, device=DEVICE))
    assert torch.equal(static.cpu()[:40], staged) and not static.cpu()[40:].any()


def test_shapes_and_dtypes_are_checked():
    static = torch.zeros(8, dtype=torch.int32, device=DEVICE)
    ids = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="must fit"):
        place_decode_inputs(static, torch.zeros(9, dtype=torch.int32, device=DEVICE), 1, 0, ids)
    with pytest.raises(ValueError, match="previous rows"):
        place_decode_inputs(static, torch.zeros(8, dtype=torch.int32, device=DEVICE), 4, 6, ids)
    with pytest.raises(ValueError, match="int64"):
        place_decode_inputs(static, torch.zeros(8, dtype=torch.int32, device=DEVICE), 1, 4, ids.int())
