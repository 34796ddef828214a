"""The token counts the piecewise graphs are captured at (runner/piecewise.py): every prefill or mixed
step up to the largest one runs at one of them, with little padding."""

from nanovllm.runner.inputs import padded_num_tokens
from nanovllm.runner.piecewise import FINE_LADDER_LIMIT, MAX_GRAPH_TOKENS, graph_token_sizes


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
    import gc
    import weakref

    import torch

    from nanovllm import LLM
    from nanovllm.runner.piecewise import PiecewiseGraphs

    llm = LLM(qwen3_dir, kvcache_block_size=4, max_model_len=64, max_num_seqs=2, num_kvcache_blocks=32,
              enforce_eager=True)
    runner = llm.engine.model_runner
    runner.piecewise = PiecewiseGraphs(runner.model, 8, runner.dtype, runner.device, use_cuda_graph=False,
                                       sizes=[8])
    cache = weakref.ref(runner.kv_cache)
    assert isinstance(cache(), torch.Tensor)
    llm.shutdown()
    gc.collect()
    assert cache() is None
