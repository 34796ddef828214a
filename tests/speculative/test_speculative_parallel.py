"""Speculative decoding under tensor parallelism, for real on the CPU (TP=2 over gloo): every rank
computes the logits of every verified position (the LM head gathers across ranks), rank 0 samples and
verifies; greedy output is TP=1's without speculation, token for token. And with two data-parallel
replicas, whose counters add up."""

from conftest import PROMPTS

from nanovllm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
# float32 on a GPU too, where the engine's default is bfloat16 (greedy tokens equal only in float32)
OPTIONS = dict(kvcache_block_size=4, max_model_len=256, max_num_seqs=8,
               max_num_batched_tokens=512, dtype="float32")
REPEATING = ["hello world hello world hello world hello", "Paris is the capital of France. Paris is the",
             *PROMPTS]


def test_tp2_greedy_matches_tp1_without_speculation(qwen3_dir):
    expected = [o["token_ids"] for o in LLM(qwen3_dir, **OPTIONS).generate(REPEATING, GREEDY, use_tqdm=False)]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    llm = LLM(qwen3_dir, tensor_parallel_size=2, speculative_config=spec, **OPTIONS)
    try:
        outputs = llm.generate(REPEATING, GREEDY, use_tqdm=False)
        assert [o["token_ids"] for o in outputs] == expected
        assert llm.engine.stats().spec_decode.num_accepted_tokens > 0
    finally:
        llm.shutdown()


def test_data_parallel_replicas_speculate_and_sum_their_counters(qwen3_dir):
    expected = LLM(qwen3_dir, **OPTIONS).generate(REPEATING * 2, GREEDY, use_tqdm=False)
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
    llm = LLM(qwen3_dir, data_parallel_size=2, speculative_config=spec, **OPTIONS)
    try:
        outputs = llm.generate(REPEATING * 2, GREEDY, use_tqdm=False)
        assert [o["token_ids"] for o in outputs] == [o["token_ids"] for o in expected]
        stats = llm.engine.stats().spec_decode
        assert stats.num_draft_tokens == sum(o.metrics.num_draft_tokens for o in outputs) > 0
        assert stats.num_accepted_tokens == sum(stats.num_accepted_tokens_per_pos)
    finally:
        llm.shutdown()
