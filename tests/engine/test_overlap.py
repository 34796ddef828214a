"""Overlap scheduling end to end on the tiny model (CPU): every output is the synchronous loop's, token
for token (greedy and seeded), through requests finishing at different steps, stop ids and strings,
EOS, n > 1, preemption, chunked prefill, both batching policies, aborts mid-run, logprobs, logits
processors and failing requests; one host sync per engine step; the decode graphs' static buffers
take the previous step's tokens on the device."""

import pytest
import torch
from conftest import PROMPTS

from nanovllm import LLM, SamplingParams, StructuredOutputsParams
from nanovllm.config import ENV_DEFAULTS, Config
from nanovllm.engine.sequence import PENDING_TOKEN_ID
from nanovllm.runner.cuda_graph import DecodeGraphs
from nanovllm.runner.transfers import DeferredOutput, PendingOutput

pytestmark = pytest.mark.usefixtures("one_thread")

# float32 on a GPU too, where the engine's default is bfloat16 (greedy tokens equal only in float32)
OPTIONS = dict(kvcache_block_size=4, max_model_len=256, max_num_seqs=8,
               max_num_batched_tokens=512, dtype="float32")
LENGTHS = (5, 17, 1, 9)  # sequences finish at different steps


def greedy(max_tokens: int, **extra) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **extra)


def pair(path: str, **options) -> tuple[LLM, LLM]:
    """The same engine twice: synchronous, then overlapped."""
    options = {**OPTIONS, **options}
    return LLM(path, async_scheduling=False, **options), LLM(path, async_scheduling=True, **options)


@pytest.fixture(scope="module")
def engines(qwen3_dir):
    return pair(qwen3_dir)


def completions(outputs) -> list:
    keys = ("token_ids", "text", "finish_reason", "stop_reason")
    return [[{k: c[k] for k in keys} for c in o["outputs"]] for o in outputs]


def generate_both(engines, prompts, params) -> list:
    """Both engines' outputs, which must agree; returns the synchronous one's."""
    sync, overlapped = (llm.generate(prompts, params, use_tqdm=False) for llm in engines)
    assert completions(overlapped) == completions(sync)
    for llm in engines:
        assert_idle(llm)
    return sync


def assert_idle(llm: LLM) -> None:
    engine = llm.engine
    assert engine.scheduler.is_finished() and (engine._overlap is None or engine._overlap.in_flight is None)
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == len(bm.blocks)


def test_default_is_on_for_cuda_off_for_cpu_and_tensor_parallel(qwen3_dir, monkeypatch):
    monkeypatch.delenv(ENV_DEFAULTS["async_scheduling"], raising=False)
    assert Config(qwen3_dir, device="cpu").async_scheduling is False
    assert Config(qwen3_dir, device="cpu", async_scheduling=True).async_scheduling is True
    tensor_parallel = Config(qwen3_dir, device="cpu", async_scheduling=True, tensor_parallel_size=2)
    assert tensor_parallel.async_scheduling is False
    monkeypatch.setenv(ENV_DEFAULTS["async_scheduling"], "1")
    assert Config(qwen3_dir, device="cpu").async_scheduling is True
    with pytest.raises(TypeError, match="async_scheduling must be bool or None"):
        Config(qwen3_dir, device="cpu", async_scheduling="yes")
    monkeypatch.delenv(ENV_DEFAULTS["async_scheduling"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a Config only, no CUDA call
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert Config(qwen3_dir, device="cuda", max_num_seqs=8).async_scheduling is True


def test_greedy_with_requests_finishing_at_different_steps(engines):
    outputs = generate_both(engines, PROMPTS, [greedy(n) for n in LENGTHS])
    assert [len(o["token_ids"]) for o in outputs] == list(LENGTHS)


def test_stop_token_ids_stop_strings_and_eos(engines, tokenizer):
    reference = generate_both(engines, PROMPTS, greedy(12))
    tokens = [o["token_ids"] for o in reference]
    params = [greedy(12, stop_token_ids=[tokens[0][3]]),
              SamplingParams(temperature=0.0, max_tokens=12, stop=[tokenizer.decode(tokens[1][4:6])]),
              greedy(12, stop_token_ids=[tokens[2][0]]),  # stops at its first token
              SamplingParams(temperature=0.0, max_tokens=12)]
    outputs = generate_both(engines, PROMPTS, params)
    assert [o["finish_reason"] for o in outputs[:3]] == ["stop"] * 3
    assert len(outputs[0]["token_ids"]) <= 4 and len(outputs[2]["token_ids"]) == 1
    # EOS: make a token the greedy output reaches its end token, on both engines.
    for llm in engines:
        llm.engine.scheduler.stop_checker.eos_token_ids.add(tokens[3][5])
    try:
        outputs = generate_both(engines, PROMPTS, SamplingParams(temperature=0.0, max_tokens=12))
    finally:
        for llm in engines:
            llm.engine.scheduler.stop_checker.eos_token_ids.discard(tokens[3][5])
    assert outputs[3]["finish_reason"] == "stop" and len(outputs[3]["token_ids"]) <= 6


def test_n_completions_greedy_and_seeded_sampling(engines):
    params = [SamplingParams(n=3, temperature=0.8, top_p=0.9, seed=11, max_tokens=10, ignore_eos=True),
              SamplingParams(n=2, temperature=0.0, max_tokens=7, ignore_eos=True),
              SamplingParams(temperature=1.0, top_k=20, seed=3, max_tokens=13, ignore_eos=True),
              greedy(4)]
    outputs = generate_both(engines, PROMPTS, params)
    assert len({tuple(c["token_ids"]) for c in outputs[0]["outputs"]}) > 1  # the seeds differ


def test_preemption(qwen3_dir):
    # Every request alone fits in 14 blocks of 4 tokens, but all four together do not.
    engines = pair(qwen3_dir, num_kvcache_blocks=14)
    generate_both(engines, PROMPTS, [greedy(n) for n in (24, 20, 24, 16)])
    assert engines[1].engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_chunked_prefill(qwen3_dir, prefix_caching):
    engines = pair(qwen3_dir, max_num_batched_tokens=5, enable_prefix_caching=prefix_caching)
    generate_both(engines, PROMPTS + PROMPTS[:2], [greedy(n) for n in LENGTHS + (3, 8)])


def test_prefill_first_batches(qwen3_dir):
    engines = pair(qwen3_dir, mixed_batches=False, max_num_batched_tokens=16)
    generate_both(engines, PROMPTS, [greedy(n) for n in LENGTHS])


def test_logprobs_and_prompt_logprobs(engines):
    params = [greedy(6, logprobs=3), greedy(9, prompt_logprobs=2, logprobs=0), greedy(4),
              greedy(7, logprobs=5)]
    sync, overlapped = (llm.generate(PROMPTS, params, use_tqdm=False) for llm in engines)
    assert completions(overlapped) == completions(sync)
    for a, b in zip(sync, overlapped, strict=True):
        assert (a["logprobs"] is None) == (b["logprobs"] is None)
        for x, y in zip(a["logprobs"] or [], b["logprobs"] or [], strict=True):
            assert x.keys() == y.keys() and list(x.values()) == pytest.approx(list(y.values()), abs=1e-5)
        assert (a["prompt_logprobs"] is None) == (b["prompt_logprobs"] is None)
        for x, y in zip(a["prompt_logprobs"] or [], b["prompt_logprobs"] or [], strict=True):
            assert (x is None and y is None) or list(x.values()) == pytest.approx(list(y.values()), abs=1e-5)
    assert len(overlapped[1]["prompt_logprobs"]) == len(overlapped[1]["prompt_token_ids"])


def test_logits_processors_match_the_synchronous_loop(engines):
    """Penalties and bad words take the synchronous step (their processors read the tokens' values);
    min_tokens and logit_bias rows stay overlapped."""
    params = [greedy(10, repetition_penalty=1.5), greedy(12, min_tokens=6, logit_bias={5: 3.0}),
              greedy(8), greedy(9, bad_words=["the"], presence_penalty=0.5)]
    generate_both(engines, PROMPTS, params)
    generate_both(engines, PROMPTS, [greedy(12, min_tokens=6, logit_bias={5: 3.0}), greedy(8),
                                     greedy(10, allowed_token_ids=list(range(40, 90))), greedy(5)])


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "seeded"])
def test_structured_outputs_sample_once_the_previous_step_is_in(engines, monkeypatch, temperature):
    """A constrained row's step is launched before the previous step's tokens arrive; only its sampling
    (the bitmask, from matchers that have taken those tokens) waits for them. Output: the synchronous
    loop's, with a choice ending early while the others go on (its matcher done mid-flight)."""
    pytest.importorskip("xgrammar")
    deferred, real = [], DeferredOutput.sample
    monkeypatch.setattr(DeferredOutput, "sample", lambda self: deferred.append(1) or real(self))

    def held(max_tokens: int, **constraint) -> SamplingParams:
        return SamplingParams(temperature=temperature, seed=3, max_tokens=max_tokens, ignore_eos=True,
                              structured_outputs=StructuredOutputsParams(**constraint))

    params = [held(12, regex="[ab]+ [cd]+"), greedy(9), held(14, choice=["yes", "no", "maybe so"]),
              greedy(16)]
    outputs = generate_both(engines, PROMPTS, params)
    assert outputs[2]["text"] in ("yes", "no", "maybe so")
    assert deferred


@pytest.mark.parametrize("arriving", [dict(prompt_logprobs=2), dict(repetition_penalty=1.5)],
                         ids=["prompt-logprobs", "penalty"])
def test_a_constrained_row_beside_a_step_that_waits_for_its_tokens(engines, arriving):
    """A request whose next step needs this step's tokens on the host (prompt logprobs, a penalty)
    arrives while a constrained row decodes: the step that admits it still samples the constrained row
    only once the previous step's token is in its matcher."""
    pytest.importorskip("xgrammar")
    constrained = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True,
                                 structured_outputs=StructuredOutputsParams(regex="[ab]+ [cd]+ [ab]+"))
    outputs = []
    for llm in engines:
        first, results = llm.add_request(PROMPTS[1], constrained), {}
        for _ in range(3):
            results.update(llm.step()[0])
        second = llm.add_request(PROMPTS[2], greedy(6, **arriving))
        while not llm.is_finished():
            results.update(llm.step()[0])
        outputs.append((results[first]["text"], results[second]["token_ids"]))
        assert_idle(llm)
    assert outputs[1] == outputs[0]


def test_abort_mid_run(engines):
    expected = [o["token_ids"] for o in engines[0].generate(PROMPTS, greedy(16), use_tqdm=False)]
    llm = engines[1]
    ids = [llm.add_request(p, greedy(16)) for p in PROMPTS]
    for _ in range(4):
        llm.step()
    (victim,) = llm.engine._requests.live[ids[1]]
    assert any(seq is victim for seq in llm.engine._overlap.in_flight.seqs)  # aborted in flight
    assert llm.abort_request(ids[1]) is True
    assert PENDING_TOKEN_ID not in victim.token_ids
    assert victim.completion_token_ids == expected[1][:victim.num_completion_tokens]
    results = {}
    while not llm.is_finished():
        results.update(llm.step()[0])
    assert sorted(results) == [ids[0], ids[2], ids[3]]
    assert [results[ids[i]]["token_ids"] for i in (0, 2, 3)] == [expected[i] for i in (0, 2, 3)]
    assert_idle(llm)
    # Aborting the last request in flight leaves the engine idle at once.
    request_id = llm.add_request(PROMPTS[0], greedy(16))
    llm.step(), llm.step()
    assert llm.engine._overlap.in_flight is not None and llm.abort_request(request_id)
    assert_idle(llm)


def test_requests_arriving_while_others_run(engines):
    outputs = []
    for llm in engines:
        ids, results, steps = {llm.add_request(PROMPTS[0], greedy(12)): 0}, {}, 0
        while not llm.is_finished() or len(ids) < len(PROMPTS):
            if steps in (1, 2, 5) and len(ids) < len(PROMPTS):
                ids[llm.add_request(PROMPTS[len(ids)], greedy(LENGTHS[len(ids)]))] = len(ids)
            results.update({ids[i]: o["token_ids"] for i, o in llm.step()[0]})
            steps += 1
        outputs.append(results)
    assert outputs[0] == outputs[1] and len(outputs[0]) == len(PROMPTS)


def test_one_host_sync_per_engine_step(engines, monkeypatch):
    waits, real_wait = [], PendingOutput.wait
    monkeypatch.setattr(PendingOutput, "wait", lambda self: waits.append(1) or real_wait(self))
    engine = engines[1].engine
    params = [greedy(n, logprobs=2 if n > 5 else None) for n in LENGTHS]
    ids = [engine.add_request(p, sp) for p, sp in zip(PROMPTS, params, strict=True)]
    per_step = []
    while not engine.is_finished():
        before = len(waits)
        engine.step()
        per_step.append(len(waits) - before)
    assert per_step[0] == 0 and set(per_step[1:]) == {1}  # the first step is only launched
    outputs = dict(engine.take_outputs(set(ids)))
    assert [len(outputs[i]["token_ids"]) for i in ids] == list(LENGTHS)


def test_no_forward_pass_is_wasted_on_sequences_that_reach_max_tokens(engines, monkeypatch):
    """A sequence whose pending token is its last (max_tokens) is left out of the next step: the
    overlapped engine runs as many forward passes as the synchronous one."""
    launches = []
    for llm in engines:
        runner, count = llm.engine.executor, []
        counted = lambda *args, real=runner.launch, count=count: count.append(1) or real(*args)  # noqa: E731
        monkeypatch.setattr(runner, "launch", counted)
        llm.generate(PROMPTS, [greedy(n) for n in LENGTHS], use_tqdm=False)
        launches.append(len(count))
    assert launches[0] == launches[1] == max(LENGTHS)  # one prefill step, then one step per token


def test_stream_matches_generate(engines):
    llm = engines[1]
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, stop=["e t"])
    (output,) = llm.generate(PROMPTS[3], params, use_tqdm=False)
    assert "".join(llm.stream(PROMPTS[3], params)) == output["text"]
    assert_idle(llm)


def test_a_deferred_sampling_that_fails_is_run_again_synchronously(engines, monkeypatch):
    """A constrained step whose deferred sampling raises (its bitmask fill, say) is re-run on the
    synchronous path, as a failed launch is: the output is still the synchronous loop's."""
    pytest.importorskip("xgrammar")
    failures, real = [], DeferredOutput.sample

    def fail_once(self):
        if not failures:
            failures.append(1)
            raise RuntimeError("a bitmask fill failed")
        return real(self)

    monkeypatch.setattr(DeferredOutput, "sample", fail_once)
    held = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True,
                          structured_outputs=StructuredOutputsParams(regex="[ab]+ [cd]+"))
    generate_both(engines, PROMPTS[:3], [held, greedy(7), greedy(12)])
    assert failures == [1]


def test_decode_graph_buffers_take_the_previous_tokens(qwen3_dir, engines):
    """The CUDA-graph decode path's static input buffer (run eagerly here) gets the pending tokens: through
    its prev_rows field, from the previous step's sampled ids."""
    llm = LLM(qwen3_dir, async_scheduling=True, **OPTIONS)
    runner = llm.engine.executor
    runner.decode_graphs = DecodeGraphs(runner.model, 4, 256 // 4, runner.config.hf_config.hidden_size,
                                        runner.dtype, runner.device, use_cuda_graph=False, batch_sizes=[1, 4],
                                        head_rows=1)
    fed, plain_replay = [], runner.decode_graphs.replay

    def replay(step, prev_sampled):
        fed.append(step.takes_previous)  # rows whose input the previous step sampled
        return plain_replay(step, prev_sampled)

    runner.decode_graphs.replay = replay
    outputs = llm.generate(PROMPTS[:3], [greedy(n) for n in (12, 6, 9)], use_tqdm=False)
    expected = engines[0].generate(PROMPTS[:3], [greedy(n) for n in (12, 6, 9)], use_tqdm=False)
    assert completions(outputs) == completions(expected)
    assert sum(fed) > 10


def test_a_failing_request_is_failed_alone(engines):
    llm = engines[1]
    expected = [o["token_ids"] for o in engines[0].generate(PROMPTS[1:], greedy(12), use_tqdm=False)]
    poisoned = SamplingParams(temperature=0.5, max_tokens=12)
    bad = llm.add_request(PROMPTS[0], poisoned)
    poisoned.temperature = 10**400  # bypasses validation; float32 conversion overflows in the step
    outputs = llm.generate(PROMPTS[1:], greedy(12), use_tqdm=False)
    assert [o["token_ids"] for o in outputs] == expected
    returned, _ = llm.step()
    assert [i for i, _ in returned] == [bad] and returned[0][1]["finish_reason"] == "error"
    assert "OverflowError" in returned[0][1]["error"]
    assert_idle(llm)
