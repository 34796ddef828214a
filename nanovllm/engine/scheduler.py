"""Scheduler: continuous batching over WAITING -> RUNNING -> FINISHED.

Each step spends a budget of `max_num_batched_tokens` on at most `max_num_seqs` sequences:

- mixed batches (the default, as vLLM v1): running sequences first, oldest first: a decoding one
  gets its next token, one still prefilling the next chunk of its prompt; then waiting sequences are
  admitted while blocks and budget last (the last one chunked to fit). New requests thus join the
  decode batch in the same forward pass instead of stalling it with a step of their own.
- prefill first (`mixed_batches=False`, nano-vllm's policy): a step either continues and admits
  prefills, or, when there are none, decodes every running sequence.

A step whose every sequence computes just its last token is a decode step (CUDA graphs replay those).
When KV blocks run out for a decoding sequence, the most recently admitted sequences are preempted
and recomputed later. No request is ever dropped.

Speculative decoding: a decoding sequence with draft tokens (seq.spec_token_ids) computes its last token
and its drafts, with KV slots for all of them; the drafts only use budget and blocks that plain decoding
leaves over (they are trimmed, or dropped, never the cause of a preemption), and such a step is not a
decode step. postprocess_verified appends what the verification emitted, token by token."""

from collections import deque

from nanovllm.config import Config
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.requests import StopChecker
from nanovllm.engine.sequence import Sequence, SequenceStatus


class Scheduler:
    def __init__(self, config: Config, num_kvcache_blocks: int, stop_checker: StopChecker) -> None:
        self.mixed_batches = config.mixed_batches
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

    def abort(self, seq_id: int) -> Sequence | None:
        """Drop a waiting or running request and free its KV blocks (full blocks stay in the prefix
        cache); returns it, finished with finish_reason "abort", or None if it is not queued. Only
        between steps: a sequence of the step in flight must come back through postprocess."""
        for queue in (self.waiting, self.running):
            for seq in queue:
                if seq.seq_id == seq_id:
                    queue.remove(seq)
                    if seq.block_table:
                        self.block_manager.deallocate(seq)
                    seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
                    return seq
        return None

    def schedule(self) -> tuple[list[Sequence], bool]:
        """Pick the sequences of the next step and how many tokens each computes
        (seq.num_scheduled_tokens). Returns (sequences, is_prefill): is_prefill is False for a decode
        step, where every sequence computes exactly its last token."""
        if self.mixed_batches:
            scheduled, num_decoding, budget = self._schedule_running()
            scheduled += self._admit(budget)
        else:
            scheduled, num_decoding = self._schedule_prefill(), 0
            if not scheduled:
                scheduled, num_decoding = self._schedule_decode()
        assert scheduled or self.waiting, "the scheduler found nothing to run and nothing waits"
        # A decode step: every sequence computes exactly its last token. The decoding ones do; of the
        # others (prompt chunks, few) only a prompt whose last token alone lacks KV would.
        is_decode = all(seq.num_scheduled_tokens == 1 and seq.num_uncomputed_tokens == 1
                        for seq in scheduled[num_decoding:])
        return scheduled, not is_decode

    def _schedule_running(self) -> tuple[list[Sequence], int, int]:
        """Every running sequence, oldest first, while budget lasts: its next token, or its next chunk.
        Returns them, decoding ones first (the attention backends run those rows through their
        decode kernel), how many decode, and the budget left."""
        budget, decoding, prefilling, in_order = self.max_num_batched_tokens, [], [], []
        speculating: list[Sequence] = []  # after the plain decode rows: those run the decode kernel
        running, block_size = self.running, self.block_manager.block_size
        spare = budget - len(running)  # tokens left for drafts once every running sequence has one
        while running and budget > 0:
            seq = running.popleft()
            num_uncomputed = len(seq.token_ids) - seq.num_computed_tokens
            if num_uncomputed > 1:  # still prefilling: holds the blocks of all its tokens since admission
                seq.num_scheduled_tokens = min(num_uncomputed, budget)
                prefilling.append(seq)
            elif seq.spec_token_ids and self._reserve_draft_slots(seq, min(spare, budget - 1)):
                spare -= seq.num_scheduled_tokens - 1
                speculating.append(seq)
            elif (len(seq.block_table) * block_size < len(seq.token_ids)
                  and not self._reserve_decode_slot(seq)):
                continue  # its next token needs a new block, and it was preempted instead
            else:
                seq.num_scheduled_tokens = 1
                decoding.append(seq)
            budget -= seq.num_scheduled_tokens
            in_order.append(seq)
        running.extendleft(reversed(in_order))  # the running queue keeps its age order
        return decoding + speculating + prefilling, len(decoding), budget

    def _reserve_draft_slots(self, seq: Sequence, max_drafts: int) -> bool:
        """Schedule seq's last token and up to max_drafts of its drafts, with KV slots for all of them,
        from free blocks only; else drop the drafts and return False (it then decodes plainly)."""
        spec = seq.spec_token_ids[:max_drafts] if max_drafts > 0 else []
        if spec and self.block_manager.append_slot(seq, len(spec)):
            seq.spec_token_ids = spec
            seq.num_scheduled_tokens = 1 + len(spec)
            return True
        seq.spec_token_ids = []
        return False

    def _reserve_decode_slot(self, seq: Sequence) -> bool:
        """Give seq the block its next token needs, preempting the most recently admitted sequences
        (seq itself last) until one is free. False when seq was preempted."""
        while not self.block_manager.append_slot(seq):
            if not self.running:
                self._preempt(seq)
                return False
            self._preempt(self.running.pop())
        return True

    def _schedule_prefill(self) -> list[Sequence]:
        budget, scheduled = self.max_num_batched_tokens, []
        for seq in self.running:  # continue chunked prefills first: they already hold their blocks
            if budget == 0:
                break
            if seq.is_prefilling:
                seq.num_scheduled_tokens = min(seq.num_uncomputed_tokens, budget)
                budget -= seq.num_scheduled_tokens
                scheduled.append(seq)
        return scheduled + self._admit(budget)

    def _admit(self, budget: int) -> list[Sequence]:
        """Admit waiting sequences while blocks, `budget` tokens and sequence slots last."""
        scheduled = []
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

    def _schedule_decode(self) -> tuple[list[Sequence], int]:
        """Every running sequence's next token (and drafts), plain decode rows first; and their count."""
        limit = min(self.max_num_seqs, self.max_num_batched_tokens)
        decoding: list[Sequence] = []
        speculating: list[Sequence] = []
        in_order: list[Sequence] = []
        spare = self.max_num_batched_tokens - min(limit, len(self.running))  # tokens left for drafts
        while self.running and len(in_order) < limit:
            seq = self.running.popleft()
            if seq.spec_token_ids and self._reserve_draft_slots(seq, spare):
                spare -= seq.num_scheduled_tokens - 1
                speculating.append(seq)
            elif self._reserve_decode_slot(seq):
                seq.num_scheduled_tokens = 1
                decoding.append(seq)
            else:
                continue
            in_order.append(seq)
        self.running.extendleft(reversed(in_order))
        return decoding + speculating, len(decoding)

    def _preempt(self, seq: Sequence) -> None:
        # NOTE: a preempted sequence is recomputed, not swapped out: recompute keeps the block
        # manager single-tier, and its full blocks usually survive in the prefix cache anyway.
        seq.status = SequenceStatus.WAITING
        seq.spec_token_ids = []
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.block_manager.deallocate(seq)
        self.waiting.appendleft(seq)

    def finish_early(self, seq: Sequence, reason: str) -> None:
        """Retire seq before it ends on its own (an abort, a failure), whatever its state: waiting
        (new or preempted), prefilling or decoding. Its KV blocks go back to the pool at once."""
        self._retire(seq)
        seq.finish_reason = reason

    def _retire(self, seq: Sequence) -> None:
        """Take seq off its queue (a preempted one waits, with overlap scheduling even when its last
        step's token ends it) and give its KV blocks back."""
        if seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        if seq.block_table:
            self.block_manager.deallocate(seq)
        seq.num_scheduled_tokens = 0
        seq.spec_token_ids = []
        seq.status = SequenceStatus.FINISHED

    def postprocess(self, seqs: list[Sequence], token_ids: list[int | None]) -> list[Sequence]:
        """Record a finished step: advance computed tokens, append sampled tokens, retire finished
        sequences. token_ids[i] is None when seqs[i] only computed part of its prompt."""
        assert len(seqs) == len(token_ids), "one sampled token (or None) per scheduled sequence"
        self.record_computed(seqs)
        sampled = []
        for seq, token_id in zip(seqs, token_ids):
            if token_id is not None:
                seq.token_ids.append(token_id)
                sampled.append(seq)
        return self.check_stops(sampled)

    def postprocess_verified(self, seqs: list[Sequence],
                             results: list[tuple[list[int], list | None] | None]) -> list[Sequence]:
        """Record a step that verified drafts (nanovllm.speculative.decoding). results[i]: the tokens
        seqs[i] emitted (its accepted drafts, then the target's own next token) with their logprobs
        (None unless asked), or None when it only computed part of its prompt. They are appended as
        settle_verified appends them; the rejected drafts' KV lies beyond num_computed_tokens and is
        overwritten later."""
        assert len(seqs) == len(results), "one result (or None) per scheduled sequence"
        finished = []
        for seq, result in zip(seqs, results):
            seq.spec_token_ids = []
            if seq.is_finished:  # aborted meanwhile: its blocks are gone
                continue
            if result is None:
                self.record_computed([seq])
            else:
                seq.num_scheduled_tokens = 0
                if self.settle_verified(seq, len(seq.token_ids), *result):
                    finished.append(seq)
        return finished

    def settle_verified(self, seq: Sequence, start: int, tokens: list[int], logprobs: list | None,
                        kv_kept: bool = True) -> bool:
        """Record a verification of seq's drafts whose first position is `start` - 1. token_ids[start:]
        (with overlap scheduling, the drafts and the pending token it assumed: nanovllm.engine.overlap)
        give way to the tokens it emitted, appended one at a time, each checked for a stop; what follows
        a stop is dropped. KV counts as computed for token start - 1 and the accepted drafts (the new last
        token has none), unless seq lost that KV while the verification ran (kv_kept False: preempted,
        and perhaps admitted again with its KV counted from the prefix cache and a step scheduled on
        it). True when seq finished."""
        del seq.token_ids[start:]
        seq.num_assumed_tokens = 0
        reason, num_appended = None, 0
        for token, logprob in zip(tokens, logprobs or [None] * len(tokens), strict=True):
            seq.token_ids.append(token)
            num_appended += 1
            if logprob is not None:
                seq.logprobs.append(logprob)
                seq.cumulative_logprob += logprob[token]
            if (reason := self.stop_checker.check(seq)) is not None:
                break
        if kv_kept and seq.block_table:  # else preempted while the step ran: its KV is recomputed
            seq.num_computed_tokens = start - 1 + min(len(tokens), num_appended + 1)
            if seq.num_computed_tokens // self.block_manager.block_size > len(seq.block_hashes):
                self.block_manager.cache_computed_blocks(seq)
        if reason is None:
            return False
        seq.finish_reason = reason
        self._retire(seq)
        return True

    def record_computed(self, seqs: list[Sequence], share_blocks: bool = True) -> None:
        """The first half of postprocess: the step's scheduled tokens have KV now. Overlap scheduling
        calls it while the step still runs: its KV is written before any later step reads it (one
        stream), so its full blocks may already be shared; not those of a verification it takes as
        accepted (share_blocks=False): their drafts may yet be rejected (settle_verified shares them)."""
        block_size = self.block_manager.block_size
        for seq in seqs:
            seq.num_computed_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            if share_blocks and seq.num_computed_tokens // block_size > len(seq.block_hashes):
                self.block_manager.cache_computed_blocks(seq)  # a block just filled up

    def check_stops(self, seqs: list[Sequence]) -> list[Sequence]:
        """The second half of postprocess: retire the sequences that their new last token ends."""
        finished = []
        for seq in seqs:
            seq.finish_reason = self.stop_checker.check(seq)
            if seq.finish_reason is not None:
                self._retire(seq)
                finished.append(seq)
        return finished
