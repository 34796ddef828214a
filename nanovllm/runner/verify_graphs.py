"""The decode CUDA graph sets: the decode graphs, and beside them speculative decoding's verification set.

A verification step computes, for each sequence, its last token and its k drafts, and samples at each of
those positions (engine/step.py, StepBatch.spec_token_ids). For attention that is k + 1 decode rows a
sequence: row j holds position p + j, attends to a context of p + j + 1 and shares the sequence's block
table; every row samples, in the order the step's logits are sampled. So the decode graphs' kernels serve
it as they are, with one condition: rows of one sequence read each other's keys and values in the same
step, so every row's K/V must be stored before any row attends. The fused decode kernels (norm, rotary,
store and attention in one, taken up to 32 rows) do not order that; a second graph set, captured with
AttentionMetadata.rows_share_sequences, runs the store-then-attend path. It shares the decode graphs'
memory pool (the two never run at once) and is sized for the most rows verification can have:
disable_by_batch_size sequences x (k + 1).

Steps that also prefill (a prompt chunk, prompt logprobs) stay on the prefill path (piecewise graphs or
eager), as does a verification larger than the graphs. An eager step of k + 1 tokens a sequence cost
about ten graph replays on an H200; in these graphs a one-stream copy workload with n-gram drafts went
from 0.42x to 1.5x plain decoding at k = 3 (docs/performance-notes.md, "Speculative decoding"). A draft
model's runner captures the set too, for its catch-up steps (nanovllm/speculative/draft.py)."""

import torch
from torch import nn

from nanovllm.config import Config
from nanovllm.engine.step import StepBatch
from nanovllm.runner.cuda_graph import HEAD_GRAPH_MAX_ROWS, DecodeGraphs, Race


def as_decode_rows(batch: StepBatch) -> StepBatch | None:
    """A verification step as a decode step of one row per verified position (sequence by sequence, the
    last token first: the order its logits are sampled in), same tokens, slots and sampling; None where
    the step is not verification alone."""
    if (not batch.spec_token_ids or batch.prompt_logprob_spans
            or len(batch.sample_rows) != batch.num_seqs):  # a sequence that does not sample prefills
        return None
    cu = batch.cu_seqlens_q
    seqlens_k: list[int] = []
    tables: list[list[int]] = []
    for i, (drafts, seqlen, table) in enumerate(zip(batch.spec_token_ids, batch.seqlens_k,
                                                     batch.block_tables, strict=True)):
        num = cu[i + 1] - cu[i]
        if num != 1 + len(drafts):  # computes more than its last token and drafts: a prompt's end
            return None
        seqlens_k.extend(range(seqlen - num + 1, seqlen + 1))
        tables.extend([table] * num)
    rows = len(batch.input_ids)
    # A token the previous step is still sampling (overlap scheduling) keeps its index: one token a row.
    return StepBatch(False, batch.input_ids, batch.positions, batch.slot_mapping, list(range(rows + 1)),
                     seqlens_k, tables, list(range(rows)), batch.sampling,
                     prev_token_indices=batch.prev_token_indices, prev_token_rows=batch.prev_token_rows)


def verify_graph_rows(config: Config, max_rows: int) -> int:
    """The most decode rows a verification step can have (at most max_rows, the decode graphs')."""
    spec = config.speculative_config
    sequences = spec.disable_by_batch_size or config.max_num_seqs
    return min(max_rows, sequences * (1 + spec.num_speculative_tokens))


def capture_decode_graphs(model: nn.Module, config: Config, max_batch: int, max_blocks: int,
                          dtype: torch.dtype, device: torch.device, race: Race | None
                          ) -> tuple[DecodeGraphs, DecodeGraphs | None]:
    """The decode graphs, captured, and where speculative_config is set the verification set beside them
    (None otherwise)."""
    # Under tensor parallelism the LM head gathers across ranks: it stays out of the graphs.
    head_rows = HEAD_GRAPH_MAX_ROWS if config.tensor_parallel_size == 1 else 0
    hidden_size = config.hf_config.hidden_size
    graphs = DecodeGraphs(model, max_batch, max_blocks, hidden_size, dtype, device, head_rows=head_rows,
                          race=race)
    graphs.capture()
    if config.speculative_config is None:
        return graphs, None
    verify = DecodeGraphs(model, verify_graph_rows(config, max_batch), max_blocks, hidden_size, dtype, device,
                          head_rows=head_rows, race=race, shared_rows=True, pool=graphs.pool)
    verify.capture()
    return graphs, verify


def route(batch: StepBatch, graphs: DecodeGraphs | None, verify: DecodeGraphs
          ) -> tuple[StepBatch, DecodeGraphs | None]:
    """(the batch to run, the graphs to run it in) for a step with drafts: as decode rows in the
    verification graphs where it fits them, else as it is, with the decode graphs (which take no prefill
    step: it runs the prefill path)."""
    rows = as_decode_rows(batch)
    if rows is not None and verify.can_run(rows.num_seqs):
        return rows, verify
    return batch, graphs
