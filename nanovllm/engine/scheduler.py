"""Scheduler: continuous batching over WAITING -> RUNNING -> FINISHED.

Each step is either a prefill step or a decode step; prefill goes first. A prefill step first
continues running sequences whose prompt is only partly computed, then admits waiting sequences,
all under `max_num_batched_tokens` (the last one chunked to fit). A decode step gives every running
sequence one token; when KV blocks run out, the most recently admitted sequences are preempted and
recomputed later. No request is ever dropped."""

from collections import deque

from nanovllm.config import Config
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.sequence import Sequence, SequenceStatus
from nanovllm.engine.stop_checker import StopChecker


class Scheduler:
    def __init__(self, config: Config, num_kvcache_blocks: int, stop_checker: StopChecker) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.block_manager = BlockManager(num_kvcache_blocks, config.kvcache_block_size,
                                          config.enable_prefix_caching)
        self.stop_checker = stop_checker
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> tuple[list[Sequence], bool]:
        """Pick the sequences of the next step and how many tokens each computes
        (seq.num_scheduled_tokens). Returns (sequences, is_prefill)."""
        scheduled = self._schedule_prefill()
        if scheduled:
            return scheduled, True
        return self._schedule_decode(), False

    def _schedule_prefill(self) -> list[Sequence]:
        budget, scheduled = self.max_num_batched_tokens, []
        for seq in self.running:  # continue chunked prefills first: they already hold their blocks
            if budget == 0:
                break
            if seq.is_prefilling:
                seq.num_scheduled_tokens = min(seq.num_uncomputed_tokens, budget)
                budget -= seq.num_scheduled_tokens
                scheduled.append(seq)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            # n > 1: a later completion waits (in order) until its leader computed the prompt's KV,
            # which it then shares through the prefix cache.
            if (seq.leader is not None and not seq.leader.prompt_computed
                    and self.block_manager.enable_prefix_caching):
                break
            if not self.block_manager.can_allocate(seq):
                break
            self.block_manager.allocate(seq)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            seq.num_scheduled_tokens = min(seq.num_uncomputed_tokens, budget)
            budget -= seq.num_scheduled_tokens
            self.running.append(seq)
            scheduled.append(seq)
        return scheduled

    def _schedule_decode(self) -> list[Sequence]:
        limit = min(self.max_num_seqs, self.max_num_batched_tokens)
        scheduled: list[Sequence] = []
        while self.running and len(scheduled) < limit:
            seq = self.running.popleft()
            while not self.block_manager.can_append(seq):
                if self.running:
                    self._preempt(self.running.pop())
                else:
                    self._preempt(seq)
                    break
            else:
                self.block_manager.append_slots(seq)
                seq.num_scheduled_tokens = 1
                scheduled.append(seq)
        assert scheduled or self.waiting, "decode found nothing to run and nothing waits"
        self.running.extendleft(reversed(scheduled))
        return scheduled

    def _preempt(self, seq: Sequence) -> None:
        # NOTE: a preempted sequence is recomputed, not swapped out: recompute keeps the block
        # manager single-tier, and its full blocks usually survive in the prefix cache anyway.
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.block_manager.deallocate(seq)
        self.waiting.appendleft(seq)

    def finish_early(self, seq: Sequence, reason: str) -> None:
        """Retire seq before it ends on its own (an abort, a failure), whatever its state: waiting
        (new or preempted), prefilling or decoding. Its KV blocks go back to the pool at once."""
        if seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        if seq.block_table:
            self.block_manager.deallocate(seq)
        seq.num_scheduled_tokens = 0
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def postprocess(self, seqs: list[Sequence], token_ids: list[int | None]) -> list[Sequence]:
        """Record a finished step: advance computed tokens, append sampled tokens, retire finished
        sequences. token_ids[i] is None when seqs[i] only computed part of its prompt."""
        finished = []
        for seq, token_id in zip(seqs, token_ids, strict=True):
            seq.num_computed_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            self.block_manager.cache_computed_blocks(seq)
            if token_id is None:
                continue
            seq.token_ids.append(token_id)
            seq.finish_reason = self.stop_checker.check(seq)
            if seq.finish_reason is not None:
                seq.status = SequenceStatus.FINISHED
                self.block_manager.deallocate(seq)
                self.running.remove(seq)
                finished.append(seq)
        return finished
