"""Attention through the project's own Triton kernels (nanovllm.kernels): a fast GPU engine from
`pip install` alone. Prefill reads every key/value, cached prefix included, from the paged cache;
decode is one split-KV kernel a layer (its chunks are combined by the last one to finish); a small decode
batch folds the q/k norm, rotary and KV store into it (kernels/decode_rope.py; at one row, where it
applies, its CUDA form: kernels/cuda_decode_rope.py). A mixed batch runs its decoding rows through the
decode kernel and its prefill chunks through the prefill one.

"triton-fa3" (the auto choice where FlashAttention-3 is installed and the cache holds the model's half
dtype) is the same backend with FA3's paged prefill kernel in place of the Triton one for long chunks,
while this decode kernel beats FA3's.

Which kernel a step takes by its rows is decided in one place, TritonBackend's DECODE_BUCKETS and
FA3_MIN_MEAN_CHUNK, with the measurements beside them; the kernels take those choices as arguments."""

import logging
from dataclasses import dataclass

import torch

from nanovllm.attention.backend import PagedLayer
from nanovllm.attention.gpu_backend import GPUBackend, qk_norms
from nanovllm.attention.layer import cache_scales
from nanovllm.attention.metadata import AttentionMetadata
from nanovllm.kernels import cuda_decode_rope
from nanovllm.kernels.common import sm_count, supports_pdl
from nanovllm.kernels.decode_attention import paged_decode_attention
from nanovllm.kernels.decode_launch import variant_shapes
from nanovllm.kernels.decode_rope import paged_decode_rope_attention
from nanovllm.kernels.prefill_attention import paged_prefill_attention

logger = logging.getLogger("nanovllm")

@dataclass(frozen=True, slots=True)
class DecodeBucket:
    """How a decode step of up to max_rows rows (None: any number) attends."""

    max_rows: int | None
    # The q/k norm, rotary and KV store inside the decode kernel (kernels/decode_rope.py); else the
    # rope_store kernel first, then the split-KV decode kernel (kernels/decode_attention.py).
    fused: bool
    # Under PDL, the fused kernel lets the next one (the o_proj GEMV) launch after its K/V loop, not right
    # after its wait.
    late_trigger: bool = False
    # The fused kernel's CUDA form (kernels/cuda_decode_rope.py) where it applies (one Qwen3-like row).
    one_row_cuda: bool = False


def decode_variant(rows: int, launch, num_splits: int) -> tuple:
    """What selects a compiled variant of the split-KV decode kernel."""
    return launch, num_splits == 1


def fused_decode_variant(rows: int, launch, num_splits: int) -> tuple:
    """What selects a compiled variant of the fused decode kernel: also where it lets its PDL dependent
    launch (its bucket's late_trigger)."""
    return launch, num_splits == 1, TritonBackend.decode_bucket(rows).late_trigger


class TritonBackend(GPUBackend):
    """Measured on an H200 with Qwen3-0.6B (docs/performance-notes.md, section "Decode attention at one row"):

    - 1 row: the CUDA form of the fused kernel, single stream 0.769 against 0.817 ms/token (commit
      5663d48, 2026-12-03); PDL's dependent released right after the wait, 1.2% faster there than after
      the K/V loop (commit 4439607, 2026-12-01).
    - 2-32 rows: the fused Triton kernel, a kernel fewer a layer: 3-4% faster a step at 1-8 rows, ~3% at
      32, 1% slower at 64 (512-token contexts; commit d0b6a67, 2026-11-30). From 66 rows, one chunk a
      context, it is as fast alone and slower in bench.py: the split-KV kernel's longest-first order is
      worth rope_store's launch (commit 6b0514b, 2026-12-02). Its dependent released after the K/V loop,
      whose loads are on the critical path: steps 2.2-2.4% faster at 2-4 rows, 0.7-0.8% at 8-32 (4439607).
    - More rows: rope_store, then the split-KV kernel (whose chunks would each repeat the rotation).
    - Prefill on triton-fa3: FA3's paged kernel where the chunks average FA3_MIN_MEAN_CHUNK tokens or more:
      1.4-1.9x the Triton kernel at 512-8k-token chunks and 32 prompts of 6-8k tokens 13% faster end to
      end, but 512 requests of 64-256 new tokens over a cached 2k prefix 13% slower (commit 7e8123f,
      2026-11-30)."""

    name = "triton"
    DECODE_BUCKETS = (
        DecodeBucket(1, fused=True, one_row_cuda=True),
        DecodeBucket(32, fused=True, late_trigger=True),
        DecodeBucket(None, fused=False),
    )
    FA3_MIN_MEAN_CHUNK = 512

    @classmethod
    def decode_bucket(cls, rows: int) -> DecodeBucket:
        for bucket in cls.DECODE_BUCKETS:  # the first that fits
            if bucket.max_rows is None or rows <= bucket.max_rows:
                return bucket
        raise AssertionError("the last decode bucket takes any rows")

    @classmethod
    def fused_max_rows(cls) -> int:
        """The most decode rows the fused kernel takes."""
        return max(b.max_rows for b in cls.DECODE_BUCKETS if b.fused)

    def decode_kernels(self, rows: int) -> str:
        bucket = self.decode_bucket(rows)
        if not bucket.fused:
            return "rope_store, decode_attention (split-KV)"
        if bucket.one_row_cuda and self.one_row is not None:
            return "cuda_decode_rope where it applies, else decode_rope"
        return "decode_rope, late PDL trigger" if bucket.late_trigger and self.pdl else "decode_rope"

    def __init__(self, max_num_seqs: int, num_kv_heads: int, device: torch.device, fa3_prefill: bool = False
                 ) -> None:
        # The decode kernel's chunk counters: zero between calls, one per (sequence, KV head). One
        # engine's layers run one after another on one stream, so they share a buffer; it is this
        # engine's own, so that no other engine's kernels can race on it. Sized once for the largest
        # decode batch, so CUDA graphs captured at any batch size address the same buffer.
        self.counters = torch.zeros(max_num_seqs * num_kv_heads, dtype=torch.int32, device=device)
        # The fused decode kernel launches as a programmatic dependent of the q/k/v projection where the
        # GPU can (single stream, with the GEMVs': 0.845 against 0.898 ms/token; commit 12ea44a).
        self.pdl = supports_pdl(device)
        # One decode row (the single stream) takes the CUDA form of the fused kernel where it applies
        # (kernels/cuda_decode_rope.py); None after a failed compile, or off sm_90+.
        self.one_row = cuda_decode_rope.OneRowDecodeRope(device) if self.pdl else None
        self.fa3_with_kvcache = None
        if fa3_prefill:
            from flash_attn_interface import flash_attn_with_kvcache
            self.fa3_with_kvcache, self.name = flash_attn_with_kvcache, "triton-fa3"

    def forward(self, layer: PagedLayer, q, k, v, positions, meta: AttentionMetadata) -> torch.Tensor:
        if meta.is_prefill:
            return super().forward(layer, q, k, v, positions, meta)
        bucket = self.decode_bucket(q.shape[0])
        if not bucket.fused or meta.rows_share_sequences:  # store every row's K/V, then attend
            return super().forward(layer, q, k, v, positions, meta)
        return self._fused_decode(layer, q, k, v, positions, meta.slot_mapping, meta.seqlens_k,
                                  meta.block_tables, bucket)

    def _fused_decode(self, layer: PagedLayer, q, k, v, positions, slot_mapping, seqlens_k, block_tables,
                      bucket: DecodeBucket) -> torch.Tensor:
        """Norm, rotary, KV store and decode attention in one kernel: the CUDA one where it applies."""
        q_norm, k_norm = qk_norms(layer)
        k_scales, v_scales = cache_scales(layer)
        args = (q, k, v, positions, layer.rotary.cos, layer.rotary.sin, layer.k_cache, layer.v_cache,
                slot_mapping, seqlens_k, block_tables, layer.scale)
        if bucket.one_row_cuda and self._one_row_applies(layer, q, k, v):
            try:
                kernel = self.one_row.prepared(q, k, positions, slot_mapping, self.pdl)
            except (OSError, cuda_decode_rope.CompileError) as e:  # no NVRTC, or it rejected the source
                logger.warning("the one-row CUDA decode kernel is unavailable (%s); using the Triton one", e)
                self.one_row = None
            else:
                return kernel(*args, q_norm=q_norm, k_norm=k_norm, counters=self.counters,
                              k_scale=layer.k_scale, v_scale=layer.v_scale, pdl=self.pdl)
        return paged_decode_rope_attention(*args, q_norm=q_norm, k_norm=k_norm, counters=self.counters,
                                           k_scale=layer.k_scale, v_scale=layer.v_scale, k_scales=k_scales,
                                           v_scales=v_scales, pdl=self.pdl, late_trigger=bucket.late_trigger)

    def _one_row_applies(self, layer: PagedLayer, q, k, v) -> bool:
        """Where the CUDA kernel was measured and is taken: its shapes (cuda_decode_rope.supports), with
        q/k norms and unit cache scales (Qwen3's), on sm_90+ (self.one_row is None elsewhere)."""
        return (self.one_row is not None and cuda_decode_rope.supports(q, k, v, layer.k_cache)
                and layer.qk_norm is not None and layer.k_scale == layer.v_scale == 1.0)

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
            k_scales, v_scales = cache_scales(layer)
            paged_prefill_attention(q, layer.k_cache, layer.v_cache, meta.cu_seqlens_q[d:],
                                    meta.seqlens_k[d:], meta.block_tables[d:], layer.scale,
                                    meta.max_seqlen_q, out=out, k_scale=layer.k_scale, v_scale=layer.v_scale,
                                    k_scales=k_scales, v_scales=v_scales)
        return out

    def _long_chunks(self, meta: AttentionMetadata) -> bool:
        """Whether the step's prefill chunks (the rows after the decoding ones) average FA3_MIN_MEAN_CHUNK
        tokens or more."""
        cu, d = meta.cu_seqlens_q_host, meta.num_decode_rows
        return cu[-1] - cu[d] >= self.FA3_MIN_MEAN_CHUNK * (len(cu) - 1 - d)

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
        # run built one mid-run (0.8 s, the whole batch waiting). So one call of each variant
        # here, at a shape decode_launch.variant_shapes picks; each reads block 0 and stores nothing.
        device = layer.k_cache.device
        shape_args = (layer.num_kv_heads, layer.head_dim, layer.k_cache.shape[1], max_blocks,
                      layer.k_cache.element_size(), device, sm_count(device))
        fused_rows = min(max_num_seqs, self.fused_max_rows())
        # The rows where a bucket ends: the fused variants differ across them (late_trigger).
        boundaries = tuple(b.max_rows + 1 for b in self.DECODE_BUCKETS if b.max_rows is not None)
        plain = variant_shapes(max_num_seqs, *shape_args, decode_variant)
        fused = variant_shapes(fused_rows, *shape_args, fused_decode_variant, boundaries)
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
                                   tables, self.decode_bucket(rows))  # the variant forward launches

    def _decode(self, layer: PagedLayer, q, seqlens_k, block_tables, order, out=None) -> torch.Tensor:
        k_scales, v_scales = cache_scales(layer)
        return paged_decode_attention(q, layer.k_cache, layer.v_cache, seqlens_k, block_tables, layer.scale,
                                      out=out, counters=self.counters, k_scale=layer.k_scale,
                                      v_scale=layer.v_scale, k_scales=k_scales, v_scales=v_scales,
                                      seq_order=order)
