"""The attention backend interface. A backend takes one layer's q, k, v (before q/k-norm and rotary)
and does the rest in one call: norm, rotary, storing the step's K/V into the paged cache, attention.
Implementations: torch_backend (the reference), triton_backend and flash_attn_backend (GPU); the
choice of one is nanovllm.attention.registry's."""

from dataclasses import dataclass
from typing import Protocol

import torch

from nanovllm.attention.metadata import AttentionMetadata


@dataclass(frozen=True, slots=True)
class QKNorm:
    """Per-head RMSNorm of q and k before the rotation (Qwen3): the model's own norm weights."""

    q_weight: torch.Tensor  # [head_dim]
    k_weight: torch.Tensor  # [head_dim]
    eps: float


class RotaryTables(Protocol):
    """The model's rotary tables (nanovllm.attention.layer.RotaryEmbedding)."""

    cos: torch.Tensor  # [max_position, head_dim] float32
    sin: torch.Tensor


class PagedLayer(Protocol):
    """What a backend reads of the layer it serves (nanovllm.attention.layer.Attention)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    rotary: RotaryTables
    qk_norm: QKNorm | None
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim], model dtype, fp8 or int8
    v_cache: torch.Tensor
    k_scale: float  # an fp8 cache holds k / k_scale and v / v_scale
    v_scale: float
    # An int8 cache's float32 scales [num_blocks, block_size, num_kv_heads] (empty for other caches): it holds
    # round(k / scale), scale = amax(|k| over head_dim) / 127 per (token, KV head).
    k_cache_scales: torch.Tensor
    v_cache_scales: torch.Tensor


class AttentionBackend:
    name = "base"
    # Decode can be captured in a CUDA graph: no host syncs, no data-dependent shapes.
    supports_cuda_graph = False

    def forward(self, layer: PagedLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, H, D], k and v: [T, Hkv, D], positions: [T] -> attention output [T, H, D]."""
        raise NotImplementedError

    def decode_kernels(self, rows: int) -> str:
        """The kernels a decode step of this many rows attends with, for the kernel table
        (nanovllm.layers.kernel_plan.kernel_table)."""
        return self.name

    def warm_up(self, layer: PagedLayer, dtype: torch.dtype, max_num_seqs: int, max_blocks: int) -> None:
        """Builds, over the layer's allocated cache, the kernel variants a step may pick by its shape
        (`dtype`: the model's; a step has at most max_num_seqs sequences of max_blocks blocks), so that no
        step stops mid-run to compile one. Nothing to build by default."""
