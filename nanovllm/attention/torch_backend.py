"""Pure PyTorch attention over the paged KV cache. Runs on CPU and GPU; it is the reference that
the fast backends are tested against, so it favours plain, obviously right code over speed.

A quantized cache holds fp8 (e4m3) values x / scale, one scale a layer (kv_cache_dtype="fp8"), or int8
values round(x / scale) with a float32 scale per (token, KV head), scale = max(amax(|x| over head_dim),
INT8_MIN_AMAX) / 127 (kv_cache_dtype="int8"; the kernels' nanovllm.kernels.common.quantize_int8_rows).
Every read multiplies the scales back in. Prefill, too, attends over what the cache holds rather than the
step's exact keys and values, as the GPU backends do (they read every key from the cache): a quantized
cache's error shows in CPU prompt logprobs as it does on the GPU."""

from functools import partial

import torch
import torch.nn.functional as F

from nanovllm.attention.backend import AttentionBackend, PagedLayer
from nanovllm.attention.layer import apply_rotary, cache_scales, rms_norm
from nanovllm.attention.metadata import AttentionMetadata

# int8 values span -127..127, symmetric, so that -x quantizes to -q.
INT8_MAX = 127
# The least amax a scale is taken from: an all-zero row gets a nonzero (normal float32) scale, and zeros.
INT8_MIN_AMAX = 1e-30


def to_cache(x: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """What the cache holds for x: x itself, or x / scale in fp8 (clamped to its range)."""
    if cache_dtype == x.dtype:
        return x
    limit = torch.finfo(cache_dtype).max
    return (x.float() / scale).clamp(-limit, limit).to(cache_dtype)


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values [..., D], float32 scales [...]) that an int8 cache holds for x [..., D]: one scale per
    row, rounded half to even (torch.round, as the kernels round)."""
    x = x.float()
    scales = x.abs().amax(-1).clamp_min(INT8_MIN_AMAX) / INT8_MAX
    values = torch.round(x / scales[..., None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return values, scales


def from_cache(x: torch.Tensor, dtype: torch.dtype, scale: float,
               token_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Cache entries x [..., D] as `dtype`: int8 ones times their token_scales [...], fp8 ones times the
    layer's scale."""
    if token_scales is not None:
        return (x.float() * token_scales[..., None]).to(dtype)
    return x if x.dtype == dtype else (x.float() * scale).to(dtype)


def as_cached(x: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """x as a read of the cache gives it back: quantized to cache_dtype and dequantized."""
    if cache_dtype == torch.int8:
        values, scales = quantize_int8(x)
        return from_cache(values, x.dtype, 1.0, scales)
    return from_cache(to_cache(x, cache_dtype, scale), x.dtype, scale)


def store_kvcache_torch(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0,
                        k_cache_scales: torch.Tensor | None = None,
                        v_cache_scales: torch.Tensor | None = None) -> None:
    """k and v [T, Hkv, D] into the caches at slot_mapping (-1: not stored); an int8 cache's per-token
    scales into k_cache_scales / v_cache_scales [num_blocks, block_size, Hkv]."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    for x, cache, scale, token_scales in ((k, k_cache, k_scale, k_cache_scales),
                                          (v, v_cache, v_scale, v_cache_scales)):
        if cache.dtype == torch.int8:
            if token_scales is None:
                raise ValueError("an int8 cache needs its scales (k_cache_scales, v_cache_scales)")
            values, row_scales = quantize_int8(x[keep])
            token_scales.view(-1, token_scales.shape[-1]).index_copy_(0, slots, row_scales)
        else:
            values = to_cache(x[keep], cache.dtype, scale)
        if cache.element_size() == 1:  # index_copy_ has no fp8 kernel on CPU: copy the bytes
            cache, values = cache.view(torch.uint8), values.view(torch.uint8)
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, values)


def read_kv(layer: PagedLayer, dtype: torch.dtype, pick) -> tuple[torch.Tensor, torch.Tensor]:
    """The entries pick(cache) of the layer's K and V caches as `dtype`; pick indexes leading dims
    (blocks, tokens), so that it takes an int8 cache's scales of the same entries."""
    k_scales, v_scales = cache_scales(layer)
    k = from_cache(pick(layer.k_cache), dtype, layer.k_scale, None if k_scales is None else pick(k_scales))
    v = from_cache(pick(layer.v_cache), dtype, layer.v_scale, None if v_scales is None else pick(v_scales))
    return k, v


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seqlen: int) -> torch.Tensor:
    """The first seqlen tokens of one sequence's K or V: [seqlen, num_kv_heads, head_dim] (or of an int8
    cache's scales: [seqlen, num_kv_heads])."""
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
        k_scales, v_scales = cache_scales(layer)
        store_kvcache_torch(k, v, layer.k_cache, layer.v_cache, meta.slot_mapping, layer.k_scale,
                            layer.v_scale, k_scales, v_scales)
        if meta.is_prefill:
            return self._prefill(layer, q, k, v, meta)
        return self._decode(layer, q, meta)

    def _prefill(self, layer: PagedLayer, q, k, v, meta: AttentionMetadata) -> torch.Tensor:
        out = torch.empty_like(q)
        cu_q, seqlens_k = meta.cu_seqlens_q_host, meta.seqlens_k_host
        if layer.k_cache.dtype != q.dtype and not meta.has_prefix:  # what the cache holds (module docstring)
            k = as_cached(k, layer.k_cache.dtype, layer.k_scale)
            v = as_cached(v, layer.v_cache.dtype, layer.v_scale)
        for i, seqlen_k in enumerate(seqlens_k):
            start, end = cu_q[i], cu_q[i + 1]
            if meta.has_prefix:
                ki, vi = read_kv(layer, q.dtype, partial(gather_kv, block_table=meta.block_tables[i],
                                                         seqlen=seqlen_k))
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
        k, v = read_kv(layer, q.dtype, lambda cache: cache[tables])
        k, v = k.flatten(1, 2).transpose(1, 2), v.flatten(1, 2).transpose(1, 2)
        positions = torch.arange(k.shape[2], device=q.device)
        valid = positions[None, :] < meta.seqlens_k[:, None]  # [B, Lk]
        # Slots past a sequence's length (its last block's tail, padded table entries) may never have
        # been written, and the CPU cache starts uninitialised: any bits, NaN included, where even a
        # masked-out score turns the row to NaN. The gathered k/v are copies: zero those slots.
        k.masked_fill_(~valid[:, None, :, None], 0.0)
        v.masked_fill_(~valid[:, None, :, None], 0.0)
        return _sdpa(q[:, :, None, :], k, v, valid[:, None, None, :], layer.scale)[:, :, 0, :]
