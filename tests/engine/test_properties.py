"""Property-based tests of the Scheduler and BlockManager (hypothesis): random arrivals, prompt
lengths, shared prefixes, aborts, preemption under small caches, chunked prefill and cache sizes,
driven through schedule()/postprocess() with fake sampled tokens. After every step the invariants of
nanovllm.engine.invariants hold, and a fake KV cache (what each step would write into each slot)
shows that every computed token's KV is where the block table says, never overwritten by another
sequence and never served from a wrong prefix. Every request finishes exactly once, or is aborted."""

import random
from dataclasses import dataclass
from types import SimpleNamespace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanovllm.engine.invariants import check_invariants
from nanovllm.engine.requests import StopChecker
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import SamplingParams

EOS = 0
VOCAB = 6  # few distinct tokens, so that prompts and completions often share blocks
# Steps a workload may take before the test calls it stuck (far above what any example needs).
MAX_STEPS = 20_000


@dataclass
class Request:
    arrival: int  # the step before which it is added
    token_ids: list[int]
    max_tokens: int
    ignore_eos: bool


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    num_blocks = draw(st.integers(2, 24))
    capacity = num_blocks * block_size  # the engine refuses a request that cannot fit alone
    prefix = st.lists(st.integers(1, VOCAB), max_size=3 * block_size)
    prefixes = draw(st.lists(prefix, min_size=1, max_size=3))
    requests = []
    for _ in range(draw(st.integers(1, 12))):
        prefix = draw(st.sampled_from(prefixes))
        suffix = draw(st.lists(st.integers(1, VOCAB), max_size=2 * block_size))
        token_ids = (prefix + suffix)[:capacity - 1] or [1]
        max_tokens = draw(st.integers(1, max(1, min(12, capacity - len(token_ids)))))
        requests.append(Request(draw(st.integers(0, 20)), token_ids, max_tokens, draw(st.booleans())))
    aborts = draw(st.lists(st.tuples(st.integers(0, 40), st.integers(0, len(requests) - 1)), max_size=4))
    config = SimpleNamespace(
        max_num_seqs=draw(st.integers(1, 6)), max_num_batched_tokens=draw(st.integers(1, 32)),
        num_kvcache_blocks=num_blocks, kvcache_block_size=block_size,
        enable_prefix_caching=draw(st.booleans()), mixed_batches=draw(st.booleans()))
    return config, requests, dict(aborts), draw(st.integers(0, 2**32 - 1))


class FakeKV:
    """What the model would have written: slot -> the tokens up to and including the one whose KV it
    holds (a token's KV depends on everything before it, so a block reused under another prefix
    shows up even when its own token ids match)."""

    def __init__(self, block_size: int) -> None:
        self.block_size, self.slots = block_size, {}

    def slot(self, seq: Sequence, pos: int) -> tuple[int, int]:
        return seq.block_table[pos // self.block_size], pos % self.block_size

    def write_step(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + seq.num_scheduled_tokens):
                self.slots[self.slot(seq, pos)] = tuple(seq.token_ids[:pos + 1])

    def check(self, seqs) -> None:
        """Every computed token of every sequence has its own KV where its block table points."""
        for seq in seqs:
            for pos in range(seq.num_computed_tokens):
                assert self.slots.get(self.slot(seq, pos)) == tuple(seq.token_ids[:pos + 1]), (
                    f"sequence {seq.seq_id} position {pos}: its KV slot holds another token")


def make_sequences(requests, block_size: int) -> list[Sequence]:
    """One Sequence per generated request, not yet queued."""
    return [Sequence(r.token_ids, SamplingParams(max_tokens=r.max_tokens, ignore_eos=r.ignore_eos),
                     block_size) for r in requests]


def admit_arrivals(scheduler: Scheduler, requests, seqs: list[Sequence], step: int) -> None:
    """Queue the requests that arrive at this step."""
    for i, r in enumerate(requests):
        if r.arrival == step:
            scheduler.add(seqs[i])


def run_workload(config, requests, aborts, seed) -> Scheduler:
    scheduler = Scheduler(config, config.num_kvcache_blocks, StopChecker((EOS,), max_model_len=10**6))
    rng, kv = random.Random(seed), FakeKV(config.kvcache_block_size)
    seqs = make_sequences(requests, config.kvcache_block_size)
    by_id = {seq.seq_id: i for i, seq in enumerate(seqs)}
    finished: list[int] = []
    aborted: set[int] = set()
    step = 0
    while step <= max(r.arrival for r in requests) or not scheduler.is_finished():
        assert step < MAX_STEPS, "the workload does not finish: a request is stuck"
        admit_arrivals(scheduler, requests, seqs, step)
        if step in aborts:
            seq = seqs[aborts[step]]
            if scheduler.abort(seq.seq_id) is not None:
                aborted.add(seq.seq_id)
                assert seq.finish_reason == "abort" and not seq.block_table
        check_invariants(scheduler)
        step += 1
        if scheduler.is_finished():
            continue
        batch, is_prefill = scheduler.schedule()
        assert batch, "schedule() returned an empty step"
        assert sum(s.num_scheduled_tokens for s in batch) <= config.max_num_batched_tokens
        assert all(s.num_scheduled_tokens == 1 for s in batch) or is_prefill
        kv.write_step(batch)
        # A sequence samples once its whole prompt (and every token so far) is computed.
        tokens = [rng.randrange(VOCAB) if s.num_computed_tokens + s.num_scheduled_tokens == len(s) else None
                  for s in batch]
        done = scheduler.postprocess(batch, tokens)
        finished.extend(seq.seq_id for seq in done)
        for seq in done:
            assert seq.finish_reason in ("stop", "length") and not seq.block_table
            assert seq.num_completion_tokens <= seq.sampling_params.max_tokens
        check_invariants(scheduler)
        kv.check(scheduler.running)
    assert len(finished) == len(set(finished)), "a request finished twice"
    assert not set(finished) & aborted, "an aborted request also finished"
    assert set(finished) | aborted == set(by_id), "a request was lost"
    bm = scheduler.block_manager
    assert bm.num_free_blocks == config.num_kvcache_blocks  # everything came back
    return scheduler


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_scheduler_and_block_manager_invariants(workload):
    run_workload(*workload)


def test_a_small_cache_preempts_and_still_finishes_everything():
    """A fixed example that surely preempts, aborts and shares prefixes (hypothesis may not)."""
    config = SimpleNamespace(max_num_seqs=4, max_num_batched_tokens=16, num_kvcache_blocks=6,
                             kvcache_block_size=2, enable_prefix_caching=True, mixed_batches=False)
    requests = [Request(0, [1, 2, 3, 4, 5], 6, True) for _ in range(4)] + [Request(3, [1, 2, 3, 4], 7, True)]
    scheduler = run_workload(config, requests, {5: 4}, seed=0)
    assert scheduler.num_preemptions > 0 and scheduler.block_manager.num_cache_hit_tokens > 0


def test_abort_frees_blocks_and_keeps_the_prefix_cache():
    config = SimpleNamespace(max_num_seqs=4, max_num_batched_tokens=64, num_kvcache_blocks=8,
                             kvcache_block_size=2, enable_prefix_caching=True, mixed_batches=True)
    scheduler = Scheduler(config, config.num_kvcache_blocks, StopChecker((EOS,), max_model_len=100))
    a = Sequence([1, 2, 3, 4, 5], SamplingParams(max_tokens=4), 2)
    b = Sequence([1, 2, 3, 4, 6], SamplingParams(max_tokens=4), 2)
    scheduler.add(a)
    batch, _ = scheduler.schedule()
    scheduler.postprocess(batch, [7])
    scheduler.add(b)
    assert scheduler.abort(a.seq_id) is a and a.finish_reason == "abort"
    assert scheduler.abort(a.seq_id) is None  # not queued any more
    assert scheduler.block_manager.num_free_blocks == 8
    assert scheduler.abort(b.seq_id) is b  # a waiting request
    scheduler.add(c := Sequence([1, 2, 3, 4, 9], SamplingParams(max_tokens=1), 2))
    scheduler.schedule()
    assert c.num_cached_tokens == 4  # a's two full blocks outlived its abort in the prefix cache
    check_invariants(scheduler)
