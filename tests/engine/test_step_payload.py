"""A worker rebuilds exactly rank 0's model inputs from the step payload, which carries only the
scheduled tokens."""

import pickle
from types import SimpleNamespace

import pytest
import torch

from nanovllm.engine.model_inputs import prepare_decode, prepare_prefill
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.step_payload import pack_step, unpack_step
from nanovllm.engine.tp_worker import CHANNEL_SLACK_BYTES, channel_size

BLOCK = 4
CPU = torch.device("cpu")


def scheduled(n_tokens: int, computed: int, scheduled_tokens: int, first_block: int) -> Sequence:
    seq = Sequence(list(range(100, 100 + n_tokens)), block_size=BLOCK)
    seq.num_computed_tokens, seq.num_scheduled_tokens = computed, scheduled_tokens
    seq.block_table = list(range(first_block, first_block + seq.num_blocks))
    return seq


def assert_same_inputs(a, b):
    assert a.sample_rows == b.sample_rows
    for name in ("input_ids", "positions", "logits_indices"):
        torch.testing.assert_close(getattr(a, name), getattr(b, name))
    for name in ("slot_mapping", "seqlens_k", "block_tables", "cu_seqlens_q", "cu_seqlens_k"):
        x, y = getattr(a.meta, name), getattr(b.meta, name)
        assert (x is None and y is None) or torch.equal(x, y), name
    for name in ("is_prefill", "max_seqlen_q", "max_seqlen_k", "has_prefix", "cu_seqlens_q_host",
                 "seqlens_k_host"):
        assert getattr(a.meta, name) == getattr(b.meta, name), name


def roundtrip(seqs, is_prefill):
    payload = pickle.loads(pickle.dumps(pack_step(seqs, is_prefill)))  # as the channel carries it
    return unpack_step(payload, BLOCK)


def test_prefill_with_cached_prefix_and_a_partial_chunk():
    seqs = [scheduled(10, computed=4, scheduled_tokens=6, first_block=0),  # prefix cache hit, completes
            scheduled(13, computed=0, scheduled_tokens=5, first_block=5)]  # first chunk only: no sample
    stand_ins, is_prefill = roundtrip(seqs, True)
    assert is_prefill
    assert_same_inputs(prepare_prefill(seqs, CPU), prepare_prefill(stand_ins, CPU))
    assert [s.token_ids.tokens for s in stand_ins] == [list(range(104, 110)), list(range(100, 105))]


def test_decode_sends_one_token_per_sequence():
    seqs = [scheduled(9, computed=8, scheduled_tokens=1, first_block=0),
            scheduled(4, computed=3, scheduled_tokens=1, first_block=7)]
    stand_ins, is_prefill = roundtrip(seqs, False)
    assert not is_prefill
    assert_same_inputs(prepare_decode(seqs, CPU), prepare_decode(stand_ins, CPU))
    assert [s.token_ids.tokens for s in stand_ins] == [[108], [103]]


def test_reading_outside_the_scheduled_window_fails_loudly():
    (stand_in,), _ = roundtrip([scheduled(10, computed=4, scheduled_tokens=6, first_block=0)], True)
    assert stand_in.token_ids[4:10] == list(range(104, 110)) and stand_in.token_ids[-1] == 109
    with pytest.raises(AssertionError, match="outside the scheduled window"):
        stand_in.token_ids[0:4]
    with pytest.raises(AttributeError):
        _ = stand_in.sampling_params  # workers never sample


def test_the_largest_step_fits_the_channel():
    config = SimpleNamespace(max_num_batched_tokens=512, max_num_seqs=8, max_model_len=256,
                             kvcache_block_size=1)
    seqs = []
    for i in range(config.max_num_seqs):  # every sequence at full length, ids as large as they get
        seq = Sequence([2**31 - 1] * config.max_model_len, block_size=1)
        seq.num_computed_tokens = config.max_model_len - config.max_num_batched_tokens // config.max_num_seqs
        seq.num_scheduled_tokens = config.max_num_batched_tokens // config.max_num_seqs
        seq.block_table = [2**31 - 1 - i] * config.max_model_len
        seqs.append(seq)
    message = pickle.dumps(("run", (pack_step(seqs, True),)), protocol=pickle.HIGHEST_PROTOCOL)
    assert len(message) <= channel_size(config) - CHANNEL_SLACK_BYTES  # fits without the slack
