"""The choice of attention backend for an engine: the `attention_backend` option, else the fastest
one measured (triton on GPUs, torch on CPU). Backend modules are imported only when chosen, so
CPU-only installs never import Triton or FlashAttention."""

import importlib.util
import logging
import os

import torch

from nanovllm.attention.backend import AttentionBackend

logger = logging.getLogger("nanovllm")

BACKENDS = ("torch", "triton", "triton-fa3", "flash-attn", "fa3")
# Backends that call FlashAttention-3's kernels (triton-fa3: its prefill only), and all FlashAttention ones.
FA3_BACKENDS = ("fa3", "triton-fa3")
FLASH_BACKENDS = (*FA3_BACKENDS, "flash-attn")
# FlashAttention-2 reads a paged cache only when a page holds a multiple of this many tokens.
FLASH_ATTN2_PAGE_MULTIPLE = 256
# Both FlashAttention versions compute in half precision only.
FLASH_ATTN_DTYPES = (torch.bfloat16, torch.float16)


def _has_module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def auto_backend(device: torch.device, dtype: torch.dtype | None = None,
                 kv_dtype: torch.dtype | None = None) -> str:
    """torch on CPU; on GPUs the project's Triton kernels, with FlashAttention-3's prefill where FA3 is
    installed and the cache holds the model's bfloat16/float16 (dtype given): "triton-fa3". Chosen by
    measurement, not by name (docs/performance-notes.md, section "Decode attention at large batches"): on
    the H200
    triton's decode beat fa3's in every side-by-side run (bench.py 19.3k vs 17.5k tok/s, 23.0k vs 20.0k
    earlier; 1024 requests 30.7 s vs 36.1 s), and FA3's paged prefill kernel ran 1.5-1.9x the Triton one
    at 1-8k-token prompts (commit 7e8123f, 2026-11-30)."""
    if device.type != "cuda":
        return "torch"
    fa3_fits = dtype in FLASH_ATTN_DTYPES and kv_dtype in (None, dtype)
    return "triton-fa3" if fa3_fits and _has_module("flash_attn_interface") else "triton"


def _check(name: str, device: torch.device, block_size: int, dtype: torch.dtype,
           kv_dtype: torch.dtype) -> None:
    # Triton kernels also run on CPU tensors in its interpreter (used by the tests).
    interpreted = name == "triton" and os.environ.get("TRITON_INTERPRET") == "1"
    if name != "torch" and device.type != "cuda" and not interpreted:
        raise ValueError(f"attention backend {name!r} needs a CUDA GPU; use attention_backend='torch' on CPU")
    if name in FLASH_BACKENDS and dtype not in FLASH_ATTN_DTYPES:
        raise ValueError(f"attention backend {name!r} computes in bfloat16/float16 only, not {dtype}; "
                         "set dtype='bfloat16', or use attention_backend='triton' or 'torch'")
    if name in FLASH_BACKENDS and kv_dtype != dtype:
        raise ValueError(f"attention backend {name!r} reads a KV cache of the model's dtype only; with "
                         "kv_cache_dtype='fp8' or 'int8' use attention_backend='triton' (or 'auto')")
    if name in FA3_BACKENDS and not _has_module("flash_attn_interface"):
        raise ValueError(f"attention_backend={name!r} needs FlashAttention-3 (`flash_attn_interface`, Hopper "
                         "GPUs); install it or use 'triton'")
    if name == "flash-attn":
        if not _has_module("flash_attn"):
            raise ValueError("attention_backend='flash-attn' needs `pip install flash-attn`; or use 'triton'")
        if block_size % FLASH_ATTN2_PAGE_MULTIPLE:
            raise ValueError(f"flash-attn reads paged KV only in blocks of a multiple of "
                             f"{FLASH_ATTN2_PAGE_MULTIPLE} tokens; set kvcache_block_size=256 "
                             f"(got {block_size}) or use 'fa3'/'triton'")


def select_backend(requested: str, device: torch.device, block_size: int, dtype: torch.dtype,
                   max_num_seqs: int, num_kv_heads: int,
                   kv_dtype: torch.dtype | None = None) -> AttentionBackend:
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    name = auto_backend(device, dtype, kv_dtype) if requested == "auto" else requested
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; valid: {list(BACKENDS)}")
    _check(name, device, block_size, dtype, kv_dtype)
    if name == "torch":
        from nanovllm.attention.torch_backend import TorchBackend
        backend: AttentionBackend = TorchBackend()
    elif name in ("triton", "triton-fa3"):
        from nanovllm.attention.triton_backend import TritonBackend
        backend = TritonBackend(max_num_seqs, num_kv_heads, device, fa3_prefill=name == "triton-fa3")
    elif name == "fa3":
        from nanovllm.attention.flash_attn_backend import FlashAttention3Backend
        backend = FlashAttention3Backend()
    else:
        from nanovllm.attention.flash_attn_backend import FlashAttention2Backend
        backend = FlashAttention2Backend()
    logger.debug("attention backend: %s", backend.name)
    return backend
