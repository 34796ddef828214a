"""Speculative decoding in the overlap loop (async_scheduling with n-gram drafts, engine/overlap.py):
each verification is taken as accepted while the next step is scheduled and launched, its first token
fed on the device. Greedy output is token for token the engine's without speculation (tiny random model,
float32, CPU), through rejections that void the next step's rows, stops inside accepted runs, logprobs,
seeded sampling with n > 1, preemption, chunked prefill, prefix caching and decode-only batches."""

import pytest
from conftest import PROMPTS
from test_speculative_generate import (
    GREEDY,
    OPTIONS,
    REPEATING,
    SCHEDULER_FEATURES,
    Oracle,
    assert_runs_twice_as_plain,
    assert_same,
    ngram,
    step_counts,
)

from nanovllm import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def base(qwen3_dir):
    return LLM(qwen3_dir, **OPTIONS)


class GuessingOracle(Oracle):
    """The reference continuation from the token after the last, a pending one included (its guess is
    the reference's), wrong wherever `spoil(position)` says."""

    guesses_pending = True


def overlapped(qwen3_dir, base, prompts, params, spoil, **options):
    """An engine with async_scheduling and a GuessingOracle built from base's output for prompts, and
    the list of the batches it launched."""
    llm = LLM(qwen3_dir, **{**OPTIONS, **options}, async_scheduling=True, speculative_config=ngram(3))
    longer = params.clone()
    longer.max_tokens += 8  # the oracle may look past the end
    refs = {tuple(o["prompt_token_ids"]): o["prompt_token_ids"] + o["token_ids"]
            for o in base.generate(prompts, longer, use_tqdm=False)}
    llm.engine._spec.proposer = GuessingOracle(refs, spoil)
    return llm, spy_on_launches(llm)


def spy_on_launches(llm) -> list:
    batches, executor = [], llm.engine.executor
    launch = executor.launch

    def recording(batch, *args, **kwargs):
        batches.append(batch)
        return launch(batch, *args, **kwargs)

    executor.launch = recording
    return batches


def overlapped_verifications(batches) -> int:
    """Launched verification steps whose drafts follow a token the step before was still sampling."""
    return sum(1 for b in batches if b.spec_token_ids and b.prev_token_indices)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_ngram_drafts_in_the_overlap_loop_match_plain_decoding(qwen3_dir, base, k):
    llm = LLM(qwen3_dir, **OPTIONS, async_scheduling=True, speculative_config=ngram(k))
    batches = spy_on_launches(llm)
    outputs = llm.generate(REPEATING, GREEDY, use_tqdm=False)
    assert_same(outputs, base.generate(REPEATING, GREEDY, use_tqdm=False))
    stats = llm.engine.stats().spec_decode
    assert stats.num_drafts > 0 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert sum(o.metrics.num_accepted_tokens for o in outputs) == stats.num_accepted_tokens
    assert overlapped_verifications(batches) > 0


@pytest.mark.parametrize("spoil", [lambda p: False, lambda p: p % 7 == 0, lambda p: p % 2 == 0],
                         ids=["always-right", "one-in-seven", "every-other"])
def test_rejections_void_the_next_rows_and_keep_greedy_output(qwen3_dir, base, spoil):
    llm, batches = overlapped(qwen3_dir, base, PROMPTS, GREEDY, spoil)
    assert_same(llm.generate(PROMPTS, GREEDY, use_tqdm=False), base.generate(PROMPTS, GREEDY, use_tqdm=False))
    stats = llm.engine.stats().spec_decode
    assert stats.num_accepted_tokens > 0 and overlapped_verifications(batches) > 0
    if spoil(0) is False and spoil(7) is False:  # always right: every draft kept
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    else:
        assert stats.num_accepted_tokens < stats.num_draft_tokens


def test_every_draft_right_keeps_the_device_fed(qwen3_dir, base):
    """With every draft right, each verification after the first follows one still being sampled: the
    loop never waits for a step's tokens before launching the next."""
    llm, batches = overlapped(qwen3_dir, base, PROMPTS[:1], GREEDY, lambda p: False)
    llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    verifications = [b for b in batches if b.spec_token_ids]
    assert len(verifications) > 3
    assert all(b.prev_token_indices for b in verifications[1:])


@pytest.mark.parametrize("options", SCHEDULER_FEATURES)
def test_scheduler_features_keep_greedy_output(qwen3_dir, base, options):
    llm, _ = overlapped(qwen3_dir, base, REPEATING, GREEDY, lambda p: p % 5 == 0, **options)
    assert_runs_twice_as_plain(llm, base, options)


def test_stops_logprobs_and_seeded_samples_match_plain_decoding(qwen3_dir, base, tokenizer):
    plain = base.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm, _ = overlapped(qwen3_dir, base, PROMPTS, GREEDY, lambda p: p % 6 == 0)
    for i, prompt in enumerate(PROMPTS):  # a stop id, a stop string, max_tokens inside accepted runs
        tokens = plain[i]["token_ids"]
        for params in (SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[tokens[4]]),
                       SamplingParams(temperature=0, max_tokens=40, stop=[tokenizer.decode(tokens[5:7])]),
                       SamplingParams(temperature=0, max_tokens=7)):
            assert_same(llm.generate(prompt, params, use_tqdm=False),
                        base.generate(prompt, params, use_tqdm=False))
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=3)
    outputs, expected = llm.generate(PROMPTS, params, use_tqdm=False), base.generate(PROMPTS, params,
                                                                                     use_tqdm=False)
    assert_same(outputs, expected)
    for out, ref in zip(outputs, expected):
        assert [list(a) for a in out["logprobs"]] == [list(b) for b in ref["logprobs"]]
        assert out["cumulative_logprob"] == pytest.approx(ref["cumulative_logprob"], abs=1e-3)
    seeded = SamplingParams(temperature=0.8, top_k=50, top_p=0.95, max_tokens=24, seed=7, n=2,
                            ignore_eos=True)
    llm, _ = overlapped(qwen3_dir, base, PROMPTS, seeded, lambda p: p % 4 == 0)
    for out, ref in zip(llm.generate(PROMPTS, seeded, use_tqdm=False),
                        base.generate(PROMPTS, seeded, use_tqdm=False)):
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in ref.outputs]
    assert llm.engine.stats().spec_decode.num_accepted_tokens > 0


def test_steps_report_the_tokens_verification_emitted_as_decoded(qwen3_dir, base):
    """k = 3, always right, one request of 10 tokens. Each step reports the prompt tokens it launched
    and the tokens the step it read emitted: the prompt, then its first token, two verifications of
    3 drafts and a bonus token each, then a plain step (no room for a draft)."""
    prompt = PROMPTS[:1]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    llm, _ = overlapped(qwen3_dir, base, prompt, params, lambda p: False)
    num_prompt = len(llm.engine.tokenizer.encode(prompt[0]))
    assert step_counts(llm, prompt[0], params) == [(num_prompt, 0), (0, 1), (0, 4), (0, 4), (0, 1)]


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "seeded"])
def test_structured_output_rows_verify_without_overlap_beside_rows_that_overlap(qwen3_dir, base, temperature):
    """A constrained row's drafts are cut by its matcher, which takes tokens only once they are read: it
    gets none past a pending token, and a step where it verifies waits for its tokens. Unconstrained
    rows beside it go on overlapped; the output is the plain engine's."""
    pytest.importorskip("xgrammar")
    from nanovllm import StructuredOutputsParams

    constraints = [dict(regex="[ab]+ [cd]+ [ab]+"), dict(choice=["alpha beta gamma", "alpha beta delta"])]
    params = [SamplingParams(temperature=temperature, seed=2, max_tokens=24,
                             structured_outputs=StructuredOutputsParams(**c)) for c in constraints]
    params += [GREEDY, GREEDY]
    expected = base.generate(PROMPTS, params, use_tqdm=False)
    refs = {tuple(o["prompt_token_ids"]): o["prompt_token_ids"] + o["token_ids"] + [0] * 8 for o in expected}
    llm = LLM(qwen3_dir, **OPTIONS, async_scheduling=True, speculative_config=ngram(3))
    llm.engine._spec.proposer = GuessingOracle(refs, spoil=lambda p: p % 5 == 0)
    batches = spy_on_launches(llm)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert_same(outputs, expected)
    assert all(o.metrics.num_accepted_tokens > 0 for o in outputs)
    assert overlapped_verifications(batches) > 0
