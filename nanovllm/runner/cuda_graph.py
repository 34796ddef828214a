"""CUDA graphs for decode: the model's decode forward is captured once per batch size of a ladder
up to the largest decode batch the scheduler can form, and replayed with the batch padded up to the
next captured size (padded rows store no KV and attend to nothing). Block tables are sized for
max_model_len, so every sequence the scheduler admits fits.

A step's inputs are written into a slot of the runner's uploads (runner/transfers.py), laid out like the
graphs' static device buffer, and copied on a stream of their own; one kernel before the replay
(kernels/decode_inputs.py) moves them into the static buffer and, with overlap scheduling, puts the
previous step's sampled ids in place from the prev_rows field. So a decode step costs the compute
stream one small kernel and one graph launch.

The graphs of up to `head_rows` rows hold the LM head too, and given `race` (the fused sampler,
kernels/sample_race.py) they sample as well. A decode step's host work runs beside the device's previous
step (overlap scheduling), and at one row it took ~650 us of a ~810 us step, the LM head's launch 125 of
it and the sampler's (its parameters' upload, its two Triton launches) ~145: a step whose host work ran
late left the device idle (single streams 0.82-0.95 ms/token on different machines,
docs/performance-notes.md, "Host overhead").
A step whose rows ask for nothing but a temperature (and seed) takes the graph's tokens; the others
(top-k, top-p, min-p, logprobs, logits processors) sample eagerly from the graph's logits.

The graph's tokens land in one of two output slots that alternate from step to step (the out_rows
field says where): a slot's copy to the host, on its own stream, may still be running when the next step
replays, but the engine waits for a step before it launches the one after the next (overlap scheduling
holds at most one step in flight), so a slot is never rewritten before its tokens were read. The host
side of the copy is a pinned pair of slots too, free of a pinned allocation a step."""

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from nanovllm.attention.metadata import AttentionMetadata
from nanovllm.engine.step import StepBatch
from nanovllm.layers.parallel import get_tp_group
from nanovllm.runner.inputs import longest_first
from nanovllm.runner.transfers import Uploads

logger = logging.getLogger("nanovllm")

# Small batches get their own graphs (padding 3 rows onto 1 would cost 4x the work); beyond them a
# graph every 16 rows keeps the padding waste under 16 rows while capture stays quick.
SMALL_BATCH_SIZES = (1, 2, 4, 8)
BATCH_SIZE_STEP = 16
# The graphs of up to this many rows compute the logits too (a single rank's): their launch is where the
# host's time per step matters, and their logits stay small (8 rows of Qwen3's vocabulary: 2.4 MB).
HEAD_GRAPH_MAX_ROWS = 8
# Per-row fields of the static buffer, int32 words each: input_ids, positions, slot_mapping, seqlens_k,
# decode_order, prev_rows (the row of the previous step's sampled ids that is the row's input, or -1),
# out_rows (where the graph's sampler puts the row's token), temperatures (float32 bits); then each row's
# Philox seed (int64: two words, 8-byte aligned as the fields before it are an even count).
NUM_ROW_FIELDS = 8
NUM_ROW_WORDS = NUM_ROW_FIELDS + 2
# Output slots of the graphs' sampled ids (see the module's docstring).
NUM_OUT_SLOTS = 2

# The fused race with a static output: (logits, temperatures, seeds, out=, out_rows=) -> out.
Race = Callable[..., torch.Tensor]


@dataclass(slots=True)
class StagedStep:
    """A decode step's inputs on their way: `DecodeGraphs.replay` runs it once the uploads are flushed."""

    num_seqs: int
    padded: int  # the captured batch size it runs at
    inputs: torch.Tensor  # the uploaded copy of the static buffer's used part (int32)
    takes_previous: bool  # some row's input is a token the previous step sampled
    out_start: int | None = None  # where in the output slots its graph's tokens are, when they are used


@dataclass(slots=True)
class GraphOutput:
    """What a replay leaves for the runner. The next replay rewrites every tensor here except the sampled
    ids (see the module's docstring): read them before then."""

    hidden: torch.Tensor  # [num_seqs, hidden]
    logits: torch.Tensor | None  # [num_seqs, vocab] from a graph with the LM head
    sampled: torch.Tensor | None  # [num_seqs] int64, when the step took the graph's tokens
    sampled_host: torch.Tensor | None  # pinned [num_seqs] int64 for their copy (None on the CPU)


def staging_bytes(max_batch_size: int, max_blocks_per_seq: int) -> int:
    """The most a decode step uploads: StagedStep.inputs at the largest batch (int32)."""
    return 4 * (NUM_ROW_WORDS + max_blocks_per_seq) * max_batch_size


def graph_batch_sizes(max_batch_size: int) -> list[int]:
    sizes = [b for b in SMALL_BATCH_SIZES if b < max_batch_size]
    sizes += range(BATCH_SIZE_STEP, max_batch_size, BATCH_SIZE_STEP)
    return sorted(set(sizes) | {max_batch_size})


class DecodeGraphs:
    def __init__(
        self,
        model: nn.Module,
        max_batch_size: int,
        max_blocks_per_seq: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
        use_cuda_graph: bool = True,
        batch_sizes: list[int] | None = None,
        head_rows: int = 0,
        race: Race | None = None,
        shared_rows: bool = False,
        pool: tuple | None = None,
    ) -> None:
        """use_cuda_graph=False runs the same padded static-buffer path eagerly (tests on CPU).
        head_rows: the graphs of up to this many rows also compute the logits (model.compute_logits), and
        given race, sample from them. shared_rows: rows may be positions of one sequence (speculative
        verification, runner/verify_graphs.py; AttentionMetadata.rows_share_sequences). pool: capture
        into another graph set's memory pool (never replayed at the same time as this one)."""
        self.model = model
        self.batch_sizes = batch_sizes or graph_batch_sizes(max_batch_size)
        assert self.batch_sizes[-1] == max_batch_size, "the ladder must end at the largest batch"
        self.max_batch_size = b = max_batch_size
        self.width = max_blocks_per_seq
        # |input_ids|positions|slot_mapping|seqlens_k|decode_order|prev_rows|out_rows|temperatures| (b each)
        # |seeds (b int64)|block_tables (b x width)|, int32 words
        self.static = torch.zeros(staging_bytes(b, max_blocks_per_seq) // 4, dtype=torch.int32, device=device)
        fields = self.static[: NUM_ROW_FIELDS * b].view(NUM_ROW_FIELDS, b)
        (self.input_ids, self.positions, self.slot_mapping, self.seqlens_k, self.decode_order,
         self.prev_rows, self.out_rows, temperatures) = fields
        self.temperatures = temperatures.view(torch.float32)
        self.seeds = self.static[NUM_ROW_FIELDS * b : NUM_ROW_WORDS * b].view(torch.int64)
        self.block_tables = self.static[NUM_ROW_WORDS * b :].view(b, max_blocks_per_seq)
        # A permutation from the start (capture runs the kernels too): rows sharing an index would race.
        self.decode_order.copy_(torch.arange(b, dtype=torch.int32))
        self.out_rows.copy_(torch.arange(b, dtype=torch.int32))
        self.hidden = torch.zeros(b, hidden_size, dtype=dtype, device=device)
        self.head_rows = head_rows
        # Batch size -> the logits its graph writes (memory of the graph's pool, rewritten by each replay).
        self.logits: dict[int, torch.Tensor] = {}
        self.race = race if head_rows else None
        # The graphs' sampled ids, NUM_OUT_SLOTS slots of b, outside the graphs' pool (no graph's
        # temporaries may share their memory), and a pinned copy on the host; the slot of the next step.
        self.sampled = torch.zeros(NUM_OUT_SLOTS * b, dtype=torch.int64, device=device)
        self.sampled_host = (torch.zeros(NUM_OUT_SLOTS * b, dtype=torch.int64, pin_memory=True)
                             if device.type == "cuda" and self.race is not None else None)
        self.out_slot = 0
        self.no_tokens = torch.zeros(1, dtype=torch.int64, device=device)  # "sampled" of a step without any
        self.use_cuda_graph = use_cuda_graph
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = pool
        self.shared_rows = shared_rows

    def _meta(self, batch_size: int) -> AttentionMetadata:
        return AttentionMetadata(
            is_prefill=False,
            slot_mapping=self.slot_mapping[:batch_size],
            seqlens_k=self.seqlens_k[:batch_size],
            block_tables=self.block_tables[:batch_size],
            max_seqlen_k=self.width,
            decode_order=self.decode_order[:batch_size],
            rows_share_sequences=self.shared_rows,
        )

    def _run_model(self, batch_size: int) -> None:
        meta = self._meta(batch_size)
        self.hidden[:batch_size] = self.model(self.input_ids[:batch_size], self.positions[:batch_size], meta)
        if batch_size <= self.head_rows:
            logits = self.logits[batch_size] = self.model.compute_logits(self.hidden[:batch_size])
            if self.race is not None:
                self.race(logits, self.temperatures[:batch_size], self.seeds[:batch_size], out=self.sampled,
                          out_rows=self.out_rows[:batch_size])

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture largest first, so the smaller graphs reuse the largest one's memory pool."""
        self.slot_mapping.fill_(-1)  # captured with empty batches: nothing is stored, nothing read
        # Builds the kernel that moves each step's inputs in (kernels/decode_inputs.py), not mid-run.
        self._place(self.static[: NUM_ROW_WORDS * self.max_batch_size].clone(), 0, self.no_tokens)
        for batch_size in reversed(self.batch_sizes):
            self._run_model(batch_size)  # warm-up: compiles and autotunes outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, self.pool):
                self._run_model(batch_size)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[batch_size] = graph
        torch.cuda.synchronize()
        group = get_tp_group()
        if group is not None and group.world_size > 1:  # the graphs hold the group's collectives
            group.before_destroy(self.release)
        logger.debug(
            "captured %d decode CUDA graphs for batch sizes up to %d", len(self.graphs), self.max_batch_size
        )

    def release(self) -> None:
        """Free the graphs and their memory pool; decode runs eagerly from then on. Idempotent."""
        if self.graphs:
            torch.cuda.synchronize()  # no replay may still be running on the GPU
            self.graphs.clear()
            self.logits.clear()
            self.pool = None

    def can_run(self, batch_size: int) -> bool:
        return batch_size <= self.max_batch_size and (bool(self.graphs) or not self.use_cuda_graph)

    def padded_size(self, batch_size: int) -> int:
        """The smallest captured size >= batch_size, which its step runs at."""
        return next(size for size in self.batch_sizes if size >= batch_size)

    def samples(self, batch_size: int) -> bool:
        """Whether the graph a batch of this size runs in samples (given the rows' parameters, stage)."""
        return self._samples_at(self.padded_size(batch_size))

    def _samples_at(self, padded: int) -> bool:
        return self.race is not None and padded <= self.head_rows

    def stage(self, batch: StepBatch, uploads: Uploads,
              race_rows: tuple[list[float], list[int]] | None = None) -> StagedStep:
        """Write the batch's inputs into this step's uploads, padded to the smallest captured size >= its
        number of sequences. race_rows: (temperatures, Philox seeds) of the rows where the step takes
        the graph's tokens (StepSampler.race_rows; only where `samples`)."""
        n, b, width = batch.num_seqs, self.max_batch_size, self.width
        padded = self.padded_size(n)
        host, inputs = uploads.reserve(NUM_ROW_WORDS * b + padded * width, torch.int32)
        host[:n] = batch.input_ids
        host[b : b + n] = batch.positions
        host[2 * b : 2 * b + n] = batch.slot_mapping
        host[3 * b : 3 * b + n] = batch.seqlens_k
        host[4 * b : 4 * b + n] = longest_first(host[3 * b : 3 * b + n])
        tables = host[NUM_ROW_WORDS * b :].reshape(padded, width)
        tables[:] = 0  # no kernel may meet another step's bytes as block ids
        for seq_row, table in enumerate(batch.block_tables):
            tables[seq_row, : len(table)] = table
        # The slot holds another step's bytes: every field is written up to `padded` (the graph reads no
        # further). Padding rows embed token 0 at position 0, store nothing, attend to nothing (started
        # last), take no previous token and sample greedily.
        host[n:padded] = 0
        host[b + n : b + padded] = 0
        host[2 * b + n : 2 * b + padded] = -1
        host[3 * b + n : 3 * b + padded] = 0
        host[4 * b + n : 4 * b + padded] = np.arange(n, padded)
        host[5 * b : 5 * b + padded] = -1
        # A decode row holds one token: a pending token's index in input_ids is its row.
        host[5 * b + np.asarray(batch.prev_token_indices, dtype=np.int64)] = batch.prev_token_rows
        out_start = None
        if self._samples_at(padded):  # this graph samples, its tokens used or not
            out_start = self.out_slot * b
            self.out_slot = (self.out_slot + 1) % NUM_OUT_SLOTS
            host[6 * b : 6 * b + padded] = np.arange(out_start, out_start + padded)
            temperatures = host[7 * b : 8 * b].view(np.float32)
            seeds = host[8 * b : 10 * b].view(np.int64)
            temperatures[:padded] = 0.0
            seeds[:padded] = 0
            if race_rows is not None:
                temperatures[:n], seeds[:n] = race_rows
            else:
                out_start = None  # the runner samples from the logits
        return StagedStep(n, padded, inputs, bool(batch.prev_token_rows), out_start)

    def replay(self, step: StagedStep, prev_sampled: torch.Tensor | None = None) -> GraphOutput:
        """Run a staged step (after its uploads' flush). prev_sampled: the previous step's sampled ids on
        the device, which the prev_rows field indexes."""
        if step.takes_previous:
            assert prev_sampled is not None, "the batch takes tokens from a previous step but got none"
        self._place(step.inputs, step.num_seqs, prev_sampled if step.takes_previous else self.no_tokens)
        if self.use_cuda_graph:
            self.graphs[step.padded].replay()
        else:
            self._run_model(step.padded)
        n, logits = step.num_seqs, self.logits.get(step.padded)
        sampled = sampled_host = None
        if step.out_start is not None:
            sampled = self.sampled[step.out_start : step.out_start + n]
            if self.sampled_host is not None:
                sampled_host = self.sampled_host[step.out_start : step.out_start + n]
        return GraphOutput(self.hidden[:n], None if logits is None else logits[:n], sampled, sampled_host)

    def _place(self, inputs: torch.Tensor, num_seqs: int, sampled: torch.Tensor) -> None:
        prev_offset = 5 * self.max_batch_size
        if inputs.device.type == "cuda":
            from nanovllm.kernels.decode_inputs import place_decode_inputs  # GPU only: imports Triton
            place_decode_inputs(self.static, inputs, num_seqs, prev_offset, sampled.long())
            return
        self.static[: inputs.numel()] = inputs
        rows = inputs[prev_offset : prev_offset + num_seqs]
        take = rows >= 0
        self.input_ids[:num_seqs][take] = sampled[rows[take].long()].to(torch.int32)
