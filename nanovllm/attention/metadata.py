"""Per-step attention metadata: where each token's K/V goes and what each sequence attends to. Built
once per step by the model runner and passed down the model's forward as an argument."""

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    is_prefill: bool
    # slot = block_table[pos // block_size] * block_size + pos % block_size; -1 = padding, not stored
    slot_mapping: torch.Tensor  # [num_tokens]
    seqlens_k: torch.Tensor  # [num_seqs] int32: context length after this step
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    cu_seqlens_q: torch.Tensor | None = None  # [num_seqs + 1] int32, prefill only
    cu_seqlens_k: torch.Tensor | None = None  # [num_seqs + 1] int32, prefill only
    max_seqlen_q: int = 1
    max_seqlen_k: int = 0
    # True when some sequence reads KV it did not compute in this step (prefix cache or an earlier
    # chunk); without it, prefill attends to the step's own k/v and never reads the cache.
    has_prefix: bool = False
    # Prefill steps: how many leading sequences compute exactly one token (the decoding rows of a
    # mixed batch, which the scheduler puts first). A backend may run them through its decode kernel.
    num_decode_rows: int = 0
    # Mixed steps: cu_seqlens_q of the sequences after the decoding rows, from 0 (cu_seqlens_q[d:] - d),
    # for kernels that take only those rows' q.
    prefill_cu_seqlens_q: torch.Tensor | None = None
    # The decoding rows (all of a decode step's, a mixed step's first num_decode_rows) by context length,
    # longest first, int32: the order a decode kernel may start them in (kernels/decode_attention.py).
    decode_order: torch.Tensor | None = None
    # Decode steps: rows may be positions of one sequence (a speculative verification run as decode rows,
    # runner/verify_graphs.py), each attending to keys the rows before it store in this step. A backend
    # must then store every row's K/V before any row attends: no fused store-and-attend kernel.
    rows_share_sequences: bool = False
    # Host copies for backends that loop over sequences in Python (the torch reference backend).
    cu_seqlens_q_host: list[int] | None = None
    seqlens_k_host: list[int] | None = None
