"""The attention layer: holds its slice of the paged KV cache and hands q/k/v to the engine's
attention backend together with the step's metadata (see nanovllm.attention)."""

import torch
from torch import nn

from nanovllm.attention.backend import AttentionBackend
from nanovllm.attention.metadata import get_attention_metadata


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.scale = num_heads, head_dim, scale
        self.num_kv_heads = num_kv_heads
        # Set by the model runner when it allocates the cache (the GPU warm-up uses a temporary one).
        self.k_cache = self.v_cache = torch.tensor([])
        self.backend: AttentionBackend | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        assert self.backend is not None, "attention backend not set; the model runner sets it"
        return self.backend.forward(q, k, v, self.k_cache, self.v_cache, get_attention_metadata(), self.scale)
