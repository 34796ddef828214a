"""The attention backend interface, and the choice of backend for an engine: the
`attention_backend` option, else the NANOVLLM_ATTENTION_BACKEND environment variable, else the
fastest one available (fa3 on Hopper, flash-attn, triton on other GPUs and for float32, torch on CPU)."""

import importlib.util
import logging
import os

import torch

from nanovllm.attention.metadata import AttentionMetadata

logger = logging.getLogger("nanovllm")

BACKEND_ENV_VAR = "NANOVLLM_ATTENTION_BACKEND"
BACKENDS = ("torch", "triton", "flash-attn", "fa3")
# FlashAttention-2 reads a paged cache only when a page holds a multiple of this many tokens.
FLASH_ATTN2_PAGE_MULTIPLE = 256
# Both FlashAttention versions compute in half precision only.
FLASH_ATTN_DTYPES = (torch.bfloat16, torch.float16)


class AttentionBackend:
    """Stores the step's new K/V into the paged cache, then attends.

    q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim];
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim].
    Returns [num_tokens, num_heads, head_dim]."""

    name = "base"
    # Decode can be captured in a CUDA graph: no host syncs, no data-dependent shapes.
    supports_cuda_graph = False
    # The store is nanovllm.kernels' Triton store: the attention layer may fold it into its rotary
    # kernel (nanovllm.kernels.rope_store) and call `attend` alone.
    fused_store = False

    def store(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              meta: AttentionMetadata) -> None:
        raise NotImplementedError

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Attention alone, with the step's k/v already in the cache."""
        raise NotImplementedError

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        self.store(k, v, k_cache, v_cache, meta)
        return self.attend(q, k, v, k_cache, v_cache, meta, scale)


def _has_module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def _auto_backend(device: torch.device, block_size: int, dtype: torch.dtype) -> str:
    if device.type != "cuda":
        return "torch"
    if dtype not in FLASH_ATTN_DTYPES:
        return "triton"
    if _has_module("flash_attn_interface") and torch.cuda.get_device_capability(device)[0] == 9:
        return "fa3"
    if _has_module("flash_attn") and block_size % FLASH_ATTN2_PAGE_MULTIPLE == 0:
        return "flash-attn"
    return "triton"


def select_backend(requested: str, device: torch.device, block_size: int,
                   dtype: torch.dtype = torch.bfloat16) -> AttentionBackend:
    name = requested if requested != "auto" else os.environ.get(BACKEND_ENV_VAR, "auto")
    if name == "auto":
        name = _auto_backend(device, block_size, dtype)
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r} (from {BACKEND_ENV_VAR}?); "
                         f"valid: {list(BACKENDS)}")
    # Triton kernels also run on CPU tensors in its interpreter (used by the tests).
    interpreted = name == "triton" and os.environ.get("TRITON_INTERPRET") == "1"
    if name != "torch" and device.type != "cuda" and not interpreted:
        raise ValueError(f"attention backend {name!r} needs a CUDA GPU; use attention_backend='torch' on CPU")
    if name in ("fa3", "flash-attn") and dtype not in FLASH_ATTN_DTYPES:
        raise ValueError(f"attention backend {name!r} computes in bfloat16/float16 only, not {dtype}; "
                         "set dtype='bfloat16', or use attention_backend='triton' or 'torch'")
    if name == "torch":
        from nanovllm.attention.torch_backend import TorchBackend
        backend: AttentionBackend = TorchBackend()
    elif name == "triton":
        from nanovllm.attention.triton_backend import TritonBackend
        backend = TritonBackend()
    elif name == "fa3":
        if not _has_module("flash_attn_interface"):
            raise ValueError("attention_backend='fa3' needs FlashAttention-3 (`flash_attn_interface`, Hopper "
                             "GPUs); install it or use 'triton'")
        from nanovllm.attention.flash_attn_backend import FlashAttention3Backend
        backend = FlashAttention3Backend()
    else:
        if not _has_module("flash_attn"):
            raise ValueError("attention_backend='flash-attn' needs `pip install flash-attn`; or use 'triton'")
        if block_size % FLASH_ATTN2_PAGE_MULTIPLE:
            raise ValueError(f"flash-attn reads paged KV only in blocks of a multiple of "
                             f"{FLASH_ATTN2_PAGE_MULTIPLE} tokens; set kvcache_block_size=256 "
                             f"(got {block_size}) or use 'fa3'/'triton'")
        from nanovllm.attention.flash_attn_backend import FlashAttention2Backend
        backend = FlashAttention2Backend()
    logger.debug("attention backend: %s", backend.name)
    return backend
