"""Attention through the project's own Triton kernels (nanovllm.kernels): a fast GPU engine from
`pip install` alone. Prefill reads every key/value, cached prefix included, from the paged cache;
decode is one split-KV kernel a layer (its chunks are combined by the last one to finish)."""

import torch

from nanovllm.attention.backend import PagedLayer
from nanovllm.attention.gpu_backend import GPUBackend
from nanovllm.attention.metadata import AttentionMetadata
from nanovllm.kernels.decode_attention import paged_decode_attention
from nanovllm.kernels.prefill_attention import paged_prefill_attention


class TritonBackend(GPUBackend):
    name = "triton"

    def __init__(self, max_num_seqs: int, num_kv_heads: int, device: torch.device) -> None:
        # The decode kernel's chunk counters: zero between calls, one per (sequence, KV head). One
        # engine's layers run one after another on one stream, so they share a buffer; it is this
        # engine's own, so that no other engine's kernels can race on it. Sized once for the largest
        # decode batch, so CUDA graphs captured at any batch size address the same buffer.
        self.counters = torch.zeros(max_num_seqs * num_kv_heads, dtype=torch.int32, device=device)

    def attend(self, layer: PagedLayer, q, k, v, meta: AttentionMetadata) -> torch.Tensor:
        if meta.is_prefill:
            return paged_prefill_attention(q, layer.k_cache, layer.v_cache, meta.cu_seqlens_q, meta.seqlens_k,
                                           meta.block_tables, layer.scale, meta.max_seqlen_q,
                                           k_scale=layer.k_scale, v_scale=layer.v_scale)
        return paged_decode_attention(q, layer.k_cache, layer.v_cache, meta.seqlens_k, meta.block_tables,
                                      layer.scale, counters=self.counters, k_scale=layer.k_scale,
                                      v_scale=layer.v_scale)
