"""Tensor parallelism for real, on the CPU: TP=2 runs rank 0 here and rank 1 in a spawned process,
talking over gloo. Greedy output must match TP=1 and transformers token for token (float32), with
prefix caching, chunked prefill and preemption; shutdown, garbage collection, Ctrl-C and a killed
worker must leave no process or shared memory behind, and never hang."""

import gc
import multiprocessing
import os
import signal
import threading
import time

import pytest
from conftest import MAX_TOKENS, PROMPTS, hf_greedy, make_model_dir

from nanovllm import LLM, SamplingParams
from nanovllm.distributed.worker import TPWorkers

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
# Spawned workers must be gone within this long, and a failure must surface within this long.
DEADLINE_S = 30


def tp_llm(path, tensor_parallel_size=2, **options):
    defaults = dict(kvcache_block_size=4, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=512)
    return LLM(path, tensor_parallel_size=tensor_parallel_size, **{**defaults, **options})


def token_ids(llm, prompts=PROMPTS):
    return [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def assert_released(channel_name: str, processes: list):
    assert not os.path.exists(f"/dev/shm/{channel_name}")
    for process in processes:
        assert process.exitcode is not None, f"worker {process.pid} still runs"
        assert not os.path.exists(f"/proc/{process.pid}"), f"worker {process.pid} was not reaped"
    assert not set(processes) & set(multiprocessing.active_children())


def assert_shut_down(workers: TPWorkers):
    assert workers.is_shut_down
    assert_released(workers.channel_name, workers.processes)


def within_deadline(fn):
    """Run fn in a thread; fail (instead of hanging the suite) if it takes longer than DEADLINE_S.
    Returns (result, exception, seconds)."""
    outcome: dict = {}

    def target():
        try:
            outcome["result"] = fn()
        except BaseException as e:  # noqa: B036 - handed back to the test
            outcome["error"] = e

    start = time.monotonic()
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(DEADLINE_S)
    assert not thread.is_alive(), f"still running after {DEADLINE_S}s: hung"
    return outcome.get("result"), outcome.get("error"), time.monotonic() - start


@pytest.fixture(scope="module")
def tp2(qwen3_dir):
    # 14 blocks of 4 tokens: every request fits alone, all four together do not (preemption).
    llm = tp_llm(qwen3_dir, num_kvcache_blocks=14)
    yield llm
    llm.exit()
    assert_shut_down(llm.engine.executor.workers)


@pytest.fixture(scope="module")
def odd_model(tmp_path_factory, tokenizer):
    """One K/V head for two ranks (replicated), an odd vocabulary (padded shards), tied embeddings."""
    path = str(tmp_path_factory.mktemp("qwen3_kv1"))
    hf = make_model_dir(path, tie=True, num_key_value_heads=1, vocab_size=401)
    hf.generation_config.eos_token_id = None
    return path, [hf_greedy(hf, tokenizer.encode(p), MAX_TOKENS) for p in PROMPTS]


def test_tp2_matches_tp1_and_transformers_with_preemption_and_prefix_cache(tp2, qwen3_dir, reference):
    tp1 = LLM(qwen3_dir, kvcache_block_size=4, max_model_len=256, num_kvcache_blocks=14)
    assert token_ids(tp1) == reference
    tp1.exit()
    scheduler = tp2.engine.scheduler
    preemptions = scheduler.num_preemptions
    assert token_ids(tp2) == reference
    assert scheduler.num_preemptions > preemptions
    hits = scheduler.block_manager.num_cache_hit_tokens
    assert token_ids(tp2) == reference
    assert scheduler.block_manager.num_cache_hit_tokens > hits


def test_tp2_a_request_with_bad_sampling_inputs_fails_alone(tp2, reference):
    poisoned = SamplingParams(temperature=0.5, max_tokens=4)
    bad = tp2.add_request(PROMPTS[0], poisoned)
    poisoned.temperature = 10**400  # bypasses __post_init__; float32 conversion overflows
    assert token_ids(tp2) == reference
    returned, _ = tp2.step()
    assert [i for i, _ in returned] == [bad] and returned[0][1]["finish_reason"] == "error"
    assert not tp2.engine.executor.workers.is_shut_down and tp2.is_finished()


def test_tp2_chunked_prefill_keeps_output(tp2, hf_qwen3, tokenizer):
    # Steps that sample nothing (the prompt only part-way computed) must keep the ranks in step too.
    prompt = "A paged KV cache admits requests while the fox decodes."
    expected = hf_greedy(hf_qwen3, tokenizer.encode(prompt), MAX_TOKENS)
    scheduler = tp2.engine.scheduler
    scheduler.max_num_batched_tokens, budget = 5, scheduler.max_num_batched_tokens
    try:
        (output,) = tp2.generate([prompt], GREEDY, use_tqdm=False)
    finally:
        scheduler.max_num_batched_tokens = budget
    assert output["num_cached_tokens"] == 0 and len(output["prompt_token_ids"]) > 10  # >= 2 chunks
    assert output["token_ids"] == expected


def test_replicated_kv_head_and_padded_vocab_and_two_engines_at_once(tp2, odd_model, reference):
    path, odd_reference = odd_model
    odd = tp_llm(path)
    assert odd.engine.executor.workers.channel_name != tp2.engine.executor.workers.channel_name
    assert token_ids(odd) == odd_reference
    # Both engines' steps interleave in this one process, each over its own group and channel.
    ids = {odd.add_request(PROMPTS[0], GREEDY): ("odd", 0), tp2.add_request(PROMPTS[0], GREEDY): ("tp2", 0),
           odd.add_request(PROMPTS[2], GREEDY): ("odd", 2), tp2.add_request(PROMPTS[2], GREEDY): ("tp2", 2)}
    results = {}
    while not (odd.is_finished() and tp2.is_finished()):
        for llm in (odd, tp2):
            if not llm.is_finished():
                results.update({ids[i]: out["token_ids"] for i, out in llm.step()[0]})
    assert results == {("odd", 0): odd_reference[0], ("odd", 2): odd_reference[2],
                       ("tp2", 0): reference[0], ("tp2", 2): reference[2]}
    odd.exit()
    assert_shut_down(odd.engine.executor.workers)
    with pytest.raises(RuntimeError, match="shut down"):
        odd.generate(PROMPTS[0], GREEDY, use_tqdm=False)
    assert token_ids(tp2, PROMPTS[:1]) == reference[:1]  # the other engine is untouched


def test_garbage_collection_releases_the_workers(qwen3_dir):
    llm = tp_llm(qwen3_dir)
    channel_name, processes = llm.engine.executor.workers.channel_name, llm.engine.executor.workers.processes
    assert os.path.exists(f"/dev/shm/{channel_name}") and all(p.is_alive() for p in processes)
    del llm
    gc.collect()
    assert_released(channel_name, processes)


def test_a_killed_worker_raises_instead_of_hanging(qwen3_dir, reference):
    with tp_llm(qwen3_dir) as llm:
        assert token_ids(llm, PROMPTS[:1]) == reference[:1]
        worker = llm.engine.executor.workers.processes[0]
        os.kill(worker.pid, signal.SIGKILL)
        _, error, seconds = within_deadline(lambda: llm.generate(PROMPTS, GREEDY, use_tqdm=False))
        assert isinstance(error, RuntimeError), error
        assert f"rank 1 (pid {worker.pid}) was killed by SIGKILL" in str(error)
        assert seconds < 10
        assert_shut_down(llm.engine.executor.workers)
        with pytest.raises(RuntimeError, match="shut down"):
            llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)


def test_a_worker_killed_mid_step_raises_instead_of_hanging(qwen3_dir):
    llm = tp_llm(qwen3_dir)
    worker, run = llm.engine.executor.workers.processes[0], llm.engine.executor.runner.run

    def killed_while_rank0_computes(batch):
        os.kill(worker.pid, signal.SIGKILL)  # the worker has the step; rank 0 meets no one in the all-reduce
        worker.join()
        return run(batch)

    llm.engine.executor.runner.run = killed_while_rank0_computes
    _, error, seconds = within_deadline(lambda: llm.generate(PROMPTS[0], GREEDY, use_tqdm=False))
    assert isinstance(error, RuntimeError) and "was killed by SIGKILL" in str(error), error
    assert seconds < 10
    assert_shut_down(llm.engine.executor.workers)


def test_ctrl_c_during_a_step_shuts_the_group_down(qwen3_dir):
    llm = tp_llm(qwen3_dir)

    def interrupted(batch):
        raise KeyboardInterrupt  # after the worker got the step: it now waits in a collective

    llm.engine.executor.runner.run = interrupted
    _, error, _ = within_deadline(lambda: llm.generate(PROMPTS[0], GREEDY, use_tqdm=False))
    assert isinstance(error, KeyboardInterrupt)
    assert_shut_down(llm.engine.executor.workers)
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)


def test_bad_tensor_parallel_sizes_raise_before_anything_starts(qwen3_dir, tmp_path):
    import json

    children = set(multiprocessing.active_children())
    for size, match in [(0, "positive integer"), (-1, "positive integer"), (3, r"valid sizes: \[1, 2, 4\]"),
                        (8, r"valid sizes: \[1, 2, 4\]")]:
        with pytest.raises(ValueError, match=match):
            tp_llm(qwen3_dir, tensor_parallel_size=size)
    with pytest.raises(ValueError, match="needs 2 GPUs but 0 are visible"):
        tp_llm(qwen3_dir, device="cuda")
    # 6 query heads split in 2, but 3 K/V heads neither split in 2 nor replicate evenly
    with open(f"{qwen3_dir}/config.json") as f:
        config = json.load(f)
    with open(tmp_path / "config.json", "w") as f:
        json.dump({**config, "num_attention_heads": 6, "num_key_value_heads": 3, "intermediate_size": 96}, f)
    with pytest.raises(ValueError, match="3 key/value heads.*valid sizes: \\[1, 3, 6\\]"):
        tp_llm(str(tmp_path), skip_tokenizer_init=True)
    assert set(multiprocessing.active_children()) == children


def test_tp4_matches_transformers(qwen3_dir, reference):
    """Four ranks over the tiny model's 4 query / 2 K/V heads: one query head per rank, each K/V head
    replicated on two ranks, the vocabulary split four ways (issue 6's correctness run, on CPU)."""
    with tp_llm(qwen3_dir, tensor_parallel_size=4) as llm:
        assert token_ids(llm) == reference


def test_group_users_are_released_before_the_communicator(monkeypatch):
    """CUDA graphs that captured NCCL collectives must go before the communicator (NCCL's shutdown
    waits for them); a failing release must not keep the communicator alive."""
    import torch

    from nanovllm.distributed.group import TPGroup, create_store

    group = TPGroup(create_store(0, 1), 0, 1, torch.device("cpu"))
    backend = group._backend
    events = []
    monkeypatch.setattr(type(backend), "shutdown", lambda self: events.append("communicator"), raising=False)

    def failing_release():
        events.append("failing user")
        raise RuntimeError("boom")

    group.before_destroy(lambda: events.append("graphs"))
    group.before_destroy(failing_release)
    group.destroy()
    assert events == ["graphs", "failing user", "communicator"]


def test_tp2_logprobs_prompt_logprobs_and_penalties(tp2, hf_qwen3, tokenizer):
    """Prompt logprobs need the LM head on every rank (its gather is collective), over chunks too."""
    from test_logprobs import check_against_hf
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2, prompt_logprobs=2,
                            repetition_penalty=1.2)
    scheduler = tp2.engine.scheduler
    scheduler.max_num_batched_tokens, budget = 5, scheduler.max_num_batched_tokens
    try:
        outputs = tp2.generate(PROMPTS[:2], params, use_tqdm=False)
    finally:
        scheduler.max_num_batched_tokens = budget
    for out in outputs:
        check_against_hf(hf_qwen3, out, 2, 2)
