"""The previous step's sampled ids put into a decode step's input ids on the device (overlap scheduling):
input_ids[r] = sampled[prev_rows[r]] wherever prev_rows[r] >= 0, in one kernel. Before each decode graph
this took five device operations (two index copies, a gather, a cast, a scatter) of 1-3 us each, on the
critical path of a one-row step (BENCHMARKS.md, fourteenth session, S2; S7: a one-row step 1.6% shorter
with this). prev_rows arrives with the graph's other inputs in its one staging copy."""

import torch
import triton
import triton.language as tl


@triton.jit
def _take_prev_tokens_kernel(ids_ptr, prev_rows_ptr, sampled_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    rows = tl.load(prev_rows_ptr + offs, mask=offs < n, other=-1)
    take = rows >= 0
    tokens = tl.load(sampled_ptr + rows, mask=take, other=0)
    tl.store(ids_ptr + offs, tokens.to(ids_ptr.dtype.element_ty), mask=take)


def take_prev_tokens(input_ids: torch.Tensor, prev_rows: torch.Tensor, sampled: torch.Tensor) -> None:
    """input_ids[r] = sampled[prev_rows[r]] where prev_rows[r] >= 0 (int32 ids and rows, [n] each; sampled
    [rows of the previous step], any integer dtype), in place."""
    if input_ids.shape != prev_rows.shape or input_ids.dim() != 1 or sampled.dim() != 1:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} and prev_rows {tuple(prev_rows.shape)} must be "
                         f"one [n] each, sampled {tuple(sampled.shape)} one row")
    n = input_ids.shape[0]
    if n:
        block = min(1024, triton.next_power_of_2(n))
        _take_prev_tokens_kernel[(triton.cdiv(n, block),)](input_ids, prev_rows, sampled, n, BLOCK=block)
