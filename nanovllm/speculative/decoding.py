"""The engine's side of speculative decoding: after each step, ask the proposer for the drafts of the
sequences that decode next; after a step that verified drafts, turn its sampled ids into the tokens each
sequence emits (rejection.py) and count drafts and acceptances. Pure Python.

    engine step:  schedule (drafts get slots and budget) | run | postprocess_verified | propose

With async_scheduling the overlap loop proposes before it schedules, past the pending token of the step
in flight (n-gram lookup guesses it, a draft model takes it on the device), and settles each
verification once its tokens are read (nanovllm.engine.overlap).

Counters, engine-wide and per sequence (vLLM's spec_decode_* figures): drafts (a sequence's drafts
verified in one step), draft tokens, accepted tokens, and accepted tokens by position (how often the
i-th draft of a step was accepted)."""

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import NamedTuple

from nanovllm.config import Config
from nanovllm.engine.executor import PendingStep
from nanovllm.engine.in_flight import PendingTokens
from nanovllm.engine.sequence import PENDING_TOKEN_ID, Sequence
from nanovllm.engine.step import StepBatch, StepOutput
from nanovllm.engine.structured_outputs import grammar_prefix
from nanovllm.outputs import TokenLogprobs
from nanovllm.speculative.proposer import Proposer
from nanovllm.speculative.rejection import accepted_tokens

# With async_scheduling and a proposer that cannot propose past a pending token (guesses_pending), after a
# proposal round that found no draft at all, this many steps run the overlap loop before the proposer
# looks again (each look is a synchronous step): output with nothing to look up then loses overlap on
# one step in nine, not on every step.
QUIET_STEPS = 8


@dataclass(frozen=True, slots=True)
class SpecDecodeStats:
    """The counters since the engine started."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: tuple[int, ...] = ()  # [i]: steps whose draft i (from 0) was accepted


class Verified(NamedTuple):
    """What one sequence emitted in a verification step (Scheduler.postprocess_verified)."""

    token_ids: list[int]  # its accepted drafts, then the target's next token
    logprobs: list[TokenLogprobs | None] | None  # per token, where asked


class SpeculativeDecoding:
    def __init__(self, config: Config, proposer: Proposer) -> None:
        self.spec = config.speculative_config
        self.proposer = proposer
        self.max_model_len = config.max_model_len
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * self.spec.num_speculative_tokens
        self.num_proposed = 0  # proposal rounds since proposals were last dropped
        self.num_quiet_steps = 0  # steps left before the proposer looks again (QUIET_STEPS)
        self.last_drafts = None  # the latest proposal's drafts left on the device (draft_steps.LastDrafts)

    @property
    def overlaps(self) -> bool:
        """Whether verification steps run in the overlap loop: the proposer proposes past a pending
        token (Proposer.guesses_pending), so the next step's drafts need not wait for this step's
        tokens (nanovllm.engine.overlap)."""
        return getattr(self.proposer, "guesses_pending", False)

    def active(self, num_running: int) -> bool:
        """Whether sequences get drafts with this many running (disable_by_batch_size)."""
        limit = self.spec.disable_by_batch_size
        return limit is None or num_running <= limit

    def verifies_next(self, running: Collection[Sequence]) -> bool:
        """Whether the next step may verify drafts, and so runs the synchronous loop (with
        async_scheduling, the engine runs the overlap loop otherwise): no more than disable_by_batch_size
        sequences run, and the proposer is not resting after a round that found nothing (QUIET_STEPS).
        When not, the drafts of sequences the last step left out are dropped: the overlap loop verifies
        none."""
        if self.active(len(running)):
            if self.num_quiet_steps == 0:
                return True
            self.num_quiet_steps -= 1
        if self.num_proposed:
            for seq in running:
                seq.spec_token_ids = []
            self.num_proposed = 0
        return False

    def propose(self, running: Collection[Sequence],
                reserve: Callable[[Sequence, int], bool] | None = None,
                pending: PendingTokens | None = None, defer_last: bool = False) -> None:
        """Give each sequence that decodes next its drafts (seq.spec_token_ids), at most
        num_speculative_tokens and never past max_tokens or max_model_len; none at all while more than
        disable_by_batch_size sequences run. reserve(seq, n) (BlockManager.append_slot) gives a
        sequence KV slots for n drafts beyond its tokens, from free blocks only, before a proposer that
        writes KV there proposes (else it finds its block table short near a block's end). pending (the
        overlap loop): where the step in flight samples the sequences' pending last tokens. defer_last
        (the overlap loop): a proposer that can (Proposer.defers_last_draft) leaves each sequence's last
        draft on the device, PENDING_TOKEN_ID until settle_last_drafts, where no sequence proposed for
        builds anything from draft values on the host (logits processors, a grammar)."""
        self.last_drafts = None
        if not self.active(len(running)):
            return
        k, max_model_len = self.spec.num_speculative_tokens, self.max_model_len
        seqs, nums = [], []
        for seq in running:
            # Logits processors and a grammar's bitmask are built for each verified position from the
            # drafts before it (engine/step.with_drafts).
            if seq.num_uncomputed_tokens != 1:
                continue  # still prefilling
            if seq.num_assumed_tokens and seq.grammar is not None:
                continue  # its matcher cannot take drafts that follow a token not yet sampled
            # A step with n drafts emits up to n + 1 tokens.
            num = min(k, seq.sampling_params.max_tokens - seq.num_completion_tokens - 1,
                      max_model_len - len(seq) - 1)
            if num > 0:
                seqs.append(seq)
                nums.append(num)
        found = False
        if seqs and reserve is not None and self.proposer.writes_kv:
            for seq, num in zip(seqs, nums, strict=True):
                reserve(seq, num)  # short of free blocks: the proposer proposes what the table covers
        if seqs:
            defer = (defer_last and getattr(self.proposer, "defers_last_draft", False)
                     and not any(seq.uses_logits_processors for seq in seqs))
            proposals = (self.proposer.propose(seqs, nums, pending, defer_last=True) if defer
                         else self.proposer.propose(seqs, nums, pending))
            self.last_drafts = self.proposer.last_drafts if defer else None
            for seq, num, drafts in zip(seqs, nums, proposals, strict=True):
                # A structured output verifies only drafts its grammar allows.
                seq.spec_token_ids = (drafts[:num] if seq.grammar is None
                                      else grammar_prefix(seq.grammar, drafts[:num]))
                found = found or bool(seq.spec_token_ids)
            self.num_proposed += 1
        if not found:
            self.num_quiet_steps = QUIET_STEPS

    def feed_last_drafts(self, batch: StepBatch, seqs: list[Sequence], previous: PendingStep | None
                         ) -> PendingStep | None:
        """Point each row of `batch` whose last draft the proposal left on the device at it
        (StepBatch.prev_token_*); returns what the launch reads those inputs from, `previous` (the step
        in flight, or None) extended by the drafts where any is fed."""
        last, spec = self.last_drafts, batch.spec_token_ids
        fed = [(batch.cu_seqlens_q[row + 1] - 1, last.rows[seqs[row].seq_id])
               for row, drafts in zip(batch.sample_rows, spec) if drafts and drafts[-1] == PENDING_TOKEN_ID
               ] if last is not None and spec else []
        if not fed:
            return previous
        previous, offset = last.feeding(previous)
        for index, row in fed:
            batch.prev_token_indices.append(index)
            batch.prev_token_rows.append(offset + row)
        return previous

    def settle_last_drafts(self) -> None:
        """Read the drafts the latest proposal left on the device and put them in place of their
        PENDING_TOKEN_ID, in each sequence's drafts (and so in the step built from them). Between engine
        steps no draft is pending."""
        last, self.last_drafts = self.last_drafts, None
        if last is None:
            return
        tokens = last.read()
        for seq in last.seqs:
            drafts = seq.spec_token_ids
            if drafts and drafts[-1] == PENDING_TOKEN_ID:
                drafts[-1] = tokens[seq.seq_id]

    def accept(self, seq: Sequence, sampled: list[int], drafts: list[int]) -> list[int]:
        """What seq emits from a verification of `drafts` that sampled `sampled` (one id a verified
        position): its accepted drafts, then the target's token; counted."""
        tokens = accepted_tokens(sampled, drafts)
        if drafts:
            self._count(seq, len(drafts), len(tokens) - 1)
        return tokens

    def waits_for_tokens(self, seqs: list[Sequence]) -> bool:
        """Whether the step after one that verifies these sequences' drafts should wait for its tokens
        (overlap loop): a verifying sequence rejected a draft last time (its next rows would likely be
        computed for nothing), or has a grammar (its next drafts are cut by the matcher)."""
        return any(seq.spec_token_ids and (seq.rejected_drafts or seq.grammar is not None) for seq in seqs)

    def record(self, seqs: list[Sequence], batch: StepBatch, out: StepOutput) -> list[Verified | None]:
        """Per sequence of a verification step, what it emitted (None for those that only computed part
        of their prompt, or finished meanwhile); records prompt logprobs and the counters."""
        results: list[Verified | None] = [None] * len(seqs)
        spec = batch.spec_token_ids or [[] for _ in batch.sample_rows]
        logprobs = out.logprobs
        pos = 0
        for row, drafts in zip(batch.sample_rows, spec, strict=True):
            seq, num = seqs[row], len(drafts)
            sampled = out.token_ids[pos:pos + num + 1]
            row_logprobs = None if logprobs is None else logprobs[pos:pos + num + 1]
            pos += num + 1
            if seq.is_finished:
                continue
            tokens = self.accept(seq, sampled, drafts)
            results[row] = Verified(tokens, None if row_logprobs is None else row_logprobs[:len(tokens)])
        assert pos == len(out.token_ids), f"{len(out.token_ids)} sampled ids for {pos} verified positions"
        for row, prompt_logprobs in (out.prompt_logprobs or {}).items():
            if not seqs[row].is_finished:
                seqs[row].prompt_logprobs.extend(prompt_logprobs)
        return results

    def _count(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1
        seq.num_drafts += 1
        seq.num_draft_tokens += num_drafts
        seq.num_accepted_tokens += num_accepted
        seq.rejected_drafts = num_accepted < num_drafts

    def stats(self) -> SpecDecodeStats:
        return SpecDecodeStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                               tuple(self.accepted_per_pos))

    def shutdown(self) -> None:
        self.proposer.shutdown()
