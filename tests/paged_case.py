"""Paged KV caches for the attention tests and their float32 reference attention. The caches hold
sequences of given context lengths whose blocks are scattered at random, every slot no sequence owns
filled with NaN (so a kernel that reads a position it should have masked produces NaN and fails its
comparison)."""

import math

import torch


def make_paged_cache(
    kv_lens: list[int], block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int,
    device: str = "cpu", unowned: float = float("nan"),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k_cache, v_cache and block_tables for sequences of kv_lens tokens, blocks scattered at random.
    Unowned slots hold `unowned` (NaN unless a reference under test gathers whole blocks and masks
    after multiplying); block 0 is never owned and pads every block-table row."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(n / block_size) for n in kv_lens]
    num_blocks = 1 + sum(blocks_per_seq) + 2  # poison block 0, owned blocks, two spare
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, unowned, dtype=dtype)
    v_cache = torch.full(shape, unowned, dtype=dtype)
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    block_tables = torch.zeros(len(kv_lens), max(blocks_per_seq) + 1, dtype=torch.int32)
    for b, (kv_len, num_seq_blocks) in enumerate(zip(kv_lens, blocks_per_seq, strict=True)):
        block_tables[b, :num_seq_blocks] = torch.tensor(free[:num_seq_blocks], dtype=torch.int32)
        free = free[num_seq_blocks:]
        slots = seq_slots(block_tables[b], kv_len, block_size)
        k_cache.view(-1, num_kv_heads, head_dim)[slots] = torch.randn(
            kv_len, num_kv_heads, head_dim, generator=gen
        ).to(dtype)
        v_cache.view(-1, num_kv_heads, head_dim)[slots] = torch.randn(
            kv_len, num_kv_heads, head_dim, generator=gen
        ).to(dtype)
    return k_cache.to(device), v_cache.to(device), block_tables.to(device)


def seq_slots(block_table: torch.Tensor, kv_len: int, block_size: int) -> torch.Tensor:
    # slot = block_table[pos // block_size] * block_size + pos % block_size
    pos = torch.arange(kv_len)
    return block_table.cpu()[pos // block_size].long() * block_size + pos % block_size


def reference_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    q_lens: list[int],
    kv_lens: list[int],
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Float32 causal attention per sequence; its q_len queries are the last of its kv_len positions."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    group = q.shape[1] // num_kv_heads
    k_flat = k_cache.cpu().float().view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.cpu().float().view(-1, num_kv_heads, head_dim)
    out = torch.zeros(q.shape, dtype=torch.float32)
    q_start = 0
    for b, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens, strict=True)):
        if kv_len > 0:
            slots = seq_slots(block_tables[b], kv_len, block_size)
            k = k_flat[slots].repeat_interleave(group, dim=1)  # [kv_len, H, D]
            v = v_flat[slots].repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q[q_start : q_start + q_len].cpu().float(), k) * scale
            q_pos = kv_len - q_len + torch.arange(q_len)
            scores.masked_fill_(torch.arange(kv_len)[None, None, :] > q_pos[None, :, None], float("-inf"))
            out[q_start : q_start + q_len] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
        q_start += q_len
    return out
