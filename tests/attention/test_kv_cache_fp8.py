"""kv_cache_dtype="fp8": an e4m3 KV cache with per-layer scales, through the torch reference backend on
CPU (the Triton kernels' fp8 paths are checked in tests/kernels). It holds four times the tokens of a
float32 cache in the same memory, stores exactly what `to_cache` quantizes, and keeps the model's
outputs close to the full-precision cache's."""

import pytest
import torch
from conftest import PROMPTS

from nanovllm import LLM, SamplingParams
from nanovllm.attention.torch_backend import from_cache, store_kvcache_torch, to_cache
from nanovllm.llm import prompt_logits

OPTIONS = dict(kvcache_block_size=4, max_model_len=128, max_num_seqs=16, device="cpu")  # the torch backend
# One float32 block of the tiny model: 2 layers x K,V x 2 KV heads x 16 dims x 4 bytes x 4 tokens.
FP32_BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * 4


@pytest.fixture(scope="module")
def engines(qwen3_dir):
    return LLM(qwen3_dir, **OPTIONS), LLM(qwen3_dir, kv_cache_dtype="fp8", **OPTIONS)


def test_fp8_cache_holds_four_times_the_tokens_of_float32(qwen3_dir):
    budget = dict(cpu_kvcache_space_gib=10 * FP32_BLOCK_BYTES / 2**30)
    full, fp8 = LLM(qwen3_dir, **OPTIONS, **budget), LLM(qwen3_dir, kv_cache_dtype="fp8", **OPTIONS, **budget)
    assert full.engine.num_kvcache_blocks == 10 and fp8.engine.num_kvcache_blocks == 40
    assert fp8.engine.executor.kv_cache.dtype == torch.float8_e4m3fn


def test_store_quantizes_with_the_layer_scale_and_reads_back_within_e4m3_precision():
    k, v = torch.randn(5, 2, 16) * 50, torch.randn(5, 2, 16)
    k[0, 0, 0] = 10_000.0  # beyond e4m3's 448 x scale: clamped, not inf
    caches = [torch.zeros(2, 4, 2, 16, dtype=torch.float8_e4m3fn) for _ in range(2)]
    slots = torch.tensor([0, 1, 5, -1, 7])  # -1: padding, stored nowhere
    store_kvcache_torch(k, v, *caches, slots, k_scale=0.5, v_scale=2.0)
    flat_k, flat_v = (c.view(-1, 2, 16) for c in caches)
    keep = slots >= 0
    assert torch.equal(flat_k[slots[keep]].float(), to_cache(k[keep], torch.float8_e4m3fn, 0.5).float())
    assert torch.equal(flat_v[slots[keep]].float(), to_cache(v[keep], torch.float8_e4m3fn, 2.0).float())
    assert flat_k[0, 0, 0].float() == 448.0
    assert not flat_k[3].float().any()  # slot 3 untouched
    back = from_cache(flat_k[slots[keep]], torch.float32, 0.5)
    mask = torch.ones_like(back, dtype=torch.bool)
    mask[0, 0, 0] = False
    # e4m3 keeps 3 mantissa bits: within 2**-4 relative after rounding to nearest.
    torch.testing.assert_close(back[mask], k[keep][mask], rtol=2**-4, atol=1e-2)


def test_fp8_outputs_stay_close_to_the_full_precision_cache(engines, tokenizer):
    full, fp8 = engines
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    first = [o["token_ids"][0] for o in full.generate(PROMPTS, greedy, use_tqdm=False)]
    assert [o["token_ids"][0] for o in fp8.generate(PROMPTS, greedy, use_tqdm=False)] == first
    for prompt in PROMPTS:  # logits after the prompt and a few more tokens read from the cache
        ids = tokenizer.encode(prompt) + [5, 6, 7]
        reference, quantized = prompt_logits(full, ids), prompt_logits(fp8, ids)
        # The tiny model's keys reach ~10, where e4m3 steps are 1/8 apart: a few percent of logit error.
        assert (quantized - reference).norm() / reference.norm() < 0.15


def test_flash_attention_backends_refuse_an_fp8_cache():
    from nanovllm.attention.registry import auto_backend, select_backend

    cuda = torch.device("cuda")  # only its type is read before the checks: no GPU needed
    assert auto_backend(cuda) == "triton"
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8'"):
        select_backend("fa3", cuda, 16, torch.bfloat16, 8, 2, torch.float8_e4m3fn)
