"""The attention layer: holds its slice of the paged KV cache, applies the rotary embedding (after the
per-head q/k RMSNorm of models that have one), and hands q/k/v to the engine's attention backend
together with the step's metadata (see nanovllm.attention).

On the GPU backends, whose K/V store is a Triton kernel, norm + rotary + store run as one kernel
(nanovllm.kernels.rope_store): in a decode step each of them costs little more than its launch."""

import torch
from torch import nn

from nanovllm.attention.backend import AttentionBackend
from nanovllm.attention.metadata import get_attention_metadata
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.rotary_embedding import RotaryEmbedding


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.scale = num_heads, head_dim, scale
        self.num_kv_heads = num_kv_heads
        # Set by the model runner when it allocates the cache (the GPU warm-up uses a temporary one).
        self.k_cache = self.v_cache = torch.tensor([])
        self.backend: AttentionBackend | None = None

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                rotary: RotaryEmbedding, qk_norms: tuple[RMSNorm, RMSNorm] | None = None) -> torch.Tensor:
        """q: [T, H, D], k and v: [T, Hkv, D] before norm and rotary -> attention output [T, H, D]."""
        backend = self.backend
        assert backend is not None, "attention backend not set; the model runner sets it"
        meta = get_attention_metadata()
        if backend.fused_store:
            from nanovllm.kernels.rope_store import norm_rope_store  # needs triton: GPU backends only
            norms = [(n.weight, n.eps) for n in qk_norms] if qk_norms else [None, None]
            q, k = norm_rope_store(q, k, v, positions, rotary.cos, rotary.sin, self.k_cache, self.v_cache,
                                   meta.slot_mapping, *norms)
            return backend.attend(q, k, v, self.k_cache, self.v_cache, meta, self.scale)
        q, k = rotary(positions, q, k, qk_norms)
        return backend.forward(q, k, v, self.k_cache, self.v_cache, meta, self.scale)
