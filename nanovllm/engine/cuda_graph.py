"""CUDA graphs for decode: the model's decode forward is captured once per batch size of a ladder
up to the largest decode batch the scheduler can form, and replayed with the batch padded up to the
next captured size (padded rows store no KV and attend to nothing). Block tables are sized for
max_model_len, so every sequence the scheduler admits fits."""

import logging

import torch
from torch import nn

from nanovllm.attention.metadata import AttentionMetadata, forward_context
from nanovllm.engine.model_inputs import ModelInputs

logger = logging.getLogger("nanovllm")

# Small batches get their own graphs (padding 3 rows onto 1 would cost 4x the work); beyond them a
# graph every 16 rows keeps the padding waste under 16 rows while capture stays quick.
SMALL_BATCH_SIZES = (1, 2, 4, 8)
BATCH_SIZE_STEP = 16


def graph_batch_sizes(max_batch_size: int) -> list[int]:
    sizes = [b for b in SMALL_BATCH_SIZES if b < max_batch_size]
    sizes += range(BATCH_SIZE_STEP, max_batch_size, BATCH_SIZE_STEP)
    return sorted(set(sizes) | {max_batch_size})


class DecodeGraphs:
    def __init__(self, model: nn.Module, max_batch_size: int, max_blocks_per_seq: int, hidden_size: int,
                 dtype: torch.dtype, device: torch.device, use_cuda_graph: bool = True,
                 batch_sizes: list[int] | None = None) -> None:
        """use_cuda_graph=False runs the same padded static-buffer path eagerly (tests on CPU)."""
        self.model = model
        self.batch_sizes = batch_sizes or graph_batch_sizes(max_batch_size)
        assert self.batch_sizes[-1] == max_batch_size, "the ladder must end at the largest batch"
        self.max_batch_size = max_batch_size
        b = max_batch_size
        self.input_ids = torch.zeros(b, dtype=torch.int64, device=device)
        self.positions = torch.zeros(b, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((b,), -1, dtype=torch.int64, device=device)
        self.seqlens_k = torch.zeros(b, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(b, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.hidden = torch.zeros(b, hidden_size, dtype=dtype, device=device)
        self.use_cuda_graph = use_cuda_graph
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None

    def _meta(self, batch_size: int) -> AttentionMetadata:
        return AttentionMetadata(is_prefill=False, slot_mapping=self.slot_mapping[:batch_size],
                                 seqlens_k=self.seqlens_k[:batch_size],
                                 block_tables=self.block_tables[:batch_size],
                                 max_seqlen_k=self.block_tables.shape[1])

    def _run_model(self, batch_size: int) -> None:
        with forward_context(self._meta(batch_size)):
            self.hidden[:batch_size] = self.model(self.input_ids[:batch_size], self.positions[:batch_size])

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture largest first, so the smaller graphs reuse the largest one's memory pool."""
        for batch_size in reversed(self.batch_sizes):
            self._run_model(batch_size)  # warm-up: lets kernels autotune and allocate outside capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, self.pool):
                self._run_model(batch_size)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[batch_size] = graph
        torch.cuda.synchronize()
        logger.info("captured %d decode CUDA graphs for batch sizes up to %d", len(self.graphs),
                    self.max_batch_size)

    def can_run(self, batch_size: int) -> bool:
        return batch_size <= self.max_batch_size

    def run(self, inputs: ModelInputs) -> torch.Tensor:
        """Decode through the graph of the smallest captured size >= the batch; returns the hidden
        states [batch_size, hidden]."""
        n = inputs.input_ids.shape[0]
        padded = next(b for b in self.batch_sizes if b >= n)
        meta = inputs.meta
        self.input_ids[:n] = inputs.input_ids
        self.positions[:n] = inputs.positions
        self.slot_mapping[:n] = meta.slot_mapping
        self.slot_mapping[n:padded] = -1
        self.seqlens_k[:n] = meta.seqlens_k
        self.seqlens_k[n:padded] = 0
        self.block_tables[:n, :meta.block_tables.shape[1]] = meta.block_tables
        if self.use_cuda_graph:
            self.graphs[padded].replay()
        else:
            self._run_model(padded)
        return self.hidden[:n]
