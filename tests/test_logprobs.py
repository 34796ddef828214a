"""logprobs and prompt_logprobs against log_softmax of transformers' logits on the same tokens
(float32, CPU), through prefix-cache hits, chunked prefill and preemption; n > 1 completions."""

import pytest
import torch
from conftest import PROMPTS

from nanovllm import LLM, SamplingParams

TOL = 1e-4
K = 3


# Tiny models run fastest on one thread (conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


def small_llm(path, **options):
    defaults = dict(kvcache_block_size=4, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=512)
    return LLM(path, **{**defaults, **options})


def hf_logprobs(hf, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([token_ids])).logits[0].float(), dim=-1)


def check_against_hf(hf, out, k_prompt: int | None, k: int | None) -> None:
    prompt, completion = out["prompt_token_ids"], out["token_ids"]
    ref = hf_logprobs(hf, prompt + completion)  # ref[q] predicts token q + 1

    def check(entry: dict, position: int, token: int, num_top: int) -> None:
        assert token in entry and abs(entry[token] - ref[position, token].item()) < TOL
        top = ref[position].topk(num_top)
        for lp, tok in zip(top.values.tolist(), top.indices.tolist()):
            assert abs(entry[tok] - lp) < TOL
        assert len(entry) in (num_top, num_top + 1)

    if k_prompt is None:
        assert out["prompt_logprobs"] is None
    else:
        assert len(out["prompt_logprobs"]) == len(prompt) and out["prompt_logprobs"][0] is None
        for p in range(1, len(prompt)):
            check(out["prompt_logprobs"][p], p - 1, prompt[p], k_prompt)
    if k is None:
        assert out["logprobs"] is None and out["cumulative_logprob"] is None
    else:
        assert len(out["logprobs"]) == len(completion)
        for j, token in enumerate(completion):
            check(out["logprobs"][j], len(prompt) - 1 + j, token, k)
        expected = sum(ref[len(prompt) - 1 + j, t].item() for j, t in enumerate(completion))
        assert abs(out["cumulative_logprob"] - expected) < 1e-3


PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=K, prompt_logprobs=2)


def test_logprobs_and_prompt_logprobs_match_transformers(qwen3_dir, hf_qwen3):
    llm = small_llm(qwen3_dir)
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True, logprobs=0)
    outputs = llm.generate(PROMPTS, [PARAMS, PARAMS, sampled, PARAMS], use_tqdm=False)
    for out, params in zip(outputs, [PARAMS, PARAMS, sampled, PARAMS]):
        check_against_hf(hf_qwen3, out, params.prompt_logprobs, params.logprobs)
    # raw model logprobs: a penalty changes the sampled tokens, not how their logprobs are computed
    penalized = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=K,
                               repetition_penalty=1.5)
    check_against_hf(hf_qwen3, llm.generate(PROMPTS[1], penalized, use_tqdm=False)[0], None, K)


def test_prompt_logprobs_skip_the_prefix_cache_and_logprobs_use_it(qwen3_dir, hf_qwen3):
    llm = small_llm(qwen3_dir)
    plain = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm.generate(PROMPTS[1], plain, use_tqdm=False)  # fills the prefix cache
    with_prompt = llm.generate(PROMPTS[1], PARAMS, use_tqdm=False)[0]
    assert with_prompt["num_cached_tokens"] == 0
    check_against_hf(hf_qwen3, with_prompt, 2, K)
    only_sampled = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=K)
    hit = llm.generate(PROMPTS[1], only_sampled, use_tqdm=False)[0]
    assert hit["num_cached_tokens"] > 0
    check_against_hf(hf_qwen3, hit, None, K)


def test_logprobs_through_chunked_prefill(qwen3_dir, hf_qwen3):
    llm = small_llm(qwen3_dir, max_num_batched_tokens=5)
    for out in llm.generate(PROMPTS, PARAMS, use_tqdm=False):
        check_against_hf(hf_qwen3, out, 2, K)


def test_logprobs_through_preemption(qwen3_dir, hf_qwen3):
    llm = small_llm(qwen3_dir, num_kvcache_blocks=14)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=K, prompt_logprobs=2)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    for out in outputs:
        check_against_hf(hf_qwen3, out, 2, K)


def test_prompt_logprobs_are_computed_in_bounded_chunks(qwen3_dir, hf_qwen3, monkeypatch):
    import nanovllm.layers.logprobs as logprobs_module
    monkeypatch.setattr(logprobs_module, "PROMPT_LOGPROBS_CHUNK", 3)
    llm = small_llm(qwen3_dir)
    rows = []
    compute_logits = llm.engine.executor.model.compute_logits
    monkeypatch.setattr(llm.engine.executor.model, "compute_logits",
                        lambda h: rows.append(h.shape[0]) or compute_logits(h))
    for out in llm.generate(PROMPTS[:2], PARAMS, use_tqdm=False):  # chunks span both prompts
        check_against_hf(hf_qwen3, out, 2, K)
    assert max(rows) == 3  # the sampling calls have 2 rows


# ---- n > 1 ----

def test_n_completions_share_prompt_blocks_and_differ_when_sampled(qwen3_dir):
    llm = small_llm(qwen3_dir)
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=12, ignore_eos=True, logprobs=1)
    bm = llm.engine.scheduler.block_manager
    tables = []
    take = bm.allocate

    def spy(seq):
        take(seq)
        tables.append(list(seq.block_table))
    bm.allocate = spy
    out = llm.generate(PROMPTS[1], params, use_tqdm=False)[0]
    bm.allocate = take
    completions = out["outputs"]
    assert [c["index"] for c in completions] == [0, 1, 2, 3]
    assert out["token_ids"] == completions[0]["token_ids"] and out["text"] == completions[0]["text"]
    assert len({tuple(c["token_ids"]) for c in completions}) == 4  # distinct samples
    num_full = (len(out["prompt_token_ids"]) - 1) // 4
    assert num_full > 0 and all(t[:num_full] == tables[0][:num_full] for t in tables)  # shared KV blocks
    assert all(len(c["logprobs"]) == 12 for c in completions)
    again = llm.generate(PROMPTS[1], params, use_tqdm=False)[0]  # seed + index: reproducible
    assert [c["token_ids"] for c in again["outputs"]] == [c["token_ids"] for c in completions]


def test_n_completions_identical_when_greedy(qwen3_dir):
    llm = small_llm(qwen3_dir)
    outs = llm.generate(PROMPTS, SamplingParams(n=3, temperature=0.0, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)
    single = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                          use_tqdm=False)
    for out, one in zip(outs, single):
        assert [c["token_ids"] for c in out["outputs"]] == [one["token_ids"]] * 3


@pytest.mark.parametrize("prompt_logprobs", [None, 1])
def test_n_with_add_request_and_step(qwen3_dir, prompt_logprobs):
    llm = small_llm(qwen3_dir)
    params = SamplingParams(n=2, max_tokens=4, prompt_logprobs=prompt_logprobs)
    request_id = llm.add_request(PROMPTS[0], params)
    results = {}
    while not llm.is_finished():
        for rid, output in llm.step()[0]:
            results[rid] = output
    assert list(results) == [request_id] and len(results[request_id]["outputs"]) == 2
    assert (results[request_id]["prompt_logprobs"] is None) == (prompt_logprobs is None)


def test_warmup_sampling_batch_runs_every_costly_option(qwen3_dir):
    """The GPU warm-up measures sampling's memory peak with this batch: it must run (CPU here)."""
    from nanovllm.runner.sampling import worst_case_sampling
    llm = small_llm(qwen3_dir)
    runner = llm.engine.executor
    logits = runner.model.compute_logits(torch.randn(4, runner.config.hf_config.hidden_size))
    out = runner.sampler(logits, worst_case_sampling(4))
    assert all(t in (0, 1) for t in out.token_ids) and all(len(lp) >= 20 for lp in out.logprobs)


def test_n_without_prefix_caching(qwen3_dir):
    llm = small_llm(qwen3_dir, enable_prefix_caching=False)
    params = SamplingParams(n=3, temperature=0.0, max_tokens=6, ignore_eos=True)
    out = llm.generate(PROMPTS[1], params, use_tqdm=False)[0]
    assert len({tuple(c["token_ids"]) for c in out["outputs"]}) == 1 and len(out["outputs"]) == 3
