"""The paged KV cache of one rank: one tensor [2 (k, v), layers, blocks, block_size, kv_heads, head_dim]
whose per-layer views the attention layers read and write (an int8 cache also a float32 tensor of scales
[2, layers, blocks, block_size, kv_heads], one per cached token and KV head), and how many blocks fit a
memory budget (on a GPU, what is left after a warm-up forward at the largest batch); and an fp8 cache's
per-layer scales where the checkpoint calibrated them."""

import logging
import math
from typing import Protocol

import torch
from torch import nn

from nanovllm.attention.layer import Attention
from nanovllm.config import Config
from nanovllm.engine.step import StepBatch
from nanovllm.layers.kernel_plan import KernelPlan
from nanovllm.layers.parallel import get_tp_rank, min_across_ranks, use_tp_group
from nanovllm.models import get_model_class
from nanovllm.runner.sampling import StepSampler, worst_case_sampling
from nanovllm.utils.kv_scales import KvScales


class SizedRunner(Protocol):
    """What sizing the cache reads of the model runner (nanovllm.runner.model_runner)."""

    config: Config
    device: torch.device
    dtype: torch.dtype
    kv_dtype: torch.dtype
    block_size: int
    model: nn.Module
    sampler: StepSampler
    attention_layers: list[Attention]

    def _allocate_kv_cache(self, num_blocks: int) -> None: ...

    def _release_kv_cache(self) -> None: ...

    def _forward(self, batch: StepBatch) -> object: ...

logger = logging.getLogger("nanovllm")


# An int8 cache's scales: one of this dtype per cached token, KV head and K or V.
INT8_SCALE_DTYPE = torch.float32


def block_bytes(layers: list[Attention], block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers (its keys and values, and an int8 cache's scales)."""
    heads = 2 * len(layers) * layers[0].num_kv_heads * block_size  # (K, V) x layers x KV heads x tokens
    per_head = layers[0].head_dim * dtype.itemsize
    if dtype == torch.int8:
        per_head += INT8_SCALE_DTYPE.itemsize
    return heads * per_head


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
    num_bytes = cache.numel() * cache.element_size()
    if dtype == torch.int8:
        # The layers' views keep the scales alive as they keep the cache (detach drops both).
        scales = alloc(shape[:-1], dtype=INT8_SCALE_DTYPE, device=device)
        for i, layer in enumerate(layers):
            layer.k_cache_scales, layer.v_cache_scales = scales[0, i], scales[1, i]
        num_bytes += scales.numel() * scales.element_size()
    logger.debug("KV cache: %d blocks of %d tokens (%.2f GiB)", num_blocks, block_size, num_bytes / 2**30)
    return cache


def use_checkpoint_scales(model: nn.Module, scales: KvScales | None, dtype: torch.dtype) -> None:
    """Give an fp8 cache (`dtype` e4m3) the checkpoint's calibrated scales, layer by layer (1.0 where it
    has none; None: no checkpoint); other caches leave them unread (utils/kv_scales.py). Set before any
    graph is captured: the kernels take the scales as constants."""
    if not scales:
        return
    first = get_tp_rank() == 0  # every rank reads the same scales; one says so
    if dtype != torch.float8_e4m3fn:
        if first:
            logger.info("the checkpoint's KV-cache scales are unused with a %s cache (kv_cache_dtype='fp8' "
                        "reads them)", str(dtype).removeprefix("torch."))
        return
    layers = [(name.rpartition(".")[0], m) for name, m in model.named_modules() if isinstance(m, Attention)]
    given = 0
    for attn, layer in layers:
        found = scales.layer(attn)
        if found is not None:
            layer.k_scale, layer.v_scale = found
            given += 1
    if first and given < len(layers):
        logger.warning("the checkpoint gives KV-cache scales for %d of %d attention layers; the others use "
                       "1.0", given, len(layers))
    elif first:
        logger.info("fp8 KV cache with the checkpoint's scales (k up to %.4g, v up to %.4g)",
                    max(layer.k_scale for _, layer in layers), max(layer.v_scale for _, layer in layers))


def draft_footprint(draft: Config) -> tuple[int, int]:
    """(bytes one KV block takes, bytes of weights and buffers) of a draft model, counted on its model
    built on the meta device: nothing is allocated or read. Its linear layers count unquantized, an
    upper bound for an fp8 checkpoint. Built whole, outside any tensor-parallel group: the draft runs
    on one rank."""
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, draft.model_dtype))
    try:
        with torch.device("meta"), use_tp_group(None):
            model = get_model_class(draft.hf_config)(draft.hf_config, KernelPlan.torch_only())
    finally:
        torch.set_default_dtype(dtype)
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    return block_bytes(layers, draft.kvcache_block_size, getattr(torch, draft.cache_dtype)), weights


def detach(layers: list[Attention]) -> None:
    """Take the cache's views from the layers (the tensor is freed once its owner drops it)."""
    for layer in layers:
        layer.k_cache = layer.v_cache = torch.empty(0)
        layer.k_cache_scales = layer.v_cache_scales = torch.empty(0)


def num_blocks_that_fit(runner: SizedRunner) -> int:
    """Blocks of the runner's layers that fit its memory budget, the same on every rank."""
    config, device = runner.config, runner.device
    activation_peak = 0
    if device.type == "cuda":
        activation_peak = _activation_peak(runner)
        logger.debug("warm-up forward done: %.2f GiB of activations at the largest batch",
                     activation_peak / 2**30)
        torch.cuda.empty_cache()
    bytes_per_block = block_bytes(runner.attention_layers, runner.block_size, runner.kv_dtype)
    reserved = activation_peak
    if config.draft_config is not None and get_tp_rank() == 0:
        # Speculative decoding's draft model runs beside rank 0 (nanovllm.speculative.draft), loaded once
        # this cache is allocated, with a cache of as many blocks: each block costs both models' KV, and
        # on a GPU the draft's weights are set aside first (the CPU budget is for KV alone). Its
        # activations reuse the memory the target's peak was measured in (a smaller model, steps of at
        # most max_num_batched_tokens, never at the same time as the target's).
        draft_block, draft_weights = draft_footprint(config.draft_config)
        bytes_per_block += draft_block
        reserved += draft_weights if device.type == "cuda" else 0
    num_blocks = blocks_for_budget(config, device, bytes_per_block, reserved)
    # One scheduler on rank 0 hands out block ids for every rank: all must hold as many blocks
    # (and all raise together when one has none).
    num_blocks = min_across_ranks(num_blocks)
    if num_blocks < 1:
        raise no_room_error(config, device)
    return num_blocks


@torch.inference_mode()
def _activation_peak(runner: SizedRunner) -> int:
    """One prefill at the largest batch the scheduler can form, over a temporary KV cache just big
    enough for it, and the sampler at the largest decode batch; returns the activation memory they
    took beyond that cache (bytes)."""
    config, device = runner.config, runner.device
    num_tokens = config.max_num_batched_tokens
    num_seqs = max(1, min(config.max_num_seqs, num_tokens // config.max_model_len))
    seq_len = min(config.max_model_len, num_tokens // num_seqs)
    blocks_per_seq = math.ceil(seq_len / runner.block_size)
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(num_seqs)]
    runner._allocate_kv_cache(num_seqs * blocks_per_seq)
    batch = StepBatch(
        is_prefill=True, input_ids=[0] * (num_seqs * seq_len), positions=list(range(seq_len)) * num_seqs,
        slot_mapping=[-1] * (num_seqs * seq_len), cu_seqlens_q=list(range(0, num_seqs * seq_len + 1,
        seq_len)),
        seqlens_k=[seq_len] * num_seqs, block_tables=tables, sample_rows=list(range(num_seqs)), sampling=None)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    runner._forward(batch)
    # The largest decode batch samples from full-vocabulary logits (top-p sorts them, processors
    # and logprobs copy them): its peak too.
    max_batch = min(config.max_num_seqs, config.max_num_batched_tokens)
    hidden = torch.zeros(max_batch, config.hf_config.hidden_size, dtype=runner.dtype, device=device)
    logits = runner.model.compute_logits(hidden)
    if logits is not None:  # rank 0 only
        runner.sampler(logits, worst_case_sampling(max_batch))
    torch.cuda.synchronize(device)
    activation_peak = torch.cuda.max_memory_allocated(device) - before
    runner._release_kv_cache()
    return activation_peak
