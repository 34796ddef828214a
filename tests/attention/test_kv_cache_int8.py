"""kv_cache_dtype="int8": int8 values with a float32 scale per (token, KV head), through the torch reference
backend on CPU (and the Triton backend in Triton's interpreter; the kernels alone: tests/kernels). It sizes
its blocks with the scales counted, stores what `quantize_int8` gives, attends over what it stores in
prefill as in decode (as the GPU kernels do), and keeps prompt logprobs several times closer to the full
precision cache's than the fp8 cache does."""

import pytest
import torch
from conftest import PROMPTS, triton_test_device

from nanovllm import LLM, SamplingParams
from nanovllm.attention.torch_backend import INT8_MIN_AMAX, from_cache, quantize_int8, store_kvcache_torch

OPTIONS = dict(kvcache_block_size=4, max_model_len=128, max_num_seqs=16, device="cpu", dtype="float32")
# One float32 block of the tiny model: 2 layers x K,V x 2 KV heads x 16 dims x 4 bytes x 4 tokens; an int8
# one: 2 x 2 x 2 x (16 values + a 4-byte scale) x 4 tokens.
FP32_BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * 4
INT8_BLOCK_BYTES = 2 * 2 * 2 * (16 + 4) * 4


def prompt_logprobs(llm: LLM, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Each prompt's logprobs of its own tokens 1..n (one prefill)."""
    scored = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return [torch.tensor([float(entry[token]) for entry, token in zip(o.prompt_logprobs[1:], prompt[1:])])
            for o, prompt in zip(scored, prompts, strict=True)]


@pytest.fixture(scope="module")
def engines(qwen3_dir):
    return {name: LLM(qwen3_dir, kv_cache_dtype=name, **OPTIONS) for name in ("auto", "fp8", "int8")}


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer.encode(p) for p in PROMPTS]


def test_int8_blocks_count_their_scales(qwen3_dir):
    budget = dict(cpu_kvcache_space_gib=20 * FP32_BLOCK_BYTES / 2**30)
    full, int8 = (LLM(qwen3_dir, kv_cache_dtype=name, **OPTIONS, **budget) for name in ("auto", "int8"))
    assert full.engine.num_kvcache_blocks == 20
    # 64, where values alone (a quarter of float32's bytes) would fit 80.
    assert int8.engine.num_kvcache_blocks == 20 * FP32_BLOCK_BYTES // INT8_BLOCK_BYTES == 64
    assert int8.engine.executor.kv_cache.dtype == torch.int8
    layer = int8.engine.executor.attention_layers[0]
    assert layer.k_cache_scales.shape == layer.v_cache_scales.shape == (64, 4, 2)
    assert layer.k_cache_scales.dtype == torch.float32


def test_store_quantizes_each_token_and_head_with_its_own_scale():
    k, v = torch.randn(5, 2, 16) * 50, torch.randn(5, 2, 16)
    k[1, 0] = 0.0  # an all-zero row: a tiny nonzero scale, and zeros
    caches = [torch.zeros(2, 4, 2, 16, dtype=torch.int8) for _ in range(2)]
    scales = [torch.zeros(2, 4, 2) for _ in range(2)]
    slots = torch.tensor([0, 1, 5, -1, 7])  # -1: padding, stored nowhere
    store_kvcache_torch(k, v, *caches, slots, k_cache_scales=scales[0], v_cache_scales=scales[1])
    keep = slots >= 0
    flat_k, flat_scales = caches[0].view(-1, 2, 16)[slots[keep]], scales[0].view(-1, 2)[slots[keep]]
    torch.testing.assert_close(flat_scales, k[keep].abs().amax(-1).clamp_min(INT8_MIN_AMAX) / 127, atol=0,
                               rtol=0)
    assert flat_scales[1, 0] == INT8_MIN_AMAX / 127 and not flat_k[1, 0].any()
    assert torch.equal(flat_k, torch.round(k[keep] / flat_scales[..., None]).to(torch.int8))
    assert flat_k.abs().amax(-1).eq(127).sum() == flat_k.shape[0] * 2 - 1  # every nonzero row reaches 127
    assert not caches[0].view(-1, 2, 16)[3].any() and not scales[0].view(-1, 2)[3].any()  # slot 3 untouched
    back = from_cache(flat_k, torch.float32, 1.0, flat_scales)
    assert ((back - k[keep]).abs() <= flat_scales[..., None] / 2 * (1 + 1e-6)).all()  # half a step at most
    v_back = from_cache(caches[1].view(-1, 2, 16)[slots[keep]], torch.float32, 1.0, scales[1].view(-1, 2)[
        slots[keep]])
    torch.testing.assert_close(v_back, v[keep], atol=0.02, rtol=0)
    assert quantize_int8(-k)[0].equal(-quantize_int8(k)[0])  # symmetric: -127..127


def test_int8_prompt_logprobs_stay_close_to_the_full_precision_cache(engines, prompts):
    """Prefill attends over what the int8 cache holds, so its logprobs differ from the full cache's (as on
    the GPU): by 0.005-0.03 nats a token here, 3.5-12x less than the fp8 cache's."""
    reference = prompt_logprobs(engines["auto"], prompts)
    errors = {name: [(a - b).abs().mean().item() for a, b in
                     zip(prompt_logprobs(engines[name], prompts), reference, strict=True)]
              for name in ("fp8", "int8")}
    for fp8, int8 in zip(errors["fp8"], errors["int8"], strict=True):
        assert 0 < int8 < 0.05 and int8 < fp8 / 3, errors


def test_int8_greedy_output_matches_the_full_precision_cache(engines):
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    full, int8 = ([o["token_ids"] for o in engines[name].generate(PROMPTS, greedy, use_tqdm=False)]
                  for name in ("auto", "int8"))
    assert int8 == full


def test_triton_backend_reads_the_int8_cache_as_the_torch_backend(qwen3_dir, engines, prompts):
    """The Triton kernels (interpreted on CPU) store and read the int8 cache as the reference backend
    does: the same greedy tokens and prompt logprobs to float32 rounding, so that CPU figures stand for
    the GPU's."""
    triton_test_device()  # skips where Triton can run neither interpreted nor on a GPU
    # A fixed cache: on a GPU (TRITON_INTERPRET=0) it would otherwise take most of the free memory.
    triton = LLM(qwen3_dir, kv_cache_dtype="int8", attention_backend="triton", enforce_eager=True,
                 num_kvcache_blocks=256, **{**OPTIONS, "device": "auto"})
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = [o["token_ids"] for o in engines["int8"].generate(PROMPTS, greedy, use_tqdm=False)]
    assert [o["token_ids"] for o in triton.generate(PROMPTS, greedy, use_tqdm=False)] == want
    for got, expected in zip(prompt_logprobs(triton, prompts), prompt_logprobs(engines["int8"], prompts),
                             strict=True):
        torch.testing.assert_close(got, expected, atol=1e-3, rtol=0)


def test_a_bad_kv_cache_dtype_is_refused(qwen3_dir):
    valid = r"\['auto', 'fp8', 'fp8_e4m3', 'int8'\]"
    with pytest.raises(ValueError, match=f"kv_cache_dtype must be one of {valid}, got 'int4'"):
        LLM(qwen3_dir, kv_cache_dtype="int4", **OPTIONS)


def test_flash_attention_backends_refuse_an_int8_cache():
    from nanovllm.attention.registry import auto_backend, select_backend

    cuda = torch.device("cuda")  # only its type is read before the checks: no GPU needed
    assert auto_backend(cuda, torch.bfloat16, torch.int8) == "triton"
    with pytest.raises(ValueError, match="'int8' use attention_backend='triton'"):
        select_backend("fa3", cuda, 16, torch.bfloat16, 8, 2, torch.int8)
