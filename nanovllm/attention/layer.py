"""The attention layer of one decoder layer: its slice of the paged KV cache (set by the model runner),
the shared rotary tables, the optional q/k norm, and the engine's backend, which does the work."""

import torch
from torch import nn

from nanovllm.attention.backend import AttentionBackend, QKNorm
from nanovllm.attention.metadata import AttentionMetadata
from nanovllm.attention.rotary import RotaryEmbedding


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, rotary: RotaryEmbedding,
                 qk_norm: QKNorm | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5
        self.rotary = rotary  # one module shared by every layer of the model
        self.qk_norm = qk_norm
        # Set by the model runner when it allocates the cache (the GPU warm-up uses a temporary one).
        self.k_cache = self.v_cache = torch.empty(0)
        # Per-layer scales of an fp8 KV cache (kv_cache_dtype="fp8"): the cache holds k / k_scale and
        # v / v_scale. 1.0 suits models whose keys and values stay well inside e4m3's range (448).
        self.k_scale = self.v_scale = 1.0
        self.backend: AttentionBackend | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, H, D], k and v: [T, Hkv, D] before norm and rotary -> attention output [T, H, D]."""
        assert self.backend is not None, "attention backend not set; the model runner sets it"
        out = self.backend.forward(self, q, k, v, positions, meta)
        num_real = meta.cu_seqlens_q_host[-1] if meta.is_prefill and meta.cu_seqlens_q_host else out.shape[0]
        if num_real < out.shape[0]:
            # Padding rows (runner/inputs.py) attend to nothing, so no backend writes their output:
            # zeros, not whatever the allocation held, go on through the layer (an MoE router).
            out[num_real:].zero_()
        return out
