"""The draft model's steps, as the proposer (nanovllm.speculative.draft) builds and reads them: the
record of a step over a few positions of each sequence (draft_batch), its inputs still being sampled
by a step in flight (fed on the device), reading a launched step's tokens into the proposals, and the last
drafts a proposal leaves on the device for the verification to take there (LastDrafts)."""

from dataclasses import dataclass
from typing import Protocol

import torch

from nanovllm.engine.in_flight import PendingTokens
from nanovllm.engine.sequence import PENDING_TOKEN_ID
from nanovllm.engine.step import SamplingBatch, StepBatch, slots


class DraftSequence(Protocol):
    """What the proposer reads and writes of a sequence (nanovllm.engine.sequence.Sequence)."""

    seq_id: int
    token_ids: list[int]  # the last may be PENDING_TOKEN_ID (overlap loop: PendingTokens says where it is)
    block_table: list[int]
    num_draft_computed_tokens: int  # positions [0, n) of the draft's cache hold token_ids[:n]


@dataclass(slots=True)
class DraftRow:
    """Positions [start, start + len(input_ids)) of one sequence, computed by one draft step."""

    input_ids: list[int]
    start: int
    block_table: list[int]
    samples: bool  # its last token's logits propose the next draft


def draft_batch(rows: list[DraftRow], block_size: int, greedy: bool = False, every_position: bool = False
                ) -> StepBatch:
    """The step record of `rows` (a decode step when each computes one token): without a sampling part
    (the proposer takes the argmax of the logits itself), or greedy for every row. every_position: shaped
    as a verification of each row's tokens after its first, greedy at every position (each row samples)."""
    input_ids, positions, slot_mapping, cu_q, seqlens_k, tables = [], [], [], [0], [], []
    for row in rows:
        end = row.start + len(row.input_ids)
        input_ids.extend(row.input_ids)
        positions.extend(range(row.start, end))
        slot_mapping.extend(slots(row.block_table, row.start, end, block_size))
        cu_q.append(len(input_ids))
        seqlens_k.append(end)
        tables.append(row.block_table[:-(-end // block_size)])  # only the blocks it reads
    sample_rows = [i for i, row in enumerate(rows) if row.samples]
    n = len(input_ids) if every_position else len(sample_rows)
    sampling = (SamplingBatch([0.0] * n, [-1] * n, [1.0] * n, [0.0] * n, [None] * n, [None] * n)
                if greedy or every_position else None)
    batch = StepBatch(len(input_ids) > len(rows), input_ids, positions, slot_mapping, cu_q, seqlens_k, tables,
                      sample_rows, sampling)
    if every_position:
        batch.spec_token_ids = [row.input_ids[1:] for row in rows]
    return batch


def read_step(proposals: list[list[int]], active: list[int], pending: object, rows: list[int] | None) -> None:
    """Append a launched step's sampled ids (those at `rows`, or all) to the proposals of the sequences
    it ran."""
    token_ids = pending.wait().token_ids
    for i, token in zip(active, token_ids if rows is None else [token_ids[r] for r in rows], strict=True):
        proposals[i].append(token)


def feed_pending(batch: StepBatch, seqs: list[DraftSequence], rows: list[DraftRow],
                 pending: PendingTokens | None) -> object:
    """Point batch's inputs that are a pending token (a row's last, in the overlap loop) at the step in
    flight's sampled id for it; returns that step for the launch, or None when no input is pending."""
    end = 0
    for seq, row in zip(seqs, rows, strict=True):
        end += len(row.input_ids)
        if row.input_ids[-1] == PENDING_TOKEN_ID:
            if pending is None or seq.seq_id not in pending.rows:
                raise RuntimeError(f"sequence {seq.seq_id}'s last token is pending, and no step in flight "
                                   "samples it")
            batch.prev_token_indices.append(end - 1)
            batch.prev_token_rows.append(pending.rows[seq.seq_id])
    return pending.step if batch.prev_token_indices else None


@dataclass(slots=True)
class LastDrafts:
    """The last drafts of a proposal, still being sampled by the draft's final step (overlap loop): the
    verification takes them on the device (`feeding`), the host reads them once it is launched (`read`).
    rows: per sequence (seq_id), its row among that step's sampled ids."""

    step: object  # the draft runner's PendingOutput
    rows: dict[int, int]
    seqs: list[DraftSequence]

    def feeding(self, previous: object | None) -> tuple[object, int]:
        """What a step launched now reads its previous-step inputs from: `previous`'s sampled ids (the
        target's step in flight; None: no such inputs), then the drafts' (a new device tensor, queued in
        order on the stream); and where the drafts' rows begin among them."""
        drafts = self.step.sampled
        if previous is None:
            return FedTokens(drafts), 0
        sampled = previous.sampled
        return FedTokens(torch.cat([sampled, drafts.to(sampled.dtype)])), sampled.shape[0]

    def read(self) -> dict[int, int]:
        """Wait for the step; each sequence's last draft."""
        token_ids = self.step.wait().token_ids
        return {seq_id: token_ids[row] for seq_id, row in self.rows.items()}


@dataclass(frozen=True, slots=True)
class FedTokens:
    """A launch's `previous` (ModelRunner.launch): the sampled ids its prev_token_* inputs index."""

    sampled: object
