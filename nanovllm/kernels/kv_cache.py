"""The paged KV-cache layout in Triton: where a token's key/value lives, and the kernel that writes them.

Per layer, `k_cache` and `v_cache` are contiguous `[num_blocks, block_size, num_kv_heads, head_dim]`.
A token at flat slot `s` lives in block `s // block_size` at offset `s % block_size`:

    slot = block_table[pos // block_size] * block_size + pos % block_size
    element offset of (slot, kv_head, d) = slot * num_kv_heads * head_dim + kv_head * head_dim + d

`store_kvcache` writes token i's key/value to slot `slot_mapping[i]` and skips slot -1 (padding).
`paged_kv_offsets` is the same address computation for the attention kernels; any block_size works.
The attention wrappers also share `check_paged_attention_args` and `dot_precision` from here, so the
prefill and decode modules depend on this one and not on each other.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def paged_kv_offsets(
    block_table_row_ptr,
    tile_start,
    kv_head,
    n_mask,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Element offsets [BLOCK_N, HEAD_DIM] into a K or V cache of positions tile_start + arange(BLOCK_N)
    of one sequence (its block-table row) and one KV head. tile_start must be a multiple of BLOCK_N;
    n_mask marks the positions that exist (the others are not looked up and must be masked by the caller)."""
    offs_n = tile_start + tl.arange(0, BLOCK_N)
    if BLOCK_SIZE % BLOCK_N == 0:
        # The whole tile sits in one block: one block-table lookup, and the slots are consecutive.
        block_id = tl.load(block_table_row_ptr + tile_start // BLOCK_SIZE).to(tl.int64)
        slots = block_id * BLOCK_SIZE + (tile_start % BLOCK_SIZE) + tl.arange(0, BLOCK_N)
    else:
        # The tile straddles blocks (or blocks are smaller than a tile): look up each token's block.
        block_ids = tl.load(block_table_row_ptr + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        slots = block_ids * BLOCK_SIZE + offs_n % BLOCK_SIZE
    offs_d = tl.arange(0, HEAD_DIM)
    # int64 slots: num_blocks * block_size * num_kv_heads * head_dim can pass 2**31 elements per layer.
    return slots[:, None] * (NUM_KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM + offs_d[None, :]


@triton.jit
def _store_kvcache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    key_stride_n,
    key_stride_h,
    value_stride_n,
    value_stride_h,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program per token: it copies that token's [num_kv_heads, head_dim] key and value.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    key = tl.load(
        key_ptr + token * key_stride_n + offs_h[:, None] * key_stride_h + offs_d[None, :], mask=mask
    )
    value = tl.load(
        value_ptr + token * value_stride_n + offs_h[:, None] * value_stride_h + offs_d[None, :], mask=mask
    )
    cache_offs = slot * (NUM_KV_HEADS * HEAD_DIM) + offs_h[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(k_cache_ptr + cache_offs, key, mask=mask)
    tl.store(v_cache_ptr + cache_offs, value, mask=mask)


def store_kvcache(
    key: torch.Tensor,  # [N, num_kv_heads, head_dim], last dim contiguous (may be a slice of fused qkv)
    value: torch.Tensor,  # [N, num_kv_heads, head_dim], last dim contiguous
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    v_cache: torch.Tensor,  # same as k_cache
    slot_mapping: torch.Tensor,  # [N] int32/int64, -1 = padding
) -> None:
    """Write key[i]/value[i] into the cache at flat slot slot_mapping[i]; slot -1 writes nothing.
    No host sync, so it can run inside a captured CUDA graph."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must have the same shape")
    if (
        k_cache.shape != v_cache.shape
        or k_cache.dim() != 4
        or tuple(k_cache.shape[2:]) != (num_kv_heads, head_dim)
    ):
        raise ValueError(
            f"caches {tuple(k_cache.shape)}/{tuple(v_cache.shape)} must both be "
            f"[num_blocks, block_size, {num_kv_heads}, {head_dim}] to hold keys of shape {tuple(key.shape)}"
        )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous; the kernels address them by slot")
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError(
            "key and value need a contiguous last (head_dim) dimension; other dims may be strided"
        )
    if key.dtype != k_cache.dtype or value.dtype != v_cache.dtype:
        raise ValueError(
            f"key/value dtype {key.dtype}/{value.dtype} must match the cache dtype {k_cache.dtype}"
        )
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping has shape {tuple(slot_mapping.shape)}; expected ({num_tokens},)")
    if num_tokens == 0:
        return
    _store_kvcache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


def check_paged_attention_args(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor
) -> tuple[int, int, int, int]:
    """Validate q [tokens, H, D] against the paged caches; return (num_heads, num_kv_heads, head_dim,
    block_size). Shape checks only (no host sync), so callers stay CUDA-graph capturable."""
    if q.dim() != 3 or q.stride(-1) != 1:
        raise ValueError(
            f"q must be [tokens, num_heads, head_dim] with a contiguous last dim; got {tuple(q.shape)}"
        )
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must both be "
            "[num_blocks, block_size, num_kv_heads, head_dim]"
        )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous; the kernels address them by slot")
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim:
        raise ValueError(f"q head_dim {head_dim} differs from the cache head_dim {cache_head_dim}")
    # tl.arange needs a power of two and tl.dot a reduction dim of at least 16.
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two >= 16 for the Triton kernels; got {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads} (GQA)")
    if q.dtype != k_cache.dtype or k_cache.dtype != v_cache.dtype:
        raise ValueError(
            f"q {q.dtype}, k_cache {k_cache.dtype} and v_cache {v_cache.dtype} must share a dtype"
        )
    if block_tables.dim() != 2 or block_tables.stride(1) != 1:
        raise ValueError(
            f"block_tables must be [batch, max_blocks] with contiguous rows; got {tuple(block_tables.shape)}"
        )
    return num_heads, num_kv_heads, head_dim, block_size


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot input precision: float32 caches get exact IEEE products (the default, tf32, keeps only
    10 mantissa bits); 16-bit inputs are exact either way, so they keep the default."""
    return "ieee" if dtype == torch.float32 else "tf32"
