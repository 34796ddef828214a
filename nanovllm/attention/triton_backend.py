"""Attention through the project's own Triton kernels (nanovllm.kernels): a fast GPU engine from
`pip install` alone. Prefill reads every key/value, cached prefix included, from the paged cache."""

import torch

from nanovllm.attention.backend import AttentionBackend
from nanovllm.attention.metadata import AttentionMetadata
from nanovllm.kernels.paged_attention import paged_decode_attention, paged_prefill_attention, store_kvcache


class TritonBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graph = True
    fused_store = True

    def store(self, k, v, k_cache, v_cache, meta: AttentionMetadata) -> None:
        store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping)

    def attend(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if meta.is_prefill:
            return paged_prefill_attention(q, k_cache, v_cache, meta.cu_seqlens_q, meta.seqlens_k,
                                           meta.block_tables, scale, meta.max_seqlen_q)
        return paged_decode_attention(q, k_cache, v_cache, meta.seqlens_k, meta.block_tables, scale)
