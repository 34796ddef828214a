"""A step the overlap loop launched and has not read yet (nanovllm.engine.overlap): what it ran, where
each sequence's sampled ids lie among its outputs, and how the next step takes the tokens it is still
sampling (on the device, never through the host), and what a proposer of drafts is told of it. Pure
Python."""

from dataclasses import dataclass, field

from nanovllm.engine.executor import PendingStep
from nanovllm.engine.sequence import PENDING_TOKEN_ID, Sequence
from nanovllm.engine.step import StepBatch


@dataclass(slots=True)
class InFlightStep:
    seqs: list[Sequence]
    sample_rows: list[int]
    output: PendingStep
    # Some sequence builds its next step from this step's tokens on the host: wait for them first.
    needs_host_tokens: bool
    is_prefill: bool
    # Per sampling row, the drafts it verifies; [] when no row verifies any (a plain step).
    drafts: list[list[int]]
    # Per sampling row, the index of its last sampled id among the step's (one a verified position).
    last_ids: list[int] | range = field(init=False)
    # Per sampling row of a verification step, its sequence's length before the commit (where the
    # assumed tokens begin).
    starts: list[int] = field(default_factory=list)
    # Per sampling row of a verification step, its sequence's num_preemptions at the commit: a sequence
    # preempted since (and perhaps admitted again, its KV recomputed) keeps the scheduler's count of it.
    preemptions: list[int] = field(default_factory=list)
    # Sequences whose rows here took drafts that the step before rejected: not committed, not read.
    void: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        if not self.drafts:
            self.last_ids = range(len(self.sample_rows))
            return
        self.last_ids, end = [], -1
        for drafts in self.drafts:
            end += 1 + len(drafts)
            self.last_ids.append(end)


@dataclass(frozen=True, slots=True)
class PendingTokens:
    """Where a step in flight samples the pending last tokens (PENDING_TOKEN_ID) of the sequences it ran:
    `rows[seq_id]` indexes `step`'s sampled ids. A draft model feeds them to its own steps on the device
    (StepBatch.prev_token_*), as the overlap loop's next step does (speculative/draft.py)."""

    step: PendingStep
    rows: dict[int, int]

    @classmethod
    def of(cls, step: InFlightStep) -> "PendingTokens":
        """The pending tokens of `step`'s sampling rows, but for its void sequences'."""
        rows = zip(step.sample_rows, step.last_ids, strict=True)
        return cls(step.output, {step.seqs[row].seq_id: last for row, last in rows
                                 if step.seqs[row].seq_id not in step.void})


def feed_previous_tokens(batch: StepBatch, seqs: list[Sequence], prev: InFlightStep) -> None:
    """Point each sampling row of `batch` whose first new input token is still pending (its last, or
    the one before its drafts) at the previous step's sampled id for it."""
    prev_rows = {prev.seqs[row].seq_id: last for row, last in zip(prev.sample_rows, prev.last_ids)
                 if prev.seqs[row].seq_id not in prev.void}
    spec = batch.spec_token_ids
    for i, row in enumerate(batch.sample_rows):
        prev_row = prev_rows.get(seqs[row].seq_id)
        if prev_row is None:
            continue
        index = batch.cu_seqlens_q[row + 1] - 1 - (len(spec[i]) if spec else 0)
        assert batch.input_ids[index] == PENDING_TOKEN_ID, f"sequence {seqs[row].seq_id} has no pending token"
        batch.prev_token_indices.append(index)
        batch.prev_token_rows.append(prev_row)
