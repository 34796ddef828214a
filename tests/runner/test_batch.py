"""The per-step batch record: what each scheduled sequence computes, where its K/V goes, which rows
sample, and that the largest record fits the tensor-parallel step channel."""

import pickle
from dataclasses import replace
from types import SimpleNamespace

import torch

from nanovllm.distributed.worker import CHANNEL_SLACK_BYTES, channel_size
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.step import build_batch, slots
from nanovllm.runner.inputs import NUMPY_FROM, model_inputs, to_device
from nanovllm.sampling_params import SamplingParams

BLOCK = 4


def scheduled(n_tokens: int, computed: int, scheduled_tokens: int, block_table: list[int],
              **params) -> Sequence:
    seq = Sequence(list(range(100, 100 + n_tokens)), SamplingParams(**params), block_size=BLOCK)
    seq.num_computed_tokens, seq.num_scheduled_tokens = computed, scheduled_tokens
    seq.block_table = block_table
    return seq


def test_prefill_with_cached_prefix_and_a_partial_chunk():
    seqs = [scheduled(10, computed=4, scheduled_tokens=6, block_table=[7, 3, 9]),  # prefix hit, completes
            scheduled(13, computed=0, scheduled_tokens=5, block_table=[1, 2, 5, 6])]  # first chunk: no sample
    batch = build_batch(seqs, is_prefill=True)
    assert batch.input_ids == list(range(104, 110)) + list(range(100, 105))
    assert batch.positions == [4, 5, 6, 7, 8, 9, 0, 1, 2, 3, 4]
    # slot = block_table[pos // 4] * 4 + pos % 4
    assert batch.slot_mapping == [12, 13, 14, 15, 36, 37, 4, 5, 6, 7, 8]
    assert batch.cu_seqlens_q == [0, 6, 11] and batch.seqlens_k == [10, 5]
    assert batch.sample_rows == [0] and batch.logits_indices == [5]


def test_decode_computes_the_last_token_and_mixes_seeds_with_the_token_index():
    seqs = [scheduled(9, computed=8, scheduled_tokens=1, block_table=[0, 4, 2], seed=5, temperature=0.7),
            scheduled(4, computed=3, scheduled_tokens=1, block_table=[7], top_k=3)]
    seqs[0].num_prompt_tokens = 6  # three completion tokens so far
    batch = build_batch(seqs, is_prefill=False)
    assert batch.input_ids == [108, 103] and batch.positions == [8, 3]
    assert batch.slot_mapping == [8, 31] and batch.seqlens_k == [9, 4]
    assert batch.sample_rows == [0, 1] and batch.logits_indices == [0, 1]
    assert batch.sampling.temperatures == [0.7, 1.0] and batch.sampling.top_ks == [-1, 3]
    other_step = build_batch([scheduled(9, 8, 1, [0, 4, 2], seed=5)], is_prefill=False)
    assert batch.sampling.seeds[0] != other_step.sampling.seeds[0] and batch.sampling.seeds[1] is None


def test_a_mixed_batch_counts_its_leading_decoding_rows():
    seqs = [scheduled(9, computed=8, scheduled_tokens=1, block_table=[0, 4, 2]),
            scheduled(4, computed=3, scheduled_tokens=1, block_table=[7]),
            scheduled(10, computed=4, scheduled_tokens=6, block_table=[7, 3, 9]),
            scheduled(6, computed=5, scheduled_tokens=1, block_table=[8, 1])]  # a prompt's last token
    meta = model_inputs(build_batch(seqs, is_prefill=True), torch.device("cpu")).meta
    assert meta.num_decode_rows == 2 and meta.max_seqlen_q == 6
    assert model_inputs(build_batch(seqs[:2], is_prefill=True), torch.device("cpu")).meta.num_decode_rows == 2


def test_long_prefill_inputs_equal_their_lists():
    # Past NUMPY_FROM values a list goes through numpy: the tensors must hold the same values and dtypes.
    n = NUMPY_FROM + 37
    seq = scheduled(n, computed=0, scheduled_tokens=n, block_table=list(range(-(-n // BLOCK))))
    batch = build_batch([seq], is_prefill=True)
    inputs = model_inputs(batch, torch.device("cpu"), num_padded=n + 27)
    assert inputs.input_ids.dtype == inputs.positions.dtype == inputs.meta.slot_mapping.dtype == torch.int64
    assert inputs.input_ids.tolist() == batch.input_ids + [0] * 27
    assert inputs.positions.tolist() == batch.positions + [0] * 27
    assert inputs.meta.slot_mapping.tolist() == batch.slot_mapping + [-1] * 27
    for values, dtype in (([2**40, -1] * NUMPY_FROM, torch.int64), ([7, -3] * NUMPY_FROM, torch.int32),
                          ([0.5, 2.0] * NUMPY_FROM, torch.float32), ([1, 2], torch.int32)):
        out = to_device(values, dtype, torch.device("cpu"))
        assert out.dtype == dtype and out.tolist() == values


def test_slots_cross_block_boundaries():
    assert slots([5, 2], 2, 7, block_size=4) == [22, 23, 8, 9, 10]
    assert slots([5, 2], 7, 8, block_size=4) == [11]


def test_the_largest_step_fits_the_channel():
    config = SimpleNamespace(max_num_batched_tokens=512, max_num_seqs=8, max_model_len=256,
                             kvcache_block_size=1)
    seqs = []
    chunk = config.max_num_batched_tokens // config.max_num_seqs
    for i in range(config.max_num_seqs):  # every sequence at full length, ids as large as they get
        seq = Sequence([2**31 - 1] * config.max_model_len,
                       SamplingParams(temperature=0.123456789, top_p=0.987654321, seed=2**62,
                                      prompt_logprobs=20), block_size=1)
        seq.num_computed_tokens = config.max_model_len - chunk
        seq.prompt_logprobs = [None] * (seq.num_computed_tokens + 1)  # the chunk computes prompt logprobs
        seq.num_scheduled_tokens = chunk
        seq.block_table = [2**31 - 1 - i] * config.max_model_len
        seqs.append(seq)
    batch = build_batch(seqs, True)
    assert sum(len(span.target_ids) for span in batch.prompt_logprob_spans) == (chunk - 1) * len(seqs)
    # What the workers get: the record without its sampling part (nanovllm.distributed.worker).
    message = pickle.dumps(("run", (replace(batch, sampling=None),)), protocol=pickle.HIGHEST_PROTOCOL)
    assert len(message) <= channel_size(config) - CHANNEL_SLACK_BYTES  # fits without the slack


def test_prompt_logprob_spans_and_processor_rows():
    params = SamplingParams(prompt_logprobs=2, repetition_penalty=1.2, min_tokens=2, stop_token_ids=[7])
    seq = Sequence(list(range(10, 20)), params, block_size=4)  # a 10-token prompt
    seq.block_table, seq.min_tokens_stop_ids = [0, 1, 2], [7]
    other = Sequence([1, 2, 3], block_size=4)
    other.block_table = [3]
    other.num_scheduled_tokens, seq.num_scheduled_tokens = 3, 6  # seq: a first chunk, positions 0..5
    batch = build_batch([other, seq], is_prefill=True)
    (span,) = batch.prompt_logprob_spans
    assert (span.row, span.start, span.num_logprobs) == (1, 3, 2)
    assert span.target_ids == list(range(11, 17))  # position p predicts prompt token p + 1
    assert batch.sample_rows == [0] and batch.sampling.processors is None  # `other` uses none
    # The last chunk: the last prompt position predicts the first generated token, not a prompt one.
    seq.prompt_logprobs.extend([{}] * 6)
    seq.num_computed_tokens, seq.num_scheduled_tokens = 6, 4
    batch = build_batch([seq], is_prefill=True)
    (span,) = batch.prompt_logprob_spans
    assert span.start == 0 and span.target_ids == [17, 18, 19]
    (row,) = batch.sampling.processors
    assert row.penalties == (1.2, 0.0, 0.0) and row.banned_token_ids == [7]  # min_tokens masks stop ids
    assert row.prompt_token_ids == list(range(10, 20)) and row.output_token_ids == []
    assert batch.sampling.num_logprobs == [None]
