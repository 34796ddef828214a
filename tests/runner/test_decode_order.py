"""The order the decode kernel starts its rows in (AttentionMetadata.decode_order): the decoding rows by
context length, longest first, built with the step's inputs; in the decode graphs' static buffer a
permutation of every row at all times, padding rows last."""

import torch
from torch import nn

from nanovllm.engine.step import StepBatch
from nanovllm.runner.cuda_graph import DecodeGraphs
from nanovllm.runner.inputs import model_inputs
from nanovllm.runner.transfers import Uploads

CPU = torch.device("cpu")


def decode_batch(seqlens: list[int]) -> StepBatch:
    n = len(seqlens)
    return StepBatch(is_prefill=False, input_ids=[1] * n, positions=[k - 1 for k in seqlens],
                     slot_mapping=list(range(n)), cu_seqlens_q=list(range(n + 1)), seqlens_k=seqlens,
                     block_tables=[[i] for i in range(n)], sample_rows=list(range(n)), sampling=None)


def test_a_decode_step_orders_every_row_longest_first():
    meta = model_inputs(decode_batch([5, 40, 17, 40]), CPU).meta
    assert meta.decode_order.dtype == torch.int32
    assert meta.decode_order.tolist() == [1, 3, 2, 0]  # ties keep their order


def test_a_mixed_step_orders_only_its_decoding_rows():
    # Two decoding rows (one token each), then a 3-token prefill chunk with a cached prefix.
    batch = StepBatch(is_prefill=True, input_ids=[1, 2, 3, 4, 5], positions=[8, 30, 4, 5, 6],
                      slot_mapping=[0, 1, 2, 3, 4], cu_seqlens_q=[0, 1, 2, 5], seqlens_k=[9, 31, 7],
                      block_tables=[[0], [1], [2]], sample_rows=[0, 1, 2], sampling=None)
    meta = model_inputs(batch, CPU).meta
    assert meta.num_decode_rows == 2 and meta.decode_order.tolist() == [1, 0]


class RecordingModel(nn.Module):
    """Stands in for the model: records the decode order each forward sees."""

    def __init__(self) -> None:
        super().__init__()
        self.orders = []

    def forward(self, input_ids, positions, meta):
        self.orders.append(meta.decode_order.tolist())
        return torch.zeros(input_ids.shape[0], 8)


def run(graphs: DecodeGraphs, batch: StepBatch) -> None:
    """A decode step the way the model runner takes it through the graphs (here eagerly)."""
    uploads = Uploads(CPU, 0)
    uploads.begin()
    staged = graphs.stage(batch, uploads)
    uploads.flush()
    graphs.replay(staged)


def test_decode_graph_buffers_hold_a_permutation_with_padding_rows_last():
    model = RecordingModel()
    graphs = DecodeGraphs(model, 4, 2, 8, torch.float32, CPU, use_cuda_graph=False, batch_sizes=[1, 4])
    assert graphs.decode_order.tolist() == [0, 1, 2, 3]  # what a capture would run with
    run(graphs, decode_batch([3, 9, 6]))
    assert model.orders[-1] == [1, 2, 0, 3]  # padded to 4 rows: the padding row starts last
    run(graphs, decode_batch([12]))
    assert model.orders[-1] == [0]


class HeadModel(RecordingModel):
    """RecordingModel with an LM head over a 5-token vocabulary: each row's logits are its hidden sum
    plus the token id."""

    def forward(self, input_ids, positions, meta):
        super().forward(input_ids, positions, meta)
        return positions.float().unsqueeze(1).expand(-1, 8).clone()

    def compute_logits(self, hidden):
        return hidden.sum(-1, keepdim=True) + torch.arange(5.0)


def test_small_decode_graphs_return_their_logits_and_larger_ones_none():
    graphs = DecodeGraphs(HeadModel(), 8, 2, 8, torch.float32, CPU, use_cuda_graph=False,
                          batch_sizes=[1, 4, 8], head_rows=4)
    uploads = Uploads(CPU, 0)
    # One row; three padded to the 4-row graph (with the head); five padded to the 8-row one (without).
    for seqlens, has_logits in (([12], True), ([3, 9, 6], True), ([3, 9, 6, 4, 7], False)):
        uploads.begin()
        staged = graphs.stage(decode_batch(seqlens), uploads)
        uploads.flush()
        out = graphs.replay(staged)
        hidden, logits = out.hidden, out.logits
        assert out.sampled is None  # built without a race: the runner samples
        assert hidden.shape == (len(seqlens), 8)
        if has_logits:  # the head's rows for the step's sequences, not the padding
            assert logits.shape == (len(seqlens), 5)
            torch.testing.assert_close(logits, graphs.model.compute_logits(hidden))
        else:
            assert logits is None
