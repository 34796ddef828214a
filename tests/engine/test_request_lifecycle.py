"""The request lifecycle on a real (tiny) engine: abort in every state frees the KV blocks, no output
is dropped or handed to the wrong caller, abandoned calls abort their work, one failing request is
failed alone, and one LLM driven from several threads gives each caller its single-thread output."""

import threading

import pytest
from conftest import PROMPTS

from nanovllm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    return LLM(qwen3_dir, kvcache_block_size=4, max_model_len=128, max_num_seqs=8,
               max_num_batched_tokens=64, num_kvcache_blocks=48)


def run_threads(worker, count: int) -> None:
    """Run worker(0..count-1) in threads at once; re-raise the first error any of them met."""
    errors = []

    def guarded(i: int) -> None:
        try:
            worker(i)
        except BaseException as e:  # noqa: BLE001 - reported by the calling thread
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def assert_idle(llm):
    assert llm.engine.scheduler.is_finished()
    bm = llm.engine.scheduler.block_manager
    assert bm.num_free_blocks == len(bm.blocks)
    assert all(block.ref_count == 0 for block in bm.blocks)
    assert not llm.engine._requests.live and not llm.engine._requests.done


@pytest.fixture(scope="module")
def expected(llm):
    return [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_add_request_output_is_kept_for_step_while_generate_runs(llm, expected):
    a = llm.add_request(PROMPTS[0], GREEDY)
    outputs = llm.generate(PROMPTS[1:3], GREEDY, use_tqdm=False)
    assert [o["token_ids"] for o in outputs] == expected[1:3]  # only its own requests
    assert not llm.is_finished()  # A's output waits for step()
    returned, num_tokens = llm.step()
    assert num_tokens == 0 and [i for i, _ in returned] == [a]
    assert returned[0][1]["token_ids"] == expected[0]
    assert llm.is_finished() and llm.step() == ([], 0)
    assert_idle(llm)


@pytest.mark.parametrize("state", ["waiting", "prefilling", "decoding", "preempted"])
def test_abort_frees_blocks_in_every_state(llm, state):
    long_prompt = list(range(1, 100))  # 99 tokens: two 64-token prefill chunks
    seq_id = llm.add_request(long_prompt, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    (seq,) = llm.engine._requests.live[seq_id]
    if state == "prefilling":
        llm.step()
        assert 0 < seq.num_computed_tokens < len(long_prompt) and seq.block_table
    elif state == "decoding":
        llm.step(), llm.step(), llm.step()
        assert seq.num_completion_tokens >= 1 and seq.block_table
    elif state == "preempted":
        llm.step()
        llm.engine.scheduler._preempt(llm.engine.scheduler.running.pop())
        assert seq in llm.engine.scheduler.waiting and seq.num_preemptions == 1
    assert llm.abort_request(seq_id) is True
    assert seq.finish_reason == "abort"
    assert llm.abort_request(seq_id) is False  # finished: a no-op
    assert llm.abort_request(10**9) is False  # unknown: a no-op
    assert llm.is_finished() and llm.step() == ([], 0)  # an aborted add_request is not returned
    assert_idle(llm)


def interrupt_at_step(llm, monkeypatch, n: int) -> None:
    """Make the engine's n-th step from now raise KeyboardInterrupt (Ctrl-C) instead of running."""
    calls = []
    real_step = llm.engine.step

    def step_then_interrupt():
        calls.append(1)
        if len(calls) == n:
            raise KeyboardInterrupt
        return real_step()

    monkeypatch.setattr(llm.engine, "step", step_then_interrupt)


def test_exception_inside_generate_aborts_its_requests(llm, monkeypatch):
    interrupt_at_step(llm, monkeypatch, 2)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert_idle(llm)


def test_stream_closed_early_aborts_its_request(llm):
    stream = llm.stream(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    next(stream)
    stream.close()
    assert_idle(llm)


def test_a_failing_request_is_failed_alone(llm, expected):
    poisoned = SamplingParams(temperature=0.5, max_tokens=12)
    bad = llm.add_request(PROMPTS[0], poisoned)
    poisoned.temperature = 10**400  # bypasses __post_init__; float32 conversion overflows in the step
    outputs = llm.generate(PROMPTS[1:], GREEDY, use_tqdm=False)
    assert [o["token_ids"] for o in outputs] == expected[1:]
    returned, _ = llm.step()
    assert [i for i, _ in returned] == [bad]
    assert returned[0][1]["finish_reason"] == "error" and "OverflowError" in returned[0][1]["error"]
    assert llm.is_finished()
    assert_idle(llm)


def test_one_llm_from_several_threads_matches_single_thread(llm, expected):
    results: dict[int, list] = {}

    def worker(i):
        if i % 2:
            results[i] = [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        else:
            results[i] = "".join(llm.stream(PROMPTS[i % len(PROMPTS)], GREEDY))

    run_threads(worker, 4)
    texts = [o["text"] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    for i, result in results.items():
        assert result == (expected if i % 2 else texts[i % len(PROMPTS)])
    assert_idle(llm)


# ---- requests of n completions (SamplingParams.n) ----

def test_abort_of_an_n_request_aborts_every_completion(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=30, ignore_eos=True)
    request_id = llm.add_request(PROMPTS[2], params)
    seqs = llm.engine._requests.live[request_id]
    while not all(seq.num_completion_tokens for seq in seqs):  # every completion is decoding
        llm.step()
    assert llm.abort_request(seqs[1].seq_id) is False  # a completion's own id is not a request id
    assert llm.abort_request(request_id) is True
    assert [seq.finish_reason for seq in seqs] == ["abort"] * 3
    assert llm.is_finished() and llm.step() == ([], 0)
    assert_idle(llm)


def test_an_n_request_left_by_an_exception_is_aborted_whole(llm, monkeypatch):
    interrupt_at_step(llm, monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS[:2], SamplingParams(n=2, max_tokens=20, ignore_eos=True), use_tqdm=False)
    monkeypatch.undo()
    assert_idle(llm)


def test_a_failing_n_request_fails_with_all_its_completions(llm, expected):
    poisoned = SamplingParams(n=2, temperature=0.5, max_tokens=12)
    bad = llm.add_request(PROMPTS[0], poisoned)
    poisoned.temperature = 10**400  # bypasses validate(); float32 conversion overflows in the step
    outputs = llm.generate(PROMPTS[1:], GREEDY, use_tqdm=False)
    assert [o["token_ids"] for o in outputs] == expected[1:]
    returned, _ = llm.step()
    assert [i for i, _ in returned] == [bad]
    output = returned[0][1]
    assert [c["finish_reason"] for c in output["outputs"]] == ["error", "error"]
    assert "OverflowError" in output["error"]
    assert_idle(llm)


def test_stream_refuses_n_and_no_detokenize(llm):
    with pytest.raises(ValueError, match="n=2"):
        llm.stream(PROMPTS[0], SamplingParams(n=2))
    with pytest.raises(ValueError, match="detokenize=False"):
        llm.stream(PROMPTS[0], SamplingParams(detokenize=False))
    assert_idle(llm)


def test_stream_with_logprobs_and_penalties_matches_generate(llm):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2,
                            repetition_penalty=1.3, stop=["e t"])
    (output,) = llm.generate(PROMPTS[3], params, use_tqdm=False)
    assert "".join(llm.stream(PROMPTS[3], params)) == output["text"]
    assert len(output["logprobs"]) == len(output["token_ids"])
    assert_idle(llm)


def test_two_llms_in_two_threads_never_see_each_others_batches(qwen3_dir, expected):
    """Per-step state is per engine (the attention metadata is an argument of forward, the TP group a
    ContextVar): two engines stepping at once in two threads each give their single-engine output, over
    many rounds (the interleaving differs every time)."""
    engines = [LLM(qwen3_dir, kvcache_block_size=4, max_model_len=128, max_num_seqs=8) for _ in range(2)]
    results: dict[tuple[int, int], list] = {}

    def worker(index: int) -> None:
        for round_ in range(3):
            reverse = (index + round_) % 2 == 0  # the batches differ between the engines and rounds
            prompts = PROMPTS[::-1] if reverse else PROMPTS
            token_ids = [o["token_ids"] for o in engines[index].generate(prompts, GREEDY, use_tqdm=False)]
            results[index, round_] = token_ids[::-1] if reverse else token_ids

    run_threads(worker, 2)
    assert len(results) == 6 and all(result == expected for result in results.values())
