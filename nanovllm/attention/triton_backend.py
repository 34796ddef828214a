"""Attention through the project's own Triton kernels (nanovllm.kernels): a fast GPU engine from
`pip install` alone. Prefill reads every key/value, cached prefix included, from the paged cache;
decode is one split-KV kernel a layer (its chunks are combined by the last one to finish); a small decode
batch folds the q/k norm, rotary and KV store into it (kernels/decode_rope.py; at one row, where it
applies, its CUDA form: kernels/cuda_decode_rope.py). A mixed batch runs its decoding rows through the
decode kernel and its prefill chunks through the prefill one.

"triton-fa3" (the auto choice where FlashAttention-3 is installed and the cache holds the model's half
dtype) is the same backend with FA3's paged prefill kernel in place of the Triton one: 1.5-1.9x faster at
1-8k-token prompts on an H200 (BENCHMARKS.md, call M5), while this decode kernel beats FA3's."""

import logging

import torch

from nanovllm.attention.backend import PagedLayer
from nanovllm.attention.gpu_backend import GPUBackend, qk_norms
from nanovllm.attention.metadata import AttentionMetadata
from nanovllm.kernels import cuda_decode_rope
from nanovllm.kernels.common import sm_count, supports_pdl
from nanovllm.kernels.decode_attention import paged_decode_attention
from nanovllm.kernels.decode_launch import variant_shapes
from nanovllm.kernels.decode_rope import LATE_TRIGGER_MIN_ROWS, paged_decode_rope_attention
from nanovllm.kernels.prefill_attention import paged_prefill_attention

logger = logging.getLogger("nanovllm")

# Decode batches of up to this many rows run the norm, rotary and KV store inside the attention kernel:
# a small step is a chain of launch-bound kernels, one fewer a layer. A larger batch keeps the separate
# rope_store kernel: there every chunk of the split-KV kernel would repeat its group's rotation.
# Measured (BENCHMARKS.md, call L2, 512-token contexts): 3-4% faster a step at 1-8 rows, even at 16,
# ~3% faster at 32, 1% slower at 64. From 66 rows (one chunk, no repeat) it is as fast alone and slower
# in bench.py (call AA6): the split-KV kernel's longest-first order is worth rope_store's launch.
FUSED_ROPE_MAX_ROWS = 32
# triton-fa3 runs a step's prefill chunks through FA3 when they average at least this many tokens. FA3
# was 1.4-1.9x the Triton kernel at 512-8k-token chunks (call M5) and made 32 prompts of 6-8k tokens
# 13% faster end to end, but 512 requests of 64-256 new tokens over a cached 2k prefix 13% slower (M6).
FA3_MIN_MEAN_CHUNK = 512


def decode_variant(rows: int, launch, num_splits: int) -> tuple:
    """What selects a compiled variant of the split-KV decode kernel."""
    return launch, num_splits == 1


def fused_decode_variant(rows: int, launch, num_splits: int) -> tuple:
    """What selects a compiled variant of the fused decode kernel: also where it lets its PDL dependent
    launch (after its wait at one row, after its K/V loop from LATE_TRIGGER_MIN_ROWS rows on)."""
    return launch, num_splits == 1, rows >= LATE_TRIGGER_MIN_ROWS


class TritonBackend(GPUBackend):
    name = "triton"

    def __init__(self, max_num_seqs: int, num_kv_heads: int, device: torch.device, fa3_prefill: bool = False
                 ) -> None:
        # The decode kernel's chunk counters: zero between calls, one per (sequence, KV head). One
        # engine's layers run one after another on one stream, so they share a buffer; it is this
        # engine's own, so that no other engine's kernels can race on it. Sized once for the largest
        # decode batch, so CUDA graphs captured at any batch size address the same buffer.
        self.counters = torch.zeros(max_num_seqs * num_kv_heads, dtype=torch.int32, device=device)
        # The fused decode kernel launches as a programmatic dependent of the q/k/v projection where the
        # GPU can (single stream: with the skinny GEMVs', 0.85 vs 0.90 ms/token, BENCHMARKS.md call P2).
        self.pdl = supports_pdl(device)
        # One decode row (the single stream) takes the CUDA form of the fused kernel where it applies
        # (kernels/cuda_decode_rope.py); None after a failed compile, or off sm_90+.
        self.one_row = cuda_decode_rope.OneRowDecodeRope(device) if self.pdl else None
        self.fa3_with_kvcache = None
        if fa3_prefill:
            from flash_attn_interface import flash_attn_with_kvcache
            self.fa3_with_kvcache, self.name = flash_attn_with_kvcache, "triton-fa3"

    def forward(self, layer: PagedLayer, q, k, v, positions, meta: AttentionMetadata) -> torch.Tensor:
        if meta.is_prefill or q.shape[0] > FUSED_ROPE_MAX_ROWS:
            return super().forward(layer, q, k, v, positions, meta)
        return self._fused_decode(layer, q, k, v, positions, meta.slot_mapping, meta.seqlens_k,
                                  meta.block_tables)

    def _fused_decode(self, layer: PagedLayer, q, k, v, positions, slot_mapping, seqlens_k, block_tables
                      ) -> torch.Tensor:
        """Norm, rotary, KV store and decode attention in one kernel: the CUDA one where it applies."""
        q_norm, k_norm = qk_norms(layer)
        kernel = paged_decode_rope_attention
        if (self.one_row is not None and cuda_decode_rope.supports(q, k, v, layer.k_cache)
                and q_norm is not None and layer.k_scale == layer.v_scale == 1.0):  # as measured: Qwen3
            try:
                kernel = self.one_row.prepared(q, k, positions, slot_mapping, self.pdl)
            except (OSError, cuda_decode_rope.CompileError) as e:  # no NVRTC, or it rejected the source
                logger.warning("the one-row CUDA decode kernel is unavailable (%s); using the Triton one", e)
                self.one_row = None
        return kernel(q, k, v, positions, layer.rotary.cos, layer.rotary.sin, layer.k_cache, layer.v_cache,
                      slot_mapping, seqlens_k, block_tables, layer.scale, q_norm=q_norm, k_norm=k_norm,
                      counters=self.counters, k_scale=layer.k_scale, v_scale=layer.v_scale, pdl=self.pdl)

    def attend(self, layer: PagedLayer, q, k, v, meta: AttentionMetadata) -> torch.Tensor:
        if not meta.is_prefill:
            return self._decode(layer, q, meta.seqlens_k, meta.block_tables, meta.decode_order)
        # A mixed batch's decoding rows (the first num_decode_rows) go to the decode kernel: through the
        # prefill kernel each would fill a 64-row query tile with one row and load K/V once per query
        # head instead of once per GQA group. The prefill kernel addresses q and out by cu_seqlens_q's
        # absolute offsets, so it takes the remaining rows' slice of the metadata and the whole q.
        d = meta.num_decode_rows
        fa3 = self.fa3_with_kvcache is not None and self._long_chunks(meta)
        if fa3 and d == 0:
            return self._fa3_prefill(layer, q, meta, 0)
        out = torch.empty_like(q)
        if d:
            self._decode(layer, q[:d], meta.seqlens_k[:d], meta.block_tables[:d], meta.decode_order,
                         out=out[:d])
        if d == meta.seqlens_k.shape[0]:
            return out
        if fa3:
            out[d:] = self._fa3_prefill(layer, q[d:], meta, d)  # the decoding rows hold one token each
        else:
            paged_prefill_attention(q, layer.k_cache, layer.v_cache, meta.cu_seqlens_q[d:],
                                    meta.seqlens_k[d:], meta.block_tables[d:], layer.scale,
                                    meta.max_seqlen_q, out=out, k_scale=layer.k_scale, v_scale=layer.v_scale)
        return out

    @staticmethod
    def _long_chunks(meta: AttentionMetadata) -> bool:
        """Whether the step's prefill chunks (the rows after the decoding ones) average FA3_MIN_MEAN_CHUNK
        tokens or more."""
        cu, d = meta.cu_seqlens_q_host, meta.num_decode_rows
        return cu[-1] - cu[d] >= FA3_MIN_MEAN_CHUNK * (len(cu) - 1 - d)

    def _fa3_prefill(self, layer: PagedLayer, q, meta: AttentionMetadata, d: int) -> torch.Tensor:
        """FA3 over the paged cache for the sequences from row d on, q their tokens (and any padding)."""
        cu_seqlens_q = meta.cu_seqlens_q if d == 0 else meta.prefill_cu_seqlens_q
        out = self.fa3_with_kvcache(q, layer.k_cache, layer.v_cache, cache_seqlens=meta.seqlens_k[d:],
                                    page_table=meta.block_tables[d:], cu_seqlens_q=cu_seqlens_q,
                                    max_seqlen_q=meta.max_seqlen_q, softmax_scale=layer.scale, causal=True)
        out = out[0] if isinstance(out, tuple) else out
        num_tokens = meta.cu_seqlens_q_host[-1] - d
        if q.shape[0] > num_tokens:  # padding rows (bucketed steps): FA3 leaves them unwritten
            out[num_tokens:] = 0
        return out

    @torch.inference_mode()
    def warm_up(self, layer: PagedLayer, dtype: torch.dtype, max_num_seqs: int, max_blocks: int) -> None:
        # The decode kernels compile a variant per launch setting (decode_launch.choose_launch's, by the
        # rows and the block table's width) and per split count of one or more; the fused kernel's also
        # come with its PDL trigger early (one row) or late (more). CUDA graphs build those of graphed
        # decode steps, but a mixed step's decoding rows run eagerly: the shared-prefix workload's timed
        # run built one mid-run (0.8 s, the whole batch waiting; call N1). So one call of each variant
        # here, at a shape decode_launch.variant_shapes picks; each reads block 0 and stores nothing.
        device = layer.k_cache.device
        shape_args = (layer.num_kv_heads, layer.head_dim, layer.k_cache.shape[1], max_blocks,
                      layer.k_cache.element_size(), device, sm_count(device))
        fused_rows = min(max_num_seqs, FUSED_ROPE_MAX_ROWS)
        plain = variant_shapes(max_num_seqs, *shape_args, decode_variant)
        fused = variant_shapes(fused_rows, *shape_args, fused_decode_variant, (LATE_TRIGGER_MIN_ROWS,))
        for shapes, is_fused in ((plain, False), (fused, True)):
            for rows, width in shapes:
                q = torch.zeros(rows, layer.num_heads, layer.head_dim, dtype=dtype, device=device)
                seqlens_k = torch.ones(rows, dtype=torch.int32, device=device)
                tables = torch.zeros(rows, width, dtype=torch.int32, device=device)
                if not is_fused:
                    order = torch.arange(rows, dtype=torch.int32, device=device)
                    self._decode(layer, q, seqlens_k, tables, order)
                    continue
                kv = torch.zeros(rows, layer.num_kv_heads, layer.head_dim, dtype=dtype, device=device)
                self._fused_decode(layer, q, kv, kv, torch.zeros(rows, dtype=torch.int64, device=device),
                                   torch.full((rows,), -1, dtype=torch.int64, device=device), seqlens_k,
                                   tables)  # the variant forward launches

    def _decode(self, layer: PagedLayer, q, seqlens_k, block_tables, order, out=None) -> torch.Tensor:
        return paged_decode_attention(q, layer.k_cache, layer.v_cache, seqlens_k, block_tables, layer.scale,
                                      out=out, counters=self.counters, k_scale=layer.k_scale,
                                      v_scale=layer.v_scale, seq_order=order)
