"""The part every GPU backend shares: q/k RMSNorm, rotary and the KV-cache store in one Triton kernel
(nanovllm.kernels.rope_store) before the backend's own attention kernel. In a decode step each of
those would be a tiny kernel whose cost is its launch."""

import torch

from nanovllm.attention.backend import AttentionBackend, PagedLayer
from nanovllm.attention.layer import cache_scales
from nanovllm.attention.metadata import AttentionMetadata
from nanovllm.kernels.rope_store import norm_rope_store


class GPUBackend(AttentionBackend):
    supports_cuda_graph = True

    def forward(self, layer: PagedLayer, q, k, v, positions, meta: AttentionMetadata) -> torch.Tensor:
        q_norm, k_norm = qk_norms(layer)
        k_scales, v_scales = cache_scales(layer)
        q, k = norm_rope_store(q, k, v, positions, layer.rotary.cos, layer.rotary.sin, layer.k_cache,
                               layer.v_cache, meta.slot_mapping, q_norm, k_norm, layer.k_scale, layer.v_scale,
                               k_scales, v_scales)
        return self.attend(layer, q, k, v, meta)

    def decode_kernels(self, rows: int) -> str:
        return f"rope_store, {self.name}"

    def attend(self, layer: PagedLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor:
        """Attention alone: q and k are normed and rotated, and the step's K/V are in the cache."""
        raise NotImplementedError


Norm = tuple[torch.Tensor, float] | None  # (weight [head_dim], eps), as the rope kernels take it


def qk_norms(layer: PagedLayer) -> tuple[Norm, Norm]:
    """The layer's (q_norm, k_norm): (weight, eps) each, or (None, None) without q/k norm."""
    norm = layer.qk_norm
    return ((norm.q_weight, norm.eps), (norm.k_weight, norm.eps)) if norm else (None, None)
