"""The per-step batch record: everything a step's forward pass and sampler need, as plain Python
lists, built once on rank 0 from the scheduled sequences. It is what the tensor-parallel workers
receive (pickled), and what the eager path, the CUDA-graph path and the sampler all read. Pure Python.

Per scheduled sequence, the tokens it computes this step are the last `q_len` of its context:

    token ids:  |---- num_computed_tokens ----|---- scheduled (q_len) ----|---- later chunks ----|
                                              ^ start                    ^ end = seqlens_k[i]
    slot = block_table[pos // block_size] * block_size + pos % block_size
"""

from dataclasses import dataclass
from typing import Protocol

# Mixes a request's seed with the index of the token being sampled, so each step of a seeded request
# draws fresh noise that depends only on (seed, index): reproducible across batches and preemption.
SEED_STRIDE = 0x9E3779B97F4A7C15
SEED_MASK = (1 << 63) - 1


class ScheduledSequence(Protocol):
    """What building a batch reads of a scheduled sequence (nanovllm.engine.sequence.Sequence)."""

    token_ids: list[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    block_table: list[int]
    block_size: int
    sampling_params: object  # temperature, top_k, top_p, min_p, seed
    num_completion_tokens: int

    def __len__(self) -> int: ...


@dataclass(slots=True)
class SamplingBatch:
    """Sampling parameters of the rows that sample, in `StepBatch.sample_rows` order."""

    temperatures: list[float]  # 0 = greedy
    top_ks: list[int]  # -1 = disabled
    top_ps: list[float]
    min_ps: list[float]
    seeds: list[int | None]  # already mixed with the index of the token being sampled


@dataclass(slots=True)
class StepBatch:
    is_prefill: bool  # False: every sequence computes exactly its last token (a decode step)
    input_ids: list[int]  # [num_tokens], sequences one after another
    positions: list[int]  # [num_tokens]
    slot_mapping: list[int]  # [num_tokens]
    cu_seqlens_q: list[int]  # [num_seqs + 1]: sequence i's tokens are [cu[i], cu[i + 1])
    seqlens_k: list[int]  # [num_seqs]: context length after this step
    block_tables: list[list[int]]  # [num_seqs][num_blocks]
    sample_rows: list[int]  # sequences whose computation reaches their end: they sample a token
    sampling: SamplingBatch

    @property
    def num_seqs(self) -> int:
        return len(self.seqlens_k)

    @property
    def logits_indices(self) -> list[int]:
        """The token whose hidden state each sampling row samples from: its sequence's last."""
        return [self.cu_seqlens_q[row + 1] - 1 for row in self.sample_rows]


def slots(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Cache slots of positions [start, end) of one sequence, one block run at a time."""
    out: list[int] = []
    for i in range(start // block_size, (end + block_size - 1) // block_size):
        base = block_table[i] * block_size - i * block_size
        out.extend(range(base + max(start, i * block_size), base + min(end, (i + 1) * block_size)))
    return out


def _sampling(seqs: list[ScheduledSequence]) -> SamplingBatch:
    batch = SamplingBatch([], [], [], [], [])
    for seq in seqs:
        p = seq.sampling_params
        batch.temperatures.append(p.temperature)
        batch.top_ks.append(p.top_k)
        batch.top_ps.append(p.top_p)
        batch.min_ps.append(p.min_p)
        batch.seeds.append(None if p.seed is None else
                           (p.seed * SEED_STRIDE + seq.num_completion_tokens) & SEED_MASK)
    return batch


def build_batch(seqs: list[ScheduledSequence], is_prefill: bool) -> StepBatch:
    """The record of one step over `seqs`, each computing its `num_scheduled_tokens` next tokens.
    Runs once per step on the host, so the common one-token case takes a short path."""
    input_ids, positions, slot_mapping, cu_q, seqlens_k, sample_rows = [], [], [], [0], [], []
    num_tokens = 0
    for row, seq in enumerate(seqs):
        start = seq.num_computed_tokens
        num = seq.num_scheduled_tokens
        end = start + num
        if num == 1:  # a decode token (or a prompt's last): one position, one slot
            block_size = seq.block_size
            input_ids.append(seq.token_ids[start])
            positions.append(start)
            slot_mapping.append(seq.block_table[start // block_size] * block_size + start % block_size)
        else:
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slot_mapping.extend(slots(seq.block_table, start, end, seq.block_size))
        num_tokens += num
        cu_q.append(num_tokens)
        seqlens_k.append(end)
        if end == len(seq):  # the whole sequence is computed: its next token is sampled
            sample_rows.append(row)
    sampled = seqs if len(sample_rows) == len(seqs) else [seqs[row] for row in sample_rows]
    return StepBatch(is_prefill, input_ids, positions, slot_mapping, cu_q, seqlens_k,
                     [seq.block_table for seq in seqs], sample_rows, _sampling(sampled))
