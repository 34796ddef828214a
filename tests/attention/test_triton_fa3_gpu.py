"""triton-fa3 on a GPU with FlashAttention-3 installed (skipped elsewhere; its plumbing is checked on CPU
in test_flash_attn_plumbing.py): FA3's prefill in the Triton backend gives the plain Triton backend's
logits within bf16 rounding, for a whole prompt, over a cached prefix and through chunked (mixed) steps."""

import importlib.util
import os

import pytest
import torch
from conftest import PROMPTS

from nanovllm import LLM, SamplingParams
from nanovllm.attention import triton_backend
from nanovllm.llm import prompt_logits

if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
    pytest.skip("needs a GPU (TRITON_INTERPRET=0 CUDA_VISIBLE_DEVICES=0)", allow_module_level=True)
if importlib.util.find_spec("flash_attn_interface") is None:
    pytest.skip("needs FlashAttention-3 (flash_attn_interface)", allow_module_level=True)

OPTIONS = dict(dtype="bfloat16", kvcache_block_size=16, max_model_len=256, max_num_seqs=8,
               num_kvcache_blocks=128, enforce_eager=True)
# bf16 logits of two attention kernels (their own summation orders) differ by a few bf16 roundings.
REL_TOL = 2e-2


@pytest.fixture(autouse=True)
def fa3_for_every_chunk(monkeypatch):
    """These prompts are short: let FA3 take every prefill chunk."""
    monkeypatch.setattr(triton_backend.TritonBackend, "FA3_MIN_MEAN_CHUNK", 1)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_auto_picks_triton_fa3_for_bf16(qwen3_dir):
    assert LLM(qwen3_dir, **OPTIONS).engine.executor.backend.name == "triton-fa3"


def test_fa3_prefill_logits_match_triton(qwen3_dir):
    plain, hybrid = LLM(qwen3_dir, attention_backend="triton", **OPTIONS), \
        LLM(qwen3_dir, attention_backend="triton-fa3", **OPTIONS)
    ids = plain.engine.tokenizer.encode(PROMPTS[1] * 4)
    for _ in range(2):  # the second time over the prefix cache: FA3 reads the cached blocks
        assert relative(prompt_logits(hybrid, ids), prompt_logits(plain, ids)) < REL_TOL


def test_mixed_steps_match_triton(qwen3_dir):
    """Chunked prefill (16 tokens a step) beside decoding rows: mixed steps through both kernels. The
    first greedy token of each prompt comes from a prefill that ran in chunks."""
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompts = [p * 3 for p in PROMPTS]
    outs = [[o["token_ids"][0] for o in LLM(qwen3_dir, attention_backend=name, max_num_batched_tokens=16,
                                              **OPTIONS).generate(prompts, params, use_tqdm=False)]
            for name in ("triton", "triton-fa3")]
    assert outs[0] == outs[1]
