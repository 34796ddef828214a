from types import SimpleNamespace

from nanovllm.engine.requests import StopChecker
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence, SequenceStatus
from nanovllm.sampling_params import SamplingParams

EOS = 0


def make_scheduler(num_blocks=16, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, mixed=False):
    """mixed=False: nano-vllm's prefill-first policy, which most tests here pin down step by step."""
    config = SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                             kvcache_block_size=block_size, enable_prefix_caching=True, mixed_batches=mixed)
    return Scheduler(config, num_blocks, StopChecker((EOS,), max_model_len=1000))


def make_seq(n, max_tokens=100, block_size=4, start=1):
    return Sequence(list(range(start, start + n)), SamplingParams(max_tokens=max_tokens), block_size)


def run_step(sched, token=7):
    """Schedule one step and feed back `token` for every sequence that reached its end."""
    seqs, is_prefill = sched.schedule()
    scheduled = [s.num_scheduled_tokens for s in seqs]
    tokens = [token if s.num_computed_tokens + s.num_scheduled_tokens == len(s) else None for s in seqs]
    finished = sched.postprocess(seqs, tokens)
    return seqs, is_prefill, scheduled, finished


def test_prefill_comes_before_decode():
    sched = make_scheduler()
    a = make_seq(5)
    sched.add(a)
    seqs, is_prefill, scheduled, _ = run_step(sched)
    assert seqs == [a] and is_prefill and scheduled == [5]
    b = make_seq(3, start=50)
    sched.add(b)
    seqs, is_prefill, scheduled, _ = run_step(sched)
    assert seqs == [b] and is_prefill  # the newcomer is prefilled while a waits
    seqs, is_prefill, scheduled, _ = run_step(sched)
    assert seqs == [a, b] and not is_prefill and scheduled == [1, 1]


def test_mixed_step_decodes_the_running_and_admits_the_newcomer_in_one_batch():
    sched = make_scheduler(mixed=True)
    a = make_seq(5)
    sched.add(a)
    run_step(sched)
    b = make_seq(3, start=50)
    sched.add(b)
    seqs, is_prefill, scheduled, _ = run_step(sched)
    assert seqs == [a, b] and scheduled == [1, 3] and is_prefill  # not a pure decode step
    assert a.num_completion_tokens == 2 and b.num_completion_tokens == 1
    seqs, is_prefill, scheduled, _ = run_step(sched)
    assert seqs == [a, b] and scheduled == [1, 1] and not is_prefill


def test_mixed_step_chunks_the_newcomer_with_what_decode_leaves_of_the_budget():
    sched = make_scheduler(mixed=True, max_num_batched_tokens=6)
    a, b = make_seq(4), make_seq(4, start=20)
    for seq in (a, b):
        sched.add(seq)
    run_step(sched)  # both prefilled: 8 tokens exceed 6, so b's prompt is chunked 2 + 2
    assert b.num_computed_tokens == 2
    c = make_seq(9, start=50)
    sched.add(c)
    seqs, _, scheduled, _ = run_step(sched)
    assert seqs == [a, b, c] and scheduled == [1, 2, 3]  # a decodes, b finishes its prompt, c gets 3
    seqs, _, scheduled, _ = run_step(sched)
    assert seqs == [a, b, c] and scheduled == [1, 1, 4]


def test_mixed_step_puts_decoding_rows_first_and_keeps_the_running_order():
    """Backends run a mixed batch's leading one-token rows through their decode kernel."""
    sched = make_scheduler(mixed=True, max_num_batched_tokens=10)
    a = make_seq(4)
    sched.add(a)
    run_step(sched)  # a decodes from now on
    c = make_seq(12, start=50)
    sched.add(c)
    run_step(sched)  # a decodes, c gets its first chunk (9 of 12)
    sched.running.rotate(1)  # c now older than a (as after a preemption and readmission of a)
    seqs, is_prefill, scheduled, _ = run_step(sched)
    assert seqs == [a, c] and scheduled == [1, 3] and is_prefill
    assert list(sched.running) == [c, a]


def test_long_prompt_is_chunked_under_the_token_budget():
    sched = make_scheduler(max_num_batched_tokens=4)
    a = make_seq(10)
    sched.add(a)
    chunks = []
    while a.num_completion_tokens == 0:
        seqs, is_prefill, scheduled, _ = run_step(sched)
        chunks.append((is_prefill, scheduled))
    # 10 tokens under a budget of 4: 4 + 4 + 2, the last chunk samples
    assert chunks == [(True, [4]), (True, [4]), (True, [2])]
    assert a.num_computed_tokens == 10 and a.status == SequenceStatus.RUNNING


def test_chunked_prefill_continues_before_new_admissions():
    sched = make_scheduler(max_num_batched_tokens=6)
    a, b = make_seq(8), make_seq(4, start=100)
    sched.add(a)
    sched.add(b)
    seqs, _, scheduled, _ = run_step(sched)
    assert seqs == [a] and scheduled == [6]
    seqs, _, scheduled, _ = run_step(sched)
    assert seqs == [a, b] and scheduled == [2, 4]


def test_max_num_seqs_limits_running():
    sched = make_scheduler(max_num_seqs=2)
    seqs = [make_seq(3, start=10 * i + 1) for i in range(3)]
    for s in seqs:
        sched.add(s)
    scheduled, is_prefill, _, _ = run_step(sched)
    assert scheduled == seqs[:2] and is_prefill
    assert list(sched.waiting) == [seqs[2]]


def test_preemption_when_blocks_run_out_and_nothing_is_lost():
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    a, b = make_seq(4, max_tokens=8), make_seq(4, max_tokens=8, start=40)
    sched.add(a)
    sched.add(b)
    run_step(sched)  # prefill both: 1 block each (4 tokens), then each gets its first token
    assert sched.block_manager.num_free_blocks == 2
    done = []
    for _ in range(40):
        if sched.is_finished():
            break
        done += run_step(sched)[3]
    assert sched.num_preemptions > 0
    assert b.num_preemptions > 0  # the most recently admitted sequence was preempted
    assert sorted(s.seq_id for s in done) == sorted([a.seq_id, b.seq_id])
    assert all(s.num_completion_tokens == 8 and s.finish_reason == "length" for s in done)
    assert sched.block_manager.num_free_blocks == 4


def test_a_lone_sequence_that_fits_never_deadlocks():
    sched = make_scheduler(num_blocks=3, block_size=4)
    a = make_seq(4, max_tokens=8)  # 12 tokens = exactly the 3 blocks
    sched.add(a)
    steps = 0
    while not sched.is_finished():
        run_step(sched)
        steps += 1
    assert steps == 8 and a.num_completion_tokens == 8 and sched.num_preemptions == 0


def test_finished_sequences_release_their_blocks_and_leave_running():
    sched = make_scheduler()
    a = make_seq(5, max_tokens=1)
    sched.add(a)
    _, _, _, finished = run_step(sched, token=EOS)
    assert finished == [a] and a.finish_reason == "stop"
    assert not sched.running and sched.block_manager.num_free_blocks == 16


def test_prefix_cache_hit_skips_computed_tokens():
    sched = make_scheduler(block_size=4)
    a = make_seq(9, max_tokens=1)
    sched.add(a)
    run_step(sched)
    b = make_seq(9, max_tokens=1)  # same prompt
    sched.add(b)
    seqs, _, scheduled, _ = run_step(sched)
    assert seqs == [b] and b.num_cached_tokens == 8 and scheduled == [1]
