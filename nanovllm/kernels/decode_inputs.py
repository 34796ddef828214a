"""A decode graph's inputs put in place from the step's uploaded copy, in one kernel: static[j] = staged[j]
for every j, except that input id r takes the previous step's sampled id sampled[staged[prev_offset + r]]
where that row index is >= 0 (overlap scheduling). Before, the copy went straight into the graph's buffer
on the compute stream and five more device operations (two index copies, a gather, a cast, a scatter)
put the ids in place: 1-3 us each on a one-row step's critical path (docs/performance-notes.md, "Host
overhead"). Now the
copy runs on a stream of its own (runner/transfers.py) and this kernel is the one step before the graph.
The graph cannot read the uploaded copy itself: its buffers' addresses are fixed at capture, and the
uploads alternate between two slots."""

import torch
import triton
import triton.language as tl

BLOCK = 1024


# Triton builds a variant per integer argument that is 1 or a multiple of 16, and these change with the
# batch: one build for all (DecodeGraphs.capture builds it at start-up).
@triton.jit(do_not_specialize=["used", "num_ids", "prev_offset"])
def _place_inputs_kernel(static_ptr, staged_ptr, sampled_ptr, used, num_ids, prev_offset,
                         BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < used
    values = tl.load(staged_ptr + offs, mask=inside)
    rows = tl.load(staged_ptr + prev_offset + offs, mask=inside & (offs < num_ids), other=-1)
    take = rows >= 0
    tokens = tl.load(sampled_ptr + rows, mask=take, other=0)
    tl.store(static_ptr + offs, tl.where(take, tokens.to(values.dtype), values), mask=inside)


def place_decode_inputs(static: torch.Tensor, staged: torch.Tensor, num_ids: int, prev_offset: int,
                        sampled: torch.Tensor) -> None:
    """static[:len(staged)] = staged (int32, one dimension each), then static[r] = sampled[staged[prev_offset
    + r]] for r < num_ids where that index is >= 0. sampled: [rows of the previous step], int64."""
    used = staged.shape[0]
    if static.dim() != 1 or staged.dim() != 1 or used > static.shape[0] or prev_offset + num_ids > used:
        raise ValueError(f"staged {tuple(staged.shape)} must fit static {tuple(static.shape)} and hold "
                         f"{num_ids} previous rows from {prev_offset}")
    if sampled.dtype != torch.int64 or sampled.dim() != 1:
        raise ValueError(f"sampled must be one row of int64 ids, got {sampled.dtype} {tuple(sampled.shape)}")
    if used:
        _place_inputs_kernel[(triton.cdiv(used, BLOCK),)](static, staged, sampled, used, num_ids, prev_offset,
                                                          BLOCK=BLOCK)
