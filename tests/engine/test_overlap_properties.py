"""Property-based tests of overlap scheduling (nanovllm.engine.overlap) on the real Scheduler and
OverlapLoop with a fake device: random arrivals, aborts of requests in the step in flight, preemption
under small caches, chunked prefill and prefix caching, as in test_properties.

The fake device runs each step when it is launched, in launch order (as one CUDA stream would): it
writes into each slot the context its token extends, read through the block table from the slot of
the position before (as attention reads KV), and samples f(context). A pending input token is taken
from the previous step's sampled ids, as the real runner does on the GPU. So a sequence's output is
f of its true prefix at every step only if every block it read held its own KV when read and every
pending token was fed: any reuse of a block still needed, any hash of a block before its KV, any
placeholder leaking into the inputs breaks it."""

import random
from types import SimpleNamespace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_properties import EOS, MAX_STEPS, VOCAB, Request, admit_arrivals, make_sequences, workloads

from nanovllm.engine.invariants import check_invariants
from nanovllm.engine.overlap import OverlapLoop
from nanovllm.engine.requests import StopChecker
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import PENDING_TOKEN_ID, Sequence
from nanovllm.engine.step import StepBatch, StepOutput
from nanovllm.speculative.decoding import SpeculativeDecoding


def model(context: tuple[int, ...]) -> int:
    """The fake model's next token: a function of the whole context (EOS now and then)."""
    return hash(context) % VOCAB


class FakePending:
    def __init__(self, sampled: list[int], waits: list[int]) -> None:
        self.sampled, self.waits = sampled, waits

    def sample(self) -> None:
        pass

    def wait(self) -> StepOutput:
        self.waits.append(1)
        return StepOutput(list(self.sampled))


class FakeDevice:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.slots: dict[int, tuple[int, ...]] = {}  # slot -> the context its KV stands for
        self.waits: list[int] = []

    def launch(self, batch: StepBatch, previous: FakePending | None, defer_sampling: bool = False
               ) -> FakePending:
        input_ids = list(batch.input_ids)
        for index, row in zip(batch.prev_token_indices, batch.prev_token_rows, strict=True):
            input_ids[index] = previous.sampled[row]
        assert PENDING_TOKEN_ID not in input_ids, "a pending token reached the device"
        contexts = []  # per input token
        for row, table in enumerate(batch.block_tables):
            for i in range(batch.cu_seqlens_q[row], batch.cu_seqlens_q[row + 1]):
                pos = batch.positions[i]
                before = self._slot(table, pos - 1) if pos else None
                context = (self.slots[before] if pos else ()) + (input_ids[i],)
                assert batch.slot_mapping[i] == self._slot(table, pos)
                self.slots[batch.slot_mapping[i]] = context
                contexts.append(context)
        # One token a sampling row, or with drafts one a verified position (greedy: the model's).
        return FakePending([model(contexts[i]) for i in batch.logits_indices], self.waits)

    def _slot(self, table: list[int], pos: int) -> int:
        return table[pos // self.block_size] * self.block_size + pos % self.block_size


class FakeProposer:
    """Drafts up to k tokens a sequence, each the model's next token on the sequence's tokens and the
    drafts before it with probability `right`, else a random one; a pending last token is guessed right
    (the model's token after the tokens before it, themselves perhaps rejected drafts)."""

    writes_kv = False
    guesses_pending = True

    def __init__(self, rng: random.Random, right: float) -> None:
        self.rng, self.right = rng, right

    def propose(self, seqs: list[Sequence], num_tokens: list[int], pending=None) -> list[list[int]]:
        out = []
        for seq, num in zip(seqs, num_tokens, strict=True):
            context = list(seq.token_ids)
            if context[-1] == PENDING_TOKEN_ID:
                context[-1] = model(tuple(context[:-1]))
            drafts = []
            for _ in range(self.rng.randint(0, num)):
                token = model(tuple(context)) if self.rng.random() < self.right else self.rng.randrange(VOCAB)
                drafts.append(token)
                context.append(token)
            out.append(drafts)
        return out

    def shutdown(self) -> None:
        pass


def run_overlapped(config, requests, aborts, seed, speculate: tuple[int, float] | None = None) -> OverlapLoop:
    """speculate: (k, how often a draft is right) for n-gram-like drafts verified in the loop."""
    scheduler = Scheduler(config, config.num_kvcache_blocks, StopChecker((EOS,), max_model_len=10**6))
    device = FakeDevice(config.kvcache_block_size)
    finished: list[Sequence] = []

    def run_sync(seqs, is_prefill):
        raise AssertionError("the fake device never fails a launch")

    rng = random.Random(seed)
    spec = None
    if speculate is not None:
        k, right = speculate
        spec_config = SimpleNamespace(
            speculative_config=SimpleNamespace(num_speculative_tokens=k, disable_by_batch_size=None),
            max_model_len=10**6)
        spec = SpeculativeDecoding(spec_config, FakeProposer(random.Random(seed + 1), right))
    loop = OverlapLoop(scheduler, device, run_sync, finished.extend, spec)
    seqs = make_sequences(requests, config.kvcache_block_size)
    aborted: set[int] = set()
    step = 0
    while step <= max(r.arrival for r in requests) or not scheduler.is_finished():
        assert step < MAX_STEPS, "the workload does not finish: a request is stuck"
        admit_arrivals(scheduler, requests, seqs, step)
        if step in aborts and not (seq := seqs[aborts[step]]).is_finished and seq in [
                *scheduler.waiting, *scheduler.running]:
            scheduler.finish_early(seq, "abort")  # as LLMEngine.abort_request, the step in flight or not
            aborted.add(seq.seq_id)
            loop.drop_if_idle()
        step += 1
        if rng.random() < 0.1:
            check_invariants(scheduler)  # between engine steps too, with a step in flight
        if scheduler.is_finished():
            assert loop.in_flight is None, "an idle engine keeps a step in flight"
            continue
        waits = len(device.waits)
        loop.step()
        assert len(device.waits) - waits <= 1, "more than one host sync in one engine step"
        check_invariants(scheduler)
        for seq in [*scheduler.waiting, *scheduler.running]:
            assert PENDING_TOKEN_ID not in seq.token_ids, "a pending token outlived its engine step"
            assert seq.num_assumed_tokens == 0, "an assumed draft outlived its engine step"
    ids = [seq.seq_id for seq in finished]
    assert len(ids) == len(set(ids)), "a request finished twice"
    assert not set(ids) & aborted, "an aborted request also finished"
    assert set(ids) | aborted == {seq.seq_id for seq in seqs}, "a request was lost"
    for seq in finished:
        assert seq.finish_reason in ("stop", "length")
        assert seq.num_completion_tokens <= seq.sampling_params.max_tokens
        for i in range(seq.num_prompt_tokens, len(seq)):  # each token is the model's on its true prefix
            assert seq.token_ids[i] == model(tuple(seq.token_ids[:i])), f"sequence {seq.seq_id} token {i}"
    assert scheduler.block_manager.num_free_blocks == config.num_kvcache_blocks
    return loop


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_overlapped_steps_keep_kv_and_outputs_right(workload):
    run_overlapped(*workload)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.integers(1, 4), st.sampled_from([0.0, 0.6, 0.9, 1.0]))
def test_overlapped_verification_keeps_kv_and_outputs_right(workload, k, right):
    """Drafts verified in the loop, taken as accepted until their tokens are in: rejections void the next
    step's rows of their sequence, whose KV slots are written again later; outputs stay the model's."""
    stats = run_overlapped(*workload, speculate=(k, right)).spec.stats()
    if right == 1.0:  # every draft (and every guess of a pending token) right: none rejected
        assert stats.num_accepted_tokens == stats.num_draft_tokens


def test_a_sequence_preempted_and_admitted_again_under_its_verification():
    """Found by the property above: a sequence whose verification was in flight was preempted by the next
    step's scheduling and admitted again at once (its prompt's blocks in the prefix cache), a step
    scheduled on its recomputed KV; settling the verification then counted the KV it had lost, and the
    next commit ran past its block table. The settle leaves a preempted sequence's count to the scheduler."""
    config = SimpleNamespace(max_num_seqs=3, max_num_batched_tokens=4, num_kvcache_blocks=16,
                             kvcache_block_size=1, enable_prefix_caching=True, mixed_batches=True)
    requests = [Request(0, [1, 3, 1], 1, False), Request(1, [1, 3, 1], 4, False),
                Request(0, [1, 3, 1], 3, False), Request(0, [1, 3, 1, 1], 10, False),
                *[Request(0, [1, 3, 1], 1, False)] * 4]
    loop = run_overlapped(config, requests, {}, 0, speculate=(1, 0.6))
    assert loop.scheduler.num_preemptions > 0  # the case it is named after
