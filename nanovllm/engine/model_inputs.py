"""Turns a scheduled batch into model inputs: token ids, positions, the attention metadata, the rows
to sample and their sampling parameters. Built as host lists, then copied to the device once."""

from dataclasses import dataclass, field

import torch

from nanovllm.attention.metadata import AttentionMetadata
from nanovllm.engine.sequence import Sequence
from nanovllm.layers.sampler import SamplingTensors

# Mixes a request's seed with the index of the token being sampled, so each step of a seeded request
# draws fresh noise that depends only on (seed, index): reproducible across batches and preemption.
SEED_STRIDE = 0x9E3779B97F4A7C15
SEED_MASK = (1 << 63) - 1


@dataclass(slots=True)
class ModelInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: list[int]  # which sequences of the batch get a new token this step
    logits_indices: torch.Tensor  # the token whose hidden state each sampled row uses
    # (row, flat index of position lo, lo, hi) per sequence computing prompt logprobs of positions [lo, hi)
    prompt_logprob_spans: list[tuple[int, int, int, int]] = field(default_factory=list)


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    pin = device.type == "cuda"
    return torch.tensor(values, dtype=dtype, pin_memory=pin).to(device, non_blocking=pin)


def _slots(seq: Sequence, start: int, end: int) -> list[int]:
    # slot = block_table[pos // block_size] * block_size + pos % block_size, one block run at a time
    bs, slots = seq.block_size, []
    for i in range(start // bs, (end + bs - 1) // bs):
        base = seq.block_table[i] * bs - i * bs
        slots.extend(range(base + max(start, i * bs), base + min(end, (i + 1) * bs)))
    return slots


def _block_tables(seqs: list[Sequence], device: torch.device) -> torch.Tensor:
    width = max(len(seq.block_table) for seq in seqs)
    return _to_device([seq.block_table + [0] * (width - len(seq.block_table)) for seq in seqs],
                      torch.int32, device)


def prepare_prefill(seqs: list[Sequence], device: torch.device) -> ModelInputs:
    input_ids, positions, slot_mapping, cu_q, cu_k, seqlens_k = [], [], [], [0], [0], []
    sample_rows, logits_indices, has_prefix, spans = [], [], False, []
    for row, seq in enumerate(seqs):
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + seq.num_scheduled_tokens
        input_ids.extend(seq.token_ids[start:end])
        positions.extend(range(start, end))
        slot_mapping.extend(_slots(seq, start, end))
        cu_q.append(cu_q[-1] + end - start)
        cu_k.append(cu_k[-1] + end)
        seqlens_k.append(end)
        has_prefix |= start > 0
        span = seq.prompt_logprob_span()
        if span is not None:
            spans.append((row, cu_q[-2] + span[0] - start, *span))
        if end == len(seq):  # the whole sequence is computed: its next token is sampled
            sample_rows.append(row)
            logits_indices.append(cu_q[-1] - 1)
    meta = AttentionMetadata(
        is_prefill=True, slot_mapping=_to_device(slot_mapping, torch.int64, device),
        seqlens_k=_to_device(seqlens_k, torch.int32, device), block_tables=_block_tables(seqs, device),
        cu_seqlens_q=_to_device(cu_q, torch.int32, device),
        cu_seqlens_k=_to_device(cu_k, torch.int32, device),
        max_seqlen_q=max(b - a for a, b in zip(cu_q, cu_q[1:], strict=False)), max_seqlen_k=max(seqlens_k),
        has_prefix=has_prefix, cu_seqlens_q_host=cu_q, seqlens_k_host=seqlens_k)
    return ModelInputs(_to_device(input_ids, torch.int64, device), _to_device(positions, torch.int64, device),
                       meta, sample_rows, _to_device(logits_indices, torch.int64, device), spans)


def prepare_decode(seqs: list[Sequence], device: torch.device) -> ModelInputs:
    input_ids = [seq.token_ids[-1] for seq in seqs]
    positions = [len(seq) - 1 for seq in seqs]
    slot_mapping = [seq.block_table[-1] * seq.block_size + (len(seq) - 1) % seq.block_size for seq in seqs]
    seqlens_k = [len(seq) for seq in seqs]
    meta = AttentionMetadata(
        is_prefill=False, slot_mapping=_to_device(slot_mapping, torch.int64, device),
        seqlens_k=_to_device(seqlens_k, torch.int32, device), block_tables=_block_tables(seqs, device),
        max_seqlen_k=max(seqlens_k), seqlens_k_host=seqlens_k)
    rows = list(range(len(seqs)))
    return ModelInputs(_to_device(input_ids, torch.int64, device), _to_device(positions, torch.int64, device),
                       meta, rows, _to_device(rows, torch.int64, device))


def prepare_sampling(seqs: list[Sequence], vocab_size: int, device: torch.device) -> SamplingTensors:
    params = [seq.sampling_params for seq in seqs]
    temperatures = [p.temperature for p in params]
    if all(t == 0 for t in temperatures):
        return SamplingTensors(None, all_greedy=True)
    tensors = SamplingTensors(_to_device(temperatures, torch.float32, device), all_greedy=False)
    top_ks = [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params]
    if min(top_ks) < vocab_size:
        tensors.top_ks, tensors.max_top_k = _to_device(top_ks, torch.int64, device), max(top_ks)
    if any(p.top_p < 1.0 for p in params):
        tensors.top_ps = _to_device([p.top_p for p in params], torch.float32, device)
    if any(p.min_p > 0.0 for p in params):
        tensors.min_ps = _to_device([p.min_p for p in params], torch.float32, device)
    tensors.seeded_rows = [
        (row, (seq.seed * SEED_STRIDE + seq.num_completion_tokens) & SEED_MASK)
        for row, seq in enumerate(seqs) if seq.seed is not None] or None
    return tensors
