"""The attention backend interface, and the choice of backend for an engine."""

import logging
import os

import torch

from nanovllm.attention.metadata import AttentionMetadata

logger = logging.getLogger("nanovllm")

# Overrides the `attention_backend` option when set (handy for A/B runs without code changes).
BACKEND_ENV_VAR = "NANOVLLM_ATTENTION_BACKEND"


class AttentionBackend:
    """Stores the step's new K/V into the paged cache, then attends.

    q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim];
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim] (empty before the cache exists).
    Returns [num_tokens, num_heads, head_dim]."""

    name = "base"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        raise NotImplementedError


def select_backend(requested: str, device: torch.device) -> AttentionBackend:
    name = os.environ.get(BACKEND_ENV_VAR) or requested
    if name == "auto":
        name = "torch"
    if name != "torch" and device.type != "cuda":
        raise ValueError(f"attention backend {name!r} needs a CUDA GPU; use attention_backend='torch' on CPU")
    if name == "torch":
        from nanovllm.attention.torch_backend import TorchBackend
        backend = TorchBackend()
    else:
        raise ValueError(f"attention backend {name!r} is not available in this build; use 'torch'")
    logger.info("attention backend: %s", backend.name)
    return backend
