"""The piecewise graphs (runner/piecewise.py) apart from the GPU: the token counts they are captured at
(every prefill or mixed step up to the largest one runs at one of them, with little padding, and their
memory caps the ladder), and a shut-down engine's cache freed despite the modules they hold."""

import gc
import os
import weakref

import torch
from transformers import AutoConfig

from nanovllm import LLM
from nanovllm.models import get_model_class
from nanovllm.runner.inputs import padded_num_tokens
from nanovllm.runner.piecewise import (
    FINE_LADDER_LIMIT,
    MAX_GRAPH_TOKENS,
    PiecewiseGraphs,
    graph_token_sizes,
    memory_token_limit,
    token_bytes,
)

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "configs")


def test_the_ladder_covers_every_step_with_little_padding():
    for max_tokens in (1, 7, 100, FINE_LADDER_LIMIT + 1, 3000, 16384):
        sizes = graph_token_sizes(max_tokens)
        assert sizes == sorted(set(sizes))
        assert all(padded_num_tokens(s) == s for s in sizes)  # shapes of the eager steps' family
        limit = min(max_tokens, MAX_GRAPH_TOKENS)
        assert sizes[-1] >= limit and (len(sizes) == 1 or sizes[-2] < limit)
        for n in range(1, limit + 1):
            size = next(s for s in sizes if s >= n)
            assert size <= padded_num_tokens(n) or size - n < max(64, n // 8)


def test_the_ladder_stays_short():
    assert len(graph_token_sizes(16384)) <= 48  # x (layers + 1) graphs to capture at start-up


def test_shutdown_frees_the_kv_cache_while_the_llm_lives(qwen3_dir):
    """The graph runners hold the model's modules: after shutdown they must not keep its KV cache
    alive (a script that builds engines one after another would run out of memory)."""
    llm = LLM(qwen3_dir, kvcache_block_size=4, max_model_len=64, max_num_seqs=2, num_kvcache_blocks=32,
              enforce_eager=True)
    runner = llm.engine.executor
    runner.piecewise = PiecewiseGraphs(runner.model, 8, runner.dtype, runner.device, use_cuda_graph=False,
                                       sizes=[8])
    cache = weakref.ref(runner.kv_cache)
    assert isinstance(cache(), torch.Tensor)
    llm.shutdown()
    gc.collect()
    assert cache() is None


def _one_layer_model(config_dir: str, **overrides):
    config = AutoConfig.from_pretrained(config_dir)
    config.num_hidden_layers = 1
    for key, value in overrides.items():
        setattr(config, key, value)
    with torch.device("meta"):  # shapes only: no memory
        return get_model_class(config)(config)


def test_graph_memory_caps_the_ladder_on_small_gpus():
    """The graphs' memory comes out of the KV cache: on an H200 Qwen3-0.6B's ladder runs to the
    largest size, while Qwen3-8B on a 24 GiB card stops early; MoE layers count every routed expert."""
    small, large = (_one_layer_model(os.path.join(CONFIGS, name)) for name in ("Qwen3-0.6B", "Qwen3-8B"))
    assert 50_000 < token_bytes(small, torch.bfloat16) < 56_000  # what MAX_MEMORY_SHARE's comment says
    h200, card = 141 * 10**9, 24 * 2**30
    assert memory_token_limit(small, torch.bfloat16, h200) > MAX_GRAPH_TOKENS
    assert 4_000 < memory_token_limit(large, torch.bfloat16, card) < MAX_GRAPH_TOKENS
    assert graph_token_sizes(memory_token_limit(large, torch.bfloat16, card))[-1] < MAX_GRAPH_TOKENS
    moe = os.path.join(CONFIGS, "Qwen3-30B-A3B")
    assert (token_bytes(_one_layer_model(moe), torch.bfloat16)
            > token_bytes(_one_layer_model(moe, num_experts_per_tok=1), torch.bfloat16))
