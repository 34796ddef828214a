"""Attention through the project's own Triton kernels (nanovllm.kernels): a fast GPU engine from
`pip install` alone. Prefill reads every key/value, cached prefix included, from the paged cache;
decode is one split-KV kernel a layer (its chunks are combined by the last one to finish); a small decode
batch folds the q/k norm, rotary and KV store into it (kernels/decode_rope.py). A mixed batch runs its
decoding rows through the decode kernel and its prefill chunks through the prefill one."""

import torch

from nanovllm.attention.backend import PagedLayer
from nanovllm.attention.gpu_backend import GPUBackend, qk_norms
from nanovllm.attention.metadata import AttentionMetadata
from nanovllm.kernels.decode_attention import paged_decode_attention
from nanovllm.kernels.decode_rope import paged_decode_rope_attention
from nanovllm.kernels.prefill_attention import paged_prefill_attention

# Decode batches of up to this many rows run the norm, rotary and KV store inside the attention kernel:
# a small step is a chain of launch-bound kernels, one fewer a layer. A larger batch keeps the separate
# rope_store kernel: there every chunk of the split-KV kernel would repeat its group's rotation.
# Measured (BENCHMARKS.md, call L2, 512-token contexts): 3-4% faster a step at 1-8 rows, even at 16,
# ~3% faster at 32, 1% slower at 64.
FUSED_ROPE_MAX_ROWS = 32


class TritonBackend(GPUBackend):
    name = "triton"

    def __init__(self, max_num_seqs: int, num_kv_heads: int, device: torch.device) -> None:
        # The decode kernel's chunk counters: zero between calls, one per (sequence, KV head). One
        # engine's layers run one after another on one stream, so they share a buffer; it is this
        # engine's own, so that no other engine's kernels can race on it. Sized once for the largest
        # decode batch, so CUDA graphs captured at any batch size address the same buffer.
        self.counters = torch.zeros(max_num_seqs * num_kv_heads, dtype=torch.int32, device=device)

    def forward(self, layer: PagedLayer, q, k, v, positions, meta: AttentionMetadata) -> torch.Tensor:
        if meta.is_prefill or q.shape[0] > FUSED_ROPE_MAX_ROWS:
            return super().forward(layer, q, k, v, positions, meta)
        q_norm, k_norm = qk_norms(layer)
        return paged_decode_rope_attention(q, k, v, positions, layer.rotary.cos, layer.rotary.sin,
                                           layer.k_cache, layer.v_cache, meta.slot_mapping, meta.seqlens_k,
                                           meta.block_tables, layer.scale, q_norm=q_norm, k_norm=k_norm,
                                           counters=self.counters, k_scale=layer.k_scale,
                                           v_scale=layer.v_scale)

    def attend(self, layer: PagedLayer, q, k, v, meta: AttentionMetadata) -> torch.Tensor:
        if not meta.is_prefill:
            return self._decode(layer, q, meta.seqlens_k, meta.block_tables, meta.decode_order)
        # A mixed batch's decoding rows (the first num_decode_rows) go to the decode kernel: through the
        # prefill kernel each would fill a 64-row query tile with one row and load K/V once per query
        # head instead of once per GQA group. The prefill kernel addresses q and out by cu_seqlens_q's
        # absolute offsets, so it takes the remaining rows' slice of the metadata and the whole q.
        d = meta.num_decode_rows
        out = torch.empty_like(q)
        if d:
            self._decode(layer, q[:d], meta.seqlens_k[:d], meta.block_tables[:d], meta.decode_order,
                         out=out[:d])
        if d < meta.seqlens_k.shape[0]:
            paged_prefill_attention(q, layer.k_cache, layer.v_cache, meta.cu_seqlens_q[d:],
                                    meta.seqlens_k[d:], meta.block_tables[d:], layer.scale,
                                    meta.max_seqlen_q, out=out, k_scale=layer.k_scale, v_scale=layer.v_scale)
        return out

    def _decode(self, layer: PagedLayer, q, seqlens_k, block_tables, order, out=None) -> torch.Tensor:
        return paged_decode_attention(q, layer.k_cache, layer.v_cache, seqlens_k, block_tables, layer.scale,
                                      out=out, counters=self.counters, k_scale=layer.k_scale,
                                      v_scale=layer.v_scale, seq_order=order)
