"""A draft model in the overlap loop (async_scheduling, engine/overlap.py): a verification is taken as
accepted while the draft proposes the next drafts, its catch-up fed on the device with the target's token
still being sampled (engine/in_flight.PendingTokens). Greedy output is plain greedy output, token for
token (tiny random models, float32, CPU), with the target as its own draft (every draft right), another
draft (nearly every draft wrong), preemption, chunked prefill, a warm prefix cache, the catch-up in the
draft's verification graphs, and proposals spoiled on purpose: a rejection leaves the draft's cache
right for the rounds after it. The draft's final step reaches the verification on the device (read on
the host after the launch), but where logits processors need the drafts' values."""

import pytest
from conftest import PROMPTS
from test_draft_model_e2e import other_draft  # noqa: F401, F811 (a fixture: a smaller random draft)
from test_speculative_overlap import overlapped_verifications, spy_on_launches
from test_verify_graphs import with_verify_graphs

from nanovllm import LLM, SamplingParams
from nanovllm.engine.sequence import PENDING_TOKEN_ID

pytestmark = pytest.mark.usefixtures("one_thread")

# Small blocks and few of them: sequences preempt each other, and drafts cross block boundaries.
OPTIONS = dict(kvcache_block_size=4, num_kvcache_blocks=24, max_model_len=256, cpu_threads=1, dtype="float32",
               async_scheduling=True)
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def plain(qwen3_dir):
    with LLM(qwen3_dir, **OPTIONS) as llm:
        return [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("k", [1, 3])
def test_the_target_as_its_own_draft_is_always_right_in_the_overlap_loop(qwen3_dir, plain, k):
    spec_config = {"model": qwen3_dir, "num_speculative_tokens": k}
    with LLM(qwen3_dir, **OPTIONS, speculative_config=spec_config) as llm:
        batches = spy_on_launches(llm)
        assert [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY)] == plain
        stats = llm.engine.stats()
    spec = stats.spec_decode
    # Right drafts: the pending token reached the draft's catch-up (a wrong one spoils the drafts after it).
    assert spec.num_draft_tokens > 0 and spec.num_accepted_tokens == spec.num_draft_tokens
    assert stats.num_preemptions > 0
    assert overlapped_verifications(batches) > len([b for b in batches if b.spec_token_ids]) // 2


def test_another_draft_leaves_greedy_output_unchanged_in_the_overlap_loop(qwen3_dir, plain, other_draft):  # noqa: F811
    spec_config = {"model": other_draft, "num_speculative_tokens": 3}
    with LLM(qwen3_dir, **OPTIONS, speculative_config=spec_config) as llm:
        assert [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY)] == plain
        spec = llm.engine.stats().spec_decode
    assert spec.num_draft_tokens > 0 and spec.num_accepted_tokens < spec.num_draft_tokens // 4


@pytest.mark.parametrize("options", [dict(max_num_batched_tokens=16), dict(num_kvcache_blocks=256),
                                     dict(mixed_batches=False)],
                         ids=["chunked-prefill", "warm-prefix-cache", "prefill-apart"])
def test_scheduler_features_keep_greedy_output(qwen3_dir, plain, options):
    spec_config = {"model": qwen3_dir, "num_speculative_tokens": 3}
    with LLM(qwen3_dir, **{**OPTIONS, **options}, speculative_config=spec_config) as llm:
        for _ in range(2):  # the second time over cached prompts, where the cache keeps them
            assert [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY)] == plain
        spec = llm.engine.stats().spec_decode
    assert spec.num_accepted_tokens == spec.num_draft_tokens > 0


def test_a_rejection_leaves_the_drafts_cache_right(qwen3_dir, plain):
    """The target as its own draft, with the first draft of every third proposal spoiled: those rounds
    are rejected at their first draft, and every other round verified is accepted whole. The draft's
    cache past a rejection held the assumed tokens; a draft that read them would propose wrong tokens."""
    spec_config = {"model": qwen3_dir, "num_speculative_tokens": 3}
    with LLM(qwen3_dir, **OPTIONS, speculative_config=spec_config) as llm:
        spec = llm.engine._spec
        proposer, propose, accept = spec.proposer, spec.proposer.propose, spec.accept
        spoiled, verified = set(), []

        def spoiling(seqs, num_tokens, pending=None, **options):
            out = propose(seqs, num_tokens, pending, **options)
            for seq, drafts in zip(seqs, out):
                seq.num_rounds = getattr(seq, "num_rounds", 0) + 1
                if len(drafts) > 1 and seq.num_rounds % 3 == 0:
                    drafts[0] = (drafts[0] + 1) % 300
                    # The last draft may still be on the device (defer_last): known by the ones before it.
                    spoiled.add((seq.seq_id, tuple(drafts[:-1])))
            return out

        def recording(seq, sampled, drafts):
            tokens = accept(seq, sampled, drafts)
            verified.append(((seq.seq_id, tuple(drafts[:-1])) in spoiled, len(drafts), len(tokens) - 1))
            return tokens

        proposer.propose, spec.accept = spoiling, recording
        assert [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY)] == plain
    assert any(s for s, _, _ in verified) and any(not s for s, _, _ in verified)
    for was_spoiled, num_drafts, num_accepted in verified:
        assert num_accepted == (0 if was_spoiled else num_drafts)


def test_catch_ups_in_the_drafts_verification_graphs_take_the_pending_token(qwen3_dir, plain):
    """On a GPU a catch-up of a few tokens runs as decode rows in the draft runner's verification graphs
    (here run eagerly: the CPU has no CUDA graphs), its last row's token fed from the target's step."""
    spec_config = {"model": qwen3_dir, "num_speculative_tokens": 3}
    with LLM(qwen3_dir, **OPTIONS, speculative_config=spec_config) as llm:
        fed = with_verify_graphs(llm.engine._spec.proposer.runner, 8,
                                 record=lambda batch: len(batch.prev_token_indices))
        assert [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY)] == plain
        spec = llm.engine.stats().spec_decode
    assert spec.num_accepted_tokens == spec.num_draft_tokens > 0
    assert fed and max(fed) > 0  # catch-ups in the graphs whose pending tokens came from the device


def test_seeded_samples_and_logprobs_match_plain_decoding(qwen3_dir):
    """Seeded sampling draws each token's noise from (seed, token index): the same tokens, with their
    logprobs, with or without a draft in the overlap loop."""
    params = SamplingParams(temperature=0.8, seed=5, n=2, max_tokens=16, ignore_eos=True, logprobs=2)
    with LLM(qwen3_dir, **OPTIONS) as llm:
        expected = llm.generate(PROMPTS[:2], params)
    spec_config = {"model": qwen3_dir, "num_speculative_tokens": 3}
    with LLM(qwen3_dir, **OPTIONS, speculative_config=spec_config) as llm:
        outputs = llm.generate(PROMPTS[:2], params)
        assert llm.engine.stats().spec_decode.num_accepted_tokens > 0
    for out, ref in zip(outputs, expected, strict=True):
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in ref.outputs]
        for c, r in zip(out.outputs, ref.outputs, strict=True):
            assert [sorted(lp) for lp in c.logprobs] == [sorted(lp) for lp in r.logprobs]


def test_a_failing_proposal_leaves_no_pending_token(qwen3_dir, plain):
    """A proposer that raises mid-step (after the step in flight was committed): the step in flight is
    still read, so the error reaches the caller as it is (aborting its requests needs their tokens
    settled), and the engine goes on serving."""
    spec_config = {"model": qwen3_dir, "num_speculative_tokens": 3}
    with LLM(qwen3_dir, **OPTIONS, speculative_config=spec_config) as llm:
        proposer = llm.engine._spec.proposer
        propose, calls = proposer.propose, []

        def failing(seqs, num_tokens, pending=None, **options):
            calls.append(pending)
            if pending is not None and len(calls) > 3:
                raise RuntimeError("the proposer broke")
            return propose(seqs, num_tokens, pending, **options)

        proposer.propose = failing
        with pytest.raises(RuntimeError, match="the proposer broke"):
            llm.generate(PROMPTS, GREEDY)
        assert all(-1 not in seq.token_ids for seq in llm.engine.scheduler.running)
        proposer.propose = propose
        assert [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY)] == plain


def own_draft(model: str, k: int) -> dict:
    return {"model": model, "num_speculative_tokens": k}


def last_drafts_fed(batch) -> bool:
    """Whether every verifying row's last input (its last draft) is pending on the host and fed on the
    device (StepBatch.prev_token_*)."""
    last = [batch.cu_seqlens_q[row + 1] - 1 for row, drafts in zip(batch.sample_rows, batch.spec_token_ids)
            if drafts]
    return bool(last) and all(batch.input_ids[i] == PENDING_TOKEN_ID and i in batch.prev_token_indices
                              for i in last)


def spy_on_fed_drafts(llm) -> list:
    """Per verification launched, last_drafts_fed, recorded at launch."""
    fed, executor = [], llm.engine.executor
    launch = executor.launch

    def recording(batch, *args, **kwargs):
        if batch.spec_token_ids:
            fed.append(last_drafts_fed(batch))
        return launch(batch, *args, **kwargs)

    executor.launch = recording
    return fed


@pytest.mark.parametrize("k,graphs", [(3, False), (1, True), (3, True)],
                         ids=["k3-eager", "k1-graphs", "k3-graphs"])
def test_the_last_draft_reaches_the_verification_on_the_device(qwen3_dir, plain, k, graphs):
    """The draft's final step is not read before the verification is launched: each row's last draft
    is taken on the device, and read on the host while the verification runs. With both runners'
    verification graph sets (run eagerly here): k = 1's one draft comes from the catch-up launched there,
    and the target's graphs place a row's first token and last draft from two steps' sampled ids."""
    with LLM(qwen3_dir, **OPTIONS, speculative_config=own_draft(qwen3_dir, k)) as llm:
        if graphs:
            with_verify_graphs(llm.engine._spec.proposer.runner, 8)
            staged = with_verify_graphs(llm.engine.executor, 32)
        fed = spy_on_fed_drafts(llm)
        assert [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY)] == plain
        spec = llm.engine.stats().spec_decode
        assert all(PENDING_TOKEN_ID not in seq.spec_token_ids for seq in llm.engine.scheduler.running)
    assert spec.num_accepted_tokens == spec.num_draft_tokens > 0
    assert sum(fed) > len(fed) // 2
    assert not graphs or staged


def test_rows_with_logits_processors_get_their_last_draft_on_the_host(qwen3_dir):
    """A repetition penalty's processors are built from the drafts before each verified position: those
    proposals are read whole before the verification is built, and the output is plain decoding's."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, repetition_penalty=1.3)
    with LLM(qwen3_dir, **OPTIONS) as llm:
        expected = [o["token_ids"] for o in llm.generate(PROMPTS, params)]
    with LLM(qwen3_dir, **OPTIONS, speculative_config=own_draft(qwen3_dir, 3)) as llm:
        fed = spy_on_fed_drafts(llm)
        assert [o["token_ids"] for o in llm.generate(PROMPTS, params)] == expected
        assert llm.engine.stats().spec_decode.num_draft_tokens > 0
    assert fed and not any(fed)


def test_a_failing_launch_reruns_with_the_last_drafts_read(qwen3_dir, plain):
    """A verification whose launch fails after its last drafts were left on the device runs again
    synchronously: by then they are read, and the output is plain decoding's."""
    with LLM(qwen3_dir, **OPTIONS, speculative_config=own_draft(qwen3_dir, 3)) as llm:
        executor = llm.engine.executor
        launch, failed = executor.launch, []

        def failing(batch, *args, **kwargs):
            if batch.spec_token_ids and last_drafts_fed(batch) and len(failed) < 3:
                failed.append(batch)
                raise RuntimeError("the launch broke")
            return launch(batch, *args, **kwargs)

        executor.launch = failing
        assert [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY)] == plain
    assert len(failed) == 3
