"""The paged KV cache of one rank: one tensor [2 (k, v), layers, blocks, block_size, kv_heads, head_dim]
whose per-layer views the attention layers read and write, and how many blocks fit a memory budget."""

import logging
import math

import torch

from nanovllm.attention.layer import Attention
from nanovllm.config import Config

logger = logging.getLogger("nanovllm")


def block_bytes(layers: list[Attention], block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers (its keys and values)."""
    per_token = 2 * len(layers) * layers[0].num_kv_heads * layers[0].head_dim
    return per_token * block_size * torch.empty((), dtype=dtype).element_size()


def blocks_for_budget(config: Config, device: torch.device, bytes_per_block: int,
                      activation_peak: int) -> int:
    """Blocks that fit this rank's memory budget (possibly < 1): on a GPU, the allowed share minus what
    is in use and the activation peak a warm-up showed; on the CPU, cpu_kvcache_space_gib, capped at
    what the engine could ever use."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = total * config.gpu_memory_utilization - (total - free) - activation_peak
    else:
        budget = config.cpu_kvcache_space_gib * 2**30
    num_blocks = int(budget // bytes_per_block)
    if device.type == "cpu":  # never allocate more than the engine could ever use
        max_blocks = config.max_num_seqs * math.ceil(config.max_model_len / config.kvcache_block_size)
        num_blocks = min(num_blocks, max_blocks)
    return num_blocks


def no_room_error(config: Config, device: torch.device) -> ValueError:
    source = (f"gpu_memory_utilization={config.gpu_memory_utilization}" if device.type == "cuda"
              else f"cpu_kvcache_space_gib={config.cpu_kvcache_space_gib}")
    return ValueError(f"no memory left for the KV cache under {source}; raise it, or lower "
                      "max_num_batched_tokens / max_num_seqs")


def allocate(layers: list[Attention], num_blocks: int, block_size: int, dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
    """The cache tensor, its views handed to the layers (layer.k_cache, layer.v_cache)."""
    shape = (2, len(layers), num_blocks, block_size, layers[0].num_kv_heads, layers[0].head_dim)
    # On the CPU, zero-filling GiBs took seconds at start; uninitialised memory costs nothing until
    # a block is written. Nothing reads a slot before it is written except the torch backend's
    # padded decode gather, which zeroes those positions itself (attention/torch_backend.py).
    alloc = torch.empty if device.type == "cpu" else torch.zeros
    cache = alloc(shape, dtype=dtype, device=device)
    for i, layer in enumerate(layers):
        layer.k_cache, layer.v_cache = cache[0, i], cache[1, i]
    logger.debug("KV cache: %d blocks of %d tokens (%.2f GiB)", num_blocks, block_size,
                 cache.numel() * cache.element_size() / 2**30)
    return cache


def detach(layers: list[Attention]) -> None:
    """Take the cache's views from the layers (the tensor is freed once its owner drops it)."""
    for layer in layers:
        layer.k_cache = layer.v_cache = torch.empty(0)
