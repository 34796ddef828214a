"""Attention through FlashAttention: FA2 (the `flash_attn` package) and FA3 (`flash_attn_interface`,
Hopper). Prefill without a cached prefix attends over the step's own k/v (varlen); prefill over a
prefix and decode read the cache through the block table."""

import torch

from nanovllm.attention.backend import PagedLayer
from nanovllm.attention.gpu_backend import GPUBackend
from nanovllm.attention.metadata import AttentionMetadata


class FlashAttention2Backend(GPUBackend):
    name = "flash-attn"

    def __init__(self) -> None:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
        self.varlen, self.with_kvcache = flash_attn_varlen_func, flash_attn_with_kvcache

    def attend(self, layer: PagedLayer, q, k, v, meta: AttentionMetadata) -> torch.Tensor:
        k_cache, v_cache = layer.k_cache, layer.v_cache
        if meta.is_prefill:
            # With a block table, FA2's varlen kernel reads K/V (cu_seqlens_k long) from the paged cache.
            paged = meta.has_prefix
            return self.varlen(q, k_cache if paged else k, v_cache if paged else v,
                               cu_seqlens_q=meta.cu_seqlens_q, cu_seqlens_k=meta.cu_seqlens_k,
                               max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_k,
                               softmax_scale=layer.scale, causal=True,
                               block_table=meta.block_tables if paged else None)
        out = self.with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=meta.seqlens_k,
                                block_table=meta.block_tables, softmax_scale=layer.scale, causal=True)
        return out.squeeze(1)


class FlashAttention3Backend(GPUBackend):
    name = "fa3"

    def __init__(self) -> None:
        from flash_attn_interface import flash_attn_varlen_func, flash_attn_with_kvcache
        self.varlen, self.with_kvcache = flash_attn_varlen_func, flash_attn_with_kvcache

    def attend(self, layer: PagedLayer, q, k, v, meta: AttentionMetadata) -> torch.Tensor:
        k_cache, v_cache, scale = layer.k_cache, layer.v_cache, layer.scale
        if meta.is_prefill and not meta.has_prefix:
            out = self.varlen(q, k, v, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_seqlen_q,
                              meta.max_seqlen_k, softmax_scale=scale, causal=True)
        elif meta.is_prefill:
            out = self.with_kvcache(q, k_cache, v_cache, cache_seqlens=meta.seqlens_k,
                                    page_table=meta.block_tables, cu_seqlens_q=meta.cu_seqlens_q,
                                    max_seqlen_q=meta.max_seqlen_q, softmax_scale=scale, causal=True)
        else:
            out = self.with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=meta.seqlens_k,
                                    page_table=meta.block_tables, softmax_scale=scale, causal=True)
        out = out[0] if isinstance(out, tuple) else out
        return out if meta.is_prefill else out.squeeze(1)
