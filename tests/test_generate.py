"""End-to-end greedy output against transformers (float32, CPU), and the features that must not
change it: prefix caching, chunked prefill, preemption, requests arriving mid-run."""

import pytest
import torch
from conftest import MAX_TOKENS, PROMPTS, hf_greedy, make_model_dir

from nanovllm import LLM, SamplingParams
from nanovllm.llm import prompt_logits

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def small_llm(path, **options):
    defaults = dict(kvcache_block_size=4, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=512)
    return LLM(path, **{**defaults, **options})


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    return small_llm(qwen3_dir)


def test_greedy_matches_transformers_for_strings(llm, reference):
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o["token_ids"] for o in outputs] == reference
    assert all(o["finish_reason"] == "length" for o in outputs)


def test_greedy_matches_transformers_for_token_ids(llm, tokenizer, reference):
    outputs = llm.generate([tokenizer.encode(p) for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [o["token_ids"] for o in outputs] == reference
    assert outputs[0]["text"] == tokenizer.decode(reference[0], skip_special_tokens=True)


def test_single_prompt_and_single_token_id_list(llm, tokenizer, reference):
    assert llm.generate(PROMPTS[1], GREEDY, use_tqdm=False)[0]["token_ids"] == reference[1]
    assert llm.generate(tokenizer.encode(PROMPTS[1]), GREEDY, use_tqdm=False)[0]["token_ids"] == reference[1]


def test_logits_match_transformers(llm, hf_qwen3, tokenizer):
    ids = tokenizer.encode(PROMPTS[1])
    with torch.no_grad():
        ref = hf_qwen3(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(prompt_logits(llm, ids), ref, atol=1e-4, rtol=1e-4)


def test_prefix_cache_hits_reuse_blocks_and_keep_output(qwen3_dir, reference):
    llm = small_llm(qwen3_dir)
    first = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    bm = llm.engine.scheduler.block_manager
    hits_before = bm.num_cache_hit_tokens
    second = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o["token_ids"] for o in first] == [o["token_ids"] for o in second] == reference
    # every prompt but the 1-token one has full blocks that the second run found in the cache
    assert bm.num_cache_hit_tokens - hits_before >= sum((len(o["prompt_token_ids"]) - 1) // 4 * 4
                                                        for o in second)
    assert [o["num_cached_tokens"] for o in second][1] > 0


def test_chunked_prefill_keeps_output(qwen3_dir, reference):
    llm = small_llm(qwen3_dir, max_num_batched_tokens=5, enable_prefix_caching=False)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o["token_ids"] for o in outputs] == reference


def test_preemption_keeps_output(qwen3_dir, tokenizer, reference):
    # Every request alone fits in 14 blocks of 4 tokens, but all four together do not.
    llm = small_llm(qwen3_dir, num_kvcache_blocks=14)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o["token_ids"] for o in outputs] == reference
    assert llm.engine.scheduler.block_manager.num_free_blocks == 14


def test_requests_arriving_while_others_run(qwen3_dir, reference):
    llm = small_llm(qwen3_dir)
    ids = {llm.add_request(PROMPTS[0], GREEDY): 0}
    results, steps = {}, 0
    while not llm.is_finished() or len(ids) < len(PROMPTS):
        if steps in (2, 5, 9) and len(ids) < len(PROMPTS):
            ids[llm.add_request(PROMPTS[len(ids)], GREEDY)] = len(ids)
        finished, _ = llm.step()
        for seq_id, output in finished:
            results[ids[seq_id]] = output["token_ids"]
        steps += 1
        if llm.is_finished() and len(ids) < len(PROMPTS):
            ids[llm.add_request(PROMPTS[len(ids)], GREEDY)] = len(ids)
    assert [results[i] for i in range(len(PROMPTS))] == reference


def test_tied_embeddings_and_sharded_checkpoint(tmp_path, tokenizer):
    hf = make_model_dir(str(tmp_path), tie=True, shard=True)
    assert (tmp_path / "model.safetensors.index.json").exists()
    hf.generation_config.eos_token_id = None
    llm = small_llm(str(tmp_path))
    outputs = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    assert [o["token_ids"] for o in outputs] == [hf_greedy(hf, tokenizer.encode(p), MAX_TOKENS)
                                                  for p in PROMPTS[:2]]
