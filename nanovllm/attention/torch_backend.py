"""Pure PyTorch attention over the paged KV cache. Runs on CPU and GPU; it is the reference that
the fast backends are tested against, so it favours plain, obviously right code over speed."""

import torch
import torch.nn.functional as F

from nanovllm.attention.backend import AttentionBackend, PagedLayer
from nanovllm.attention.layer import apply_rotary, rms_norm
from nanovllm.attention.metadata import AttentionMetadata


def to_cache(x: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """What the cache holds for x: x itself, or x / scale in fp8 (clamped to its range)."""
    if cache_dtype == x.dtype:
        return x
    limit = torch.finfo(cache_dtype).max
    return (x.float() / scale).clamp(-limit, limit).to(cache_dtype)


def from_cache(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    return x if x.dtype == dtype else (x.float() * scale).to(dtype)


def store_kvcache_torch(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        values = to_cache(x[keep], cache.dtype, scale)
        if cache.element_size() == 1:  # index_copy_ has no fp8 kernel on CPU: copy the bytes
            cache, values = cache.view(torch.uint8), values.view(torch.uint8)
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, values)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seqlen: int) -> torch.Tensor:
    """The first seqlen tokens of one sequence's K or V: [seqlen, num_kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = (seqlen + block_size - 1) // block_size
    return cache[block_table[:num_blocks].long()].flatten(0, 1)[:seqlen]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
          scale: float) -> torch.Tensor:
    """q: [B, H, Lq, D]; k, v: [B, Hkv, Lk, D]; mask: bool, True = attend."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


class TorchBackend(AttentionBackend):
    name = "torch"

    def decode_kernels(self, rows: int) -> str:
        return "torch (rotary, KV store, scaled_dot_product_attention)"

    def forward(self, layer: PagedLayer, q, k, v, positions, meta: AttentionMetadata) -> torch.Tensor:
        if layer.qk_norm is not None:
            norm = layer.qk_norm
            q, k = rms_norm(q, norm.q_weight, norm.eps), rms_norm(k, norm.k_weight, norm.eps)
        q, k = apply_rotary(q, k, positions, layer.rotary.cos, layer.rotary.sin)
        store_kvcache_torch(k, v, layer.k_cache, layer.v_cache, meta.slot_mapping, layer.k_scale,
                            layer.v_scale)
        if meta.is_prefill:
            return self._prefill(layer, q, k, v, meta)
        return self._decode(layer, q, meta)

    def _prefill(self, layer: PagedLayer, q, k, v, meta: AttentionMetadata) -> torch.Tensor:
        out = torch.empty_like(q)
        cu_q, seqlens_k = meta.cu_seqlens_q_host, meta.seqlens_k_host
        for i, seqlen_k in enumerate(seqlens_k):
            start, end = cu_q[i], cu_q[i + 1]
            if meta.has_prefix:
                table = meta.block_tables[i]
                ki = from_cache(gather_kv(layer.k_cache, table, seqlen_k), q.dtype, layer.k_scale)
                vi = from_cache(gather_kv(layer.v_cache, table, seqlen_k), q.dtype, layer.v_scale)
            else:
                ki, vi = k[start:end], v[start:end]
            # query j sits at position seqlen_k - q_len + j and sees keys 0 .. that position
            q_pos = torch.arange(seqlen_k - (end - start), seqlen_k, device=q.device)
            mask = torch.arange(seqlen_k, device=q.device)[None, :] <= q_pos[:, None]
            o = _sdpa(q[start:end].transpose(0, 1)[None], ki.transpose(0, 1)[None], vi.transpose(0, 1)[None],
                      mask, layer.scale)
            out[start:end] = o[0].transpose(0, 1)
        return out

    def _decode(self, layer: PagedLayer, q, meta: AttentionMetadata) -> torch.Tensor:
        # [B, max_blocks, block_size, Hkv, D] -> [B, Hkv, max_blocks * block_size, D]
        tables = meta.block_tables.long()
        k = from_cache(layer.k_cache[tables], q.dtype, layer.k_scale).flatten(1, 2).transpose(1, 2)
        v = from_cache(layer.v_cache[tables], q.dtype, layer.v_scale).flatten(1, 2).transpose(1, 2)
        positions = torch.arange(k.shape[2], device=q.device)
        valid = positions[None, :] < meta.seqlens_k[:, None]  # [B, Lk]
        # Slots past a sequence's length (its last block's tail, padded table entries) may never have
        # been written, and the CPU cache starts uninitialised: any bits, NaN included, where even a
        # masked-out score turns the row to NaN. The gathered k/v are copies: zero those slots.
        k.masked_fill_(~valid[:, None, :, None], 0.0)
        v.masked_fill_(~valid[:, None, :, None], 0.0)
        return _sdpa(q[:, :, None, :], k, v, valid[:, None, None, :], layer.scale)[:, :, 0, :]
