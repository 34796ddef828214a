"""Pure PyTorch attention over the paged KV cache. Runs on CPU and GPU; it is the reference that
the fast backends are tested against, so it favours plain, obviously right code over speed."""

import torch
import torch.nn.functional as F

from nanovllm.attention.backend import AttentionBackend, PagedLayer
from nanovllm.attention.metadata import AttentionMetadata
from nanovllm.attention.rotary import apply_rotary
from nanovllm.utils.norm import rms_norm


def store_kvcache_torch(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        slot_mapping: torch.Tensor) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k[keep].to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v[keep].to(v_cache.dtype))


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

    def forward(self, layer: PagedLayer, q, k, v, positions, meta: AttentionMetadata) -> torch.Tensor:
        if layer.qk_norm is not None:
            norm = layer.qk_norm
            q, k = rms_norm(q, norm.q_weight, norm.eps), rms_norm(k, norm.k_weight, norm.eps)
        q, k = apply_rotary(q, k, positions, layer.rotary.cos, layer.rotary.sin)
        store_kvcache_torch(k, v, layer.k_cache, layer.v_cache, meta.slot_mapping)
        if meta.is_prefill:
            return self._prefill(q, k, v, layer.k_cache, layer.v_cache, meta, layer.scale)
        return self._decode(q, layer.k_cache, layer.v_cache, meta, layer.scale)

    def _prefill(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        out = torch.empty_like(q)
        cu_q, seqlens_k = meta.cu_seqlens_q_host, meta.seqlens_k_host
        for i, seqlen_k in enumerate(seqlens_k):
            start, end = cu_q[i], cu_q[i + 1]
            if meta.has_prefix:
                ki = gather_kv(k_cache, meta.block_tables[i], seqlen_k)
                vi = gather_kv(v_cache, meta.block_tables[i], seqlen_k)
            else:
                ki, vi = k[start:end], v[start:end]
            # query j sits at position seqlen_k - q_len + j and sees keys 0 .. that position
            q_pos = torch.arange(seqlen_k - (end - start), seqlen_k, device=q.device)
            mask = torch.arange(seqlen_k, device=q.device)[None, :] <= q_pos[:, None]
            o = _sdpa(q[start:end].transpose(0, 1)[None], ki.transpose(0, 1)[None], vi.transpose(0, 1)[None],
                      mask, scale)
            out[start:end] = o[0].transpose(0, 1)
        return out

    def _decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        # [B, max_blocks, block_size, Hkv, D] -> [B, Hkv, max_blocks * block_size, D]
        tables = meta.block_tables.long()
        k = k_cache[tables].flatten(1, 2).transpose(1, 2)
        v = v_cache[tables].flatten(1, 2).transpose(1, 2)
        positions = torch.arange(k.shape[2], device=q.device)
        valid = positions[None, :] < meta.seqlens_k[:, None]  # [B, Lk]
        # Slots past a sequence's length (its last block's tail, padded table entries) may never have
        # been written, and the CPU cache starts uninitialised: any bits, NaN included, where even a
        # masked-out score turns the row to NaN. The gathered k/v are copies: zero those slots.
        k.masked_fill_(~valid[:, None, :, None], 0.0)
        v.masked_fill_(~valid[:, None, :, None], 0.0)
        return _sdpa(q[:, :, None, :], k, v, valid[:, None, None, :], scale)[:, :, 0, :]
