"""Eager steps on CUDA are padded to a few token counts (runner/inputs.py), which the runner's start-up
runs every linear layer at (runner/warm_up.py): the buckets must cover every count a step can have."""

import torch

from nanovllm.engine.step import StepBatch
from nanovllm.runner.inputs import PAD_MULTIPLE, model_inputs, padded_num_tokens, token_buckets


def test_every_token_count_pads_into_the_warmed_buckets():
    for max_tokens in (1, 3, PAD_MULTIPLE, PAD_MULTIPLE + 1, 1000, 16384):
        buckets = token_buckets(max_tokens)
        assert buckets == sorted(set(buckets)) and buckets[-1] == padded_num_tokens(max_tokens)
        for n in range(1, max_tokens + 1):
            assert n <= padded_num_tokens(n) < max(2 * n, n + PAD_MULTIPLE)
            assert padded_num_tokens(n) in buckets
    assert len(token_buckets(16384)) <= 16384 // PAD_MULTIPLE + 7  # few shapes for cuBLAS to meet


def test_padding_rows_store_nothing_and_the_metadata_keeps_the_real_tokens():
    batch = StepBatch(is_prefill=True, input_ids=[5, 6, 7], positions=[0, 1, 2], slot_mapping=[8, 9, 10],
                      cu_seqlens_q=[0, 3], seqlens_k=[3], block_tables=[[2]], sample_rows=[0], sampling=None)
    inputs = model_inputs(batch, torch.device("cpu"), padded_num_tokens(3))
    assert inputs.input_ids.tolist() == [5, 6, 7, 0]
    assert inputs.positions.tolist() == [0, 1, 2, 0]
    assert inputs.meta.slot_mapping.tolist() == [8, 9, 10, -1]
    assert inputs.meta.cu_seqlens_q.tolist() == [0, 3] and inputs.logits_indices.tolist() == [2]
    assert model_inputs(batch, torch.device("cpu")).input_ids.shape == (3,)
