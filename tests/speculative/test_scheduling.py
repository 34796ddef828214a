"""The scheduler's side of speculative decoding (pure Python): a decoding sequence with drafts computes
its last token and the drafts, with KV slots for all; drafts only take budget and blocks that plain
decoding leaves over; preemption and retirement clear them; postprocess_verified appends the emitted
tokens one by one, stops where a stop hits, and counts as computed only the accepted drafts' KV."""

import pickle
from dataclasses import replace
from types import SimpleNamespace

import pytest

from nanovllm.distributed.worker import CHANNEL_SLACK_BYTES, channel_size
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.requests import StopChecker
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.step import build_batch
from nanovllm.sampling_params import SamplingParams

EOS = 0
BLOCK = 4


def make_scheduler(num_blocks=16, max_num_batched_tokens=64, mixed=True):
    config = SimpleNamespace(max_num_seqs=8, max_num_batched_tokens=max_num_batched_tokens,
                             kvcache_block_size=BLOCK, enable_prefix_caching=True, mixed_batches=mixed)
    return Scheduler(config, num_blocks, StopChecker((EOS,), max_model_len=1000))


def decoding(sched, n=5, start=1, **params):
    """A sequence past its prefill: n prompt tokens computed, one sampled token (99) without KV. The
    sequences already running do not step meanwhile."""
    seq = Sequence(list(range(start, start + n)), SamplingParams(max_tokens=100, **params), BLOCK)
    others, sched.running = sched.running, type(sched.running)()
    sched.add(seq)
    seqs, _ = sched.schedule()
    assert seqs == [seq] and sched.postprocess(seqs, [99]) == []
    sched.running.extendleft(reversed(others))
    return seq


@pytest.mark.parametrize("mixed", [True, False])
def test_drafts_are_scheduled_with_slots_and_make_it_no_decode_step(mixed):
    sched = make_scheduler(mixed=mixed)
    a, b = decoding(sched), decoding(sched, start=50)
    a.spec_token_ids = [7, 8, 9]
    seqs, is_prefill = sched.schedule()
    assert seqs == [b, a] and is_prefill  # plain decode rows first
    assert (a.num_scheduled_tokens, b.num_scheduled_tokens) == (4, 1)
    assert len(a.block_table) * BLOCK >= len(a) + 3  # slots for the last token and the three drafts
    batch = build_batch(seqs, is_prefill)
    assert batch.input_ids == [99, 99, 7, 8, 9] and batch.positions == [5, 5, 6, 7, 8]
    assert batch.spec_token_ids == [[], [7, 8, 9]] and batch.logits_indices == [0, 1, 2, 3, 4]
    assert len(batch.sampling.temperatures) == 5 and batch.sample_rows == [0, 1]


def test_drafts_take_only_budget_that_plain_decoding_leaves_over():
    sched = make_scheduler(max_num_batched_tokens=4)
    seqs = [decoding(sched, n=3, start=10 * i + 1) for i in range(3)]
    for seq in seqs:
        seq.spec_token_ids = [7, 8, 9]
    scheduled, _ = sched.schedule()
    assert sorted(s.num_scheduled_tokens for s in scheduled) == [1, 1, 2]  # every one decodes
    assert sum(len(s.spec_token_ids) for s in seqs) == 1


def test_drafts_never_preempt():
    sched = make_scheduler(num_blocks=4)
    a, b = decoding(sched, n=7), decoding(sched, n=7, start=50)  # two blocks each, both full up to 8
    assert sched.block_manager.num_free_blocks == 0
    a.spec_token_ids = [7, 8]
    seqs, is_prefill = sched.schedule()
    assert seqs == [a, b] and not is_prefill and a.spec_token_ids == []  # dropped, nobody preempted
    assert sched.num_preemptions == 0


def test_preemption_and_retirement_clear_drafts():
    sched = make_scheduler(num_blocks=4)
    a, b = decoding(sched, n=8), decoding(sched, n=7, start=50)  # a needs a third block to decode
    b.spec_token_ids = [1, 2]
    sched.schedule()
    assert sched.num_preemptions == 1 and b.spec_token_ids == [] and b.block_table == []
    a.spec_token_ids = [3]
    sched.finish_early(a, "abort")
    assert a.spec_token_ids == []


def test_deallocate_resets_the_draft_models_computed_tokens():
    bm = BlockManager(4, BLOCK)
    seq = Sequence([1, 2, 3], block_size=BLOCK)
    bm.allocate(seq)
    seq.num_draft_computed_tokens = 3
    bm.deallocate(seq)
    assert seq.num_draft_computed_tokens == 0


def test_postprocess_verified_appends_and_counts_only_accepted_kv():
    sched = make_scheduler()
    a, b = decoding(sched, n=6), decoding(sched, n=6, start=50)
    a.spec_token_ids, b.spec_token_ids = [7, 8, 9], [7, 8]
    seqs, _ = sched.schedule()
    # b: drafts 7 accepted, 8 rejected (5 instead); a: all three accepted, bonus 10.
    results = {id(a): ([7, 8, 9, 10], None), id(b): ([7, 5], None)}
    assert sched.postprocess_verified(seqs, [results[id(s)] for s in seqs]) == []
    assert a.token_ids[6:] == [99, 7, 8, 9, 10] and a.num_computed_tokens == 10 == len(a) - 1
    assert b.token_ids[6:] == [99, 7, 5] and b.num_computed_tokens == 8 == len(b) - 1
    assert a.spec_token_ids == b.spec_token_ids == []
    assert len(a.block_hashes) == 2  # the blocks the accepted drafts filled are in the prefix cache
    assert sched.block_manager.blocks[a.block_table[1]].token_ids == [5, 6, 99, 7]


def test_a_stop_inside_an_accepted_run_drops_what_follows():
    sched = make_scheduler()
    seq = decoding(sched, n=6, stop_token_ids=[8])
    seq.logprobs, seq.cumulative_logprob = [], 0.0
    seq.spec_token_ids = [7, 8, 9]
    seqs, _ = sched.schedule()
    logprobs = [{7: -1.0}, {8: -2.0}, {9: -3.0}, {10: -4.0}]
    assert sched.postprocess_verified(seqs, [([7, 8, 9, 10], logprobs)]) == [seq]
    assert seq.completion_token_ids == [99, 7, 8] and seq.finish_reason == "stop" and seq.stop_reason == 8
    assert seq.logprobs == logprobs[:2] and seq.cumulative_logprob == -3.0
    assert seq.block_table == [] and sched.running == type(sched.running)()


def test_the_largest_verification_step_fits_the_tensor_parallel_channel():
    """Every token of the step budget a draft, ids as large as they get: the workers' message fits."""
    config = SimpleNamespace(max_num_batched_tokens=512, max_num_seqs=8, max_model_len=256,
                             kvcache_block_size=1)
    seqs = []
    per_seq = config.max_num_batched_tokens // config.max_num_seqs
    for i in range(config.max_num_seqs):
        seq = Sequence([2**31 - 1] * (config.max_model_len - per_seq), block_size=1)
        seq.num_computed_tokens = len(seq) - 1
        seq.spec_token_ids = [2**31 - 1] * (per_seq - 1)
        seq.num_scheduled_tokens = per_seq
        seq.block_table = [2**31 - 1 - i] * config.max_model_len
        seqs.append(seq)
    batch = build_batch(seqs, True)
    assert len(batch.input_ids) == config.max_num_batched_tokens == len(batch.logits_indices)
    message = pickle.dumps(("run", (replace(batch, sampling=None),)), protocol=pickle.HIGHEST_PROTOCOL)
    assert len(message) <= channel_size(config) - CHANNEL_SLACK_BYTES
