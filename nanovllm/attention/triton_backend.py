"""Attention through the project's own Triton kernels (nanovllm.kernels): a fast GPU engine from
`pip install` alone. Prefill reads every key/value, cached prefix included, from the paged cache;
decode is one split-KV kernel a layer (its chunks are combined by the last one to finish)."""

import torch

from nanovllm.attention.backend import AttentionBackend
from nanovllm.attention.metadata import AttentionMetadata
from nanovllm.kernels.paged_attention import paged_decode_attention, paged_prefill_attention, store_kvcache


class TritonBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graph = True
    fused_store = True

    def __init__(self) -> None:
        # The decode kernel's chunk counters: zero between calls, one per (sequence, KV head). One
        # engine's layers run one after another on one stream, so they share a buffer; it is this
        # engine's own, so that no other engine's kernels can race on it.
        self._counters: torch.Tensor | None = None
        # Replaced buffers stay alive: graphs captured earlier still address them.
        self._retired: list[torch.Tensor] = []

    def _decode_counters(self, needed: int, device: torch.device) -> torch.Tensor:
        counters = self._counters
        if counters is None or counters.numel() < needed or counters.device != device:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                # Memory allocated during a capture belongs to the graph; the eager warm-up that runs
                # before each capture at the same batch size allocates this first.
                raise RuntimeError("decode counters must be allocated before CUDA-graph capture")
            if counters is not None:
                self._retired.append(counters)
            self._counters = counters = torch.zeros(needed, dtype=torch.int32, device=device)
        return counters

    def store(self, k, v, k_cache, v_cache, meta: AttentionMetadata) -> None:
        store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping)

    def attend(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if meta.is_prefill:
            return paged_prefill_attention(q, k_cache, v_cache, meta.cu_seqlens_q, meta.seqlens_k,
                                           meta.block_tables, scale, meta.max_seqlen_q)
        counters = self._decode_counters(q.shape[0] * k_cache.shape[2], q.device)
        return paged_decode_attention(q, k_cache, v_cache, meta.seqlens_k, meta.block_tables, scale,
                                      counters=counters)
