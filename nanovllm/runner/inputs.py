"""Turns a StepBatch into device tensors: token ids, positions, the attention metadata, the hidden
rows to sample from, the sampler's per-row parameters and the logits processors' tensors. Copied
host -> device once per field, from pinned memory on CUDA so the copies do not block the host.

An eager step on CUDA may be padded to `padded_num_tokens` rows: cuBLAS chooses a GEMM kernel per
matrix shape and caches the choice, and a shape it has not met cost ~130 us of host time per linear
layer against ~15 us (H200, docs/performance-notes.md, "CUDA graphs"), while a mixed step's token count
changes every step.
With the padding (and runner/warm_up.py) a mixed step launched in 16.4 ms instead of 19.4
(docs/performance-notes.md, "CUDA graphs").
Padding rows are token 0 at position 0 with slot -1 (no KV stored); the attention metadata describes
only the real tokens, so no attention kernel reads a padding row (the attention layer zeroes their
output), and nothing samples from one."""

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from nanovllm.attention.metadata import AttentionMetadata
from nanovllm.engine.step import SEED_MASK, ProcessorRow, SamplingBatch, StepBatch
from nanovllm.layers.logits_processors import LogitsProcessorTensors, padded_ids, scatter_ids
from nanovllm.layers.sampler import SamplingTensors
from nanovllm.runner.grammar_bitmask import GrammarBitmask


@dataclass(slots=True)
class ModelInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # the token whose hidden state each sampled row uses


# Eager token counts are padded to a power of two up to this, and to a multiple of it above.
PAD_MULTIPLE = 64


def padded_num_tokens(num_tokens: int) -> int:
    if num_tokens <= PAD_MULTIPLE:
        return 1 << max(0, num_tokens - 1).bit_length()
    return -(-num_tokens // PAD_MULTIPLE) * PAD_MULTIPLE


def token_buckets(max_num_tokens: int) -> list[int]:
    """Every padded_num_tokens value of 1 .. max_num_tokens tokens."""
    return sorted({padded_num_tokens(n) for n in range(1, max_num_tokens + 1)})


def longest_first(seqlens_k: np.ndarray) -> np.ndarray:
    """The rows by context length, longest first: the order the decode kernel starts them in."""
    return np.argsort(-seqlens_k, kind="stable")


# numpy's dtype for each torch dtype the inputs use.
NUMPY_DTYPES = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32}
# From this many values a list goes through numpy: torch.tensor converts a 16k-id list in ~2.7 ms on the
# CI machine, numpy in ~0.5 (a 16k-token prefill step has four such lists); short ones are faster direct.
NUMPY_FROM = 512


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    pin = device.type == "cuda"
    if len(values) >= NUMPY_FROM and dtype in NUMPY_DTYPES:
        host = torch.from_numpy(np.asarray(values, dtype=NUMPY_DTYPES[dtype]))
        host = host.pin_memory() if pin else host
    else:
        host = torch.tensor(values, dtype=dtype, pin_memory=pin)
    return host.to(device, non_blocking=pin)


def _block_tables(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    width = max(len(table) for table in tables)
    return to_device([table + [0] * (width - len(table)) for table in tables], torch.int32, device)


def model_inputs(batch: StepBatch, device: torch.device, num_padded: int | None = None) -> ModelInputs:
    """The step's tensors; num_padded (at least the step's token count): pad the token-wise inputs to
    that many rows (see the module docstring)."""
    cu_q, seqlens_k = batch.cu_seqlens_q, batch.seqlens_k
    input_ids, positions, slot_mapping = batch.input_ids, batch.positions, batch.slot_mapping
    pad = (num_padded or 0) - len(input_ids)
    if pad > 0:
        input_ids, positions = input_ids + [0] * pad, positions + [0] * pad
        slot_mapping = slot_mapping + [-1] * pad
    q_lens = [b - a for a, b in zip(cu_q, cu_q[1:])]
    cu_k = [0]
    for seqlen in seqlens_k:
        cu_k.append(cu_k[-1] + seqlen)
    meta = AttentionMetadata(
        is_prefill=batch.is_prefill, slot_mapping=to_device(slot_mapping, torch.int64, device),
        seqlens_k=to_device(seqlens_k, torch.int32, device),
        block_tables=_block_tables(batch.block_tables, device),
        max_seqlen_q=max(q_lens), max_seqlen_k=max(seqlens_k), seqlens_k_host=seqlens_k,
        has_prefix=any(k > q for k, q in zip(seqlens_k, q_lens)))
    if batch.is_prefill:
        meta.num_decode_rows = next((i for i, n in enumerate(q_lens) if n != 1), len(q_lens))
    num_decoding = meta.num_decode_rows if batch.is_prefill else len(seqlens_k)
    if num_decoding:
        order = longest_first(np.asarray(seqlens_k[:num_decoding], dtype=np.int32))
        meta.decode_order = to_device(order.tolist(), torch.int32, device)  # a few us of host time
    if batch.is_prefill:
        meta.cu_seqlens_q = to_device(cu_q, torch.int32, device)
        meta.cu_seqlens_k = to_device(cu_k, torch.int32, device)
        meta.cu_seqlens_q_host = cu_q
        if 0 < meta.num_decode_rows < len(seqlens_k):
            d = meta.num_decode_rows
            meta.prefill_cu_seqlens_q = to_device([n - d for n in cu_q[d:]], torch.int32, device)
    return ModelInputs(to_device(input_ids, torch.int64, device), to_device(positions, torch.int64, device),
                       meta, to_device(batch.logits_indices, torch.int64, device))


# Puts a list on the device as a tensor of the dtype (to_device's job, or runner/transfers.Uploads.put).
Put = Callable[[list, torch.dtype], torch.Tensor]


def sampling_tensors(sampling: SamplingBatch, vocab_size: int, device: torch.device,
                     noise_seed: int | None = None, put: Put | None = None) -> SamplingTensors:
    """The rows' parameters as tensors, each through put (default: a copy of its own); noise_seed (a
    fresh random number per step): also a Philox seed per row for the fused race, noise_seed + row for
    rows without a seed of their own."""
    if put is None:
        put = lambda values, dtype: to_device(values, dtype, device)  # noqa: E731
    temperatures = sampling.temperatures
    if all(t == 0 for t in temperatures):
        return SamplingTensors(None, all_greedy=True)
    tensors = SamplingTensors(put(temperatures, torch.float32), all_greedy=False)
    top_ks = [min(k, vocab_size) if k > 0 else vocab_size for k in sampling.top_ks]
    if min(top_ks) < vocab_size:
        tensors.top_ks, tensors.max_top_k = put(top_ks, torch.int64), max(top_ks)
    if any(p < 1.0 for p in sampling.top_ps):
        tensors.top_ps = put(sampling.top_ps, torch.float32)
    if any(p > 0.0 for p in sampling.min_ps):
        tensors.min_ps = put(sampling.min_ps, torch.float32)
    tensors.seeded_rows = [(row, seed) for row, seed in enumerate(sampling.seeds) if seed is not None] or None
    if noise_seed is not None:
        tensors.seeds = put(race_seeds(sampling.seeds, noise_seed), torch.int64)
    return tensors


def race_seeds(seeds: list[int | None], noise_seed: int) -> list[int]:
    """A Philox seed per row for the fused race: the row's own, else noise_seed + its row."""
    return [(noise_seed + row) & SEED_MASK if seed is None else seed for row, seed in enumerate(seeds)]


def logits_processor_tensors(rows: list[ProcessorRow | None] | None, vocab_size: int, device: torch.device,
                             bitmask: GrammarBitmask | None = None) -> LogitsProcessorTensors | None:
    """The processors' tensors for the sampling rows (SamplingBatch.processors); None when none is used.
    bitmask: the runner's, which keeps its host buffer across steps (a one-off one when not given)."""
    if rows is None:
        return None
    t, used = LogitsProcessorTensors(), False
    grammar_rows = [i for i, r in enumerate(rows) if r is not None and r.grammar is not None]
    if grammar_rows:
        bitmask = bitmask or GrammarBitmask(vocab_size, device)
        t.bitmask = bitmask.fill([rows[i].grammar for i in grammar_rows])
        if len(grammar_rows) < len(rows):
            t.bitmask_rows = torch.tensor(grammar_rows, dtype=torch.int64).to(device, non_blocking=True)
        used = True
    if any(r is not None and r.allowed_token_ids is not None for r in rows):
        ids = [(r.allowed_token_ids if r is not None else None) or [] for r in rows]
        allowed = scatter_ids(padded_ids(ids, vocab_size, device), vocab_size, torch.bool)
        unrestricted = torch.tensor([r is None or r.allowed_token_ids is None for r in rows], device=device)
        t.allowed, used = allowed | unrestricted.unsqueeze(1), True
    pairs = [(i, tok) for i, r in enumerate(rows) if r is not None for tok in r.banned_token_ids]
    if pairs:
        index, ids = zip(*pairs, strict=True)
        t.masked = (torch.tensor(index, device=device), torch.tensor(ids, device=device))
        used = True
    triples = [(i, tok, b) for i, r in enumerate(rows) if r is not None
               for tok, b in (r.logit_bias or {}).items()]
    if triples:
        index, ids, values = zip(*triples, strict=True)
        t.bias = (torch.tensor(index, device=device), torch.tensor(ids, device=device),
                  torch.tensor(values, dtype=torch.float32, device=device))
        used = True
    penalties = [r.penalties if r is not None and r.penalties is not None else (1.0, 0.0, 0.0) for r in rows]
    if any(r is not None and r.penalties is not None for r in rows):
        t.repetition, t.frequency, t.presence = torch.tensor(penalties, dtype=torch.float32, device=device).T
        # Only rows with penalties contribute ids: the others' factors are neutral anyway.
        t.prompt_ids = padded_ids([r.prompt_token_ids if r else [] for r in rows], vocab_size, device)
        t.output_ids = padded_ids([r.output_token_ids if r else [] for r in rows], vocab_size, device)
        used = True
    return t if used else None
