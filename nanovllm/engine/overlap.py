"""Overlap scheduling (vLLM v1's async scheduling, mini-sglang's overlap loop): while the device runs
step n, the host schedules step n+1, builds its inputs and launches it; only then does it wait for
step n's sampled ids (the one host sync of a step) and postprocess step n. Greedy and seeded output is
token for token the synchronous loop's.

    one engine step:  commit n | schedule n+1 | build, launch n+1 | wait for n | postprocess n
    the device:       ...... step n ..........................| step n+1 ......................

- Commit: step n's scheduled tokens count as computed (their KV is written before any later step
  reads it: one stream), and each sequence that samples in it gets PENDING_TOKEN_ID as its last
  token. Step n+1 is thus scheduled as if every sequence of step n went on; positions, slots and
  lengths grow by one without the token's value. A sequence its pending token ends whatever the
  value (max_tokens, max_model_len) is left out of step n+1, as the synchronous loop has retired it.
- A row of step n+1 whose last input token is pending takes it on the device from step n's sampled
  ids (StepBatch.prev_token_*), never through the host.
- Postprocess: the pending tokens are replaced by the sampled ones and the stop checks run. A sequence
  that finishes there (or is aborted before) has its step n+1 token dropped. Between engine steps no
  sequence holds a pending token: streams and outputs only ever see sampled tokens.

Speculative decoding with a proposer that proposes past a pending token (Proposer.guesses_pending: n-gram
lookup guesses it; a draft model's steps take it on the device, queued after step n) runs here too. A
verification step is committed as if every draft were accepted: its drafts are appended, then a pending
token for the target's next one, all counted as computed (Sequence.num_assumed_tokens of them assumed),
and no block they fill is shared yet. Step n+1 is scheduled and proposed on that assumption (the proposer
takes the pending token as its guess), its first input fed on the device from the last verified
position's sampled id (and a draft model's last draft from the draft's final step, read once step n+1 is
launched: SpeculativeDecoding.settle_last_drafts). Postprocess puts what the verification emitted in
place of the assumed tokens (Scheduler.settle_verified); where a draft was rejected, that sequence's rows
of step n+1 rest on tokens it does not have: they are void, neither committed nor postprocessed, and the
sequence is scheduled from its settled tokens in the step after (their KV slots are overwritten then, as
a rejected draft's are). A sequence whose latest verification rejected a draft is verified without
overlap next time (needs_host_tokens), so a workload whose drafts miss often loses no more than the
synchronous loop does.

What needs step n's tokens on the host to build step n+1 waits for step n first (that step is not
overlapped): penalties and bad words (their processors are built from the tokens' values) and prompt
logprobs. A structured output's rows need step n's tokens only to fill step n+1's bitmask, which happens
when step n+1 samples: its forward pass is launched as usual, and its sampling is queued once step n is
postprocessed (its matchers have taken their tokens then), while the device still runs the forward.
A step whose launch fails is re-run on the synchronous path, which isolates the failing request
(failures.py). When nothing is left queued, a step in flight holds only finished sequences and
is dropped without waiting. Single rank only (Config.async_scheduling). Pure Python: what a step
leaves on the device stays inside the executor's PendingStep."""

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from nanovllm.engine.executor import Executor
from nanovllm.engine.in_flight import InFlightStep, PendingTokens, feed_previous_tokens
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import PENDING_TOKEN_ID, Sequence
from nanovllm.engine.step import build_batch

if TYPE_CHECKING:
    from nanovllm.speculative.decoding import SpeculativeDecoding

logger = logging.getLogger(__name__)


class OverlapLoop:
    """One engine's step in flight. `run_sync(seqs, is_prefill)` runs a step synchronously with
    failure isolation; `on_finished(seqs)` is told of the sequences each postprocess finished."""

    def __init__(self, scheduler: Scheduler, executor: Executor,
                 run_sync: Callable[[list[Sequence], bool], None],
                 on_finished: Callable[[list[Sequence]], None],
                 spec: "SpeculativeDecoding | None" = None) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.run_sync = run_sync
        self.on_finished = on_finished
        self.spec = spec  # proposes and verifies drafts here while spec.overlaps
        self.in_flight: InFlightStep | None = None
        self.num_emitted = 0  # tokens the latest postprocess appended (verification steps' count)

    def step(self) -> tuple[int, int]:
        """Commit the step in flight, schedule and launch the next, then wait for and postprocess the
        one before. Returns the step's (prompt tokens, decoded tokens): those of the step launched (a
        prefill's count as prompt tokens); while drafts are verified here, the prompt tokens of the
        step launched and the tokens the step postprocessed emitted."""
        prev, self.in_flight = self.in_flight, None
        self.num_emitted = 0
        if prev is not None:
            self._commit(prev)
            if prev.needs_host_tokens:
                self._postprocess(prev)
                prev = None
        if self.scheduler.is_finished():  # prev's tokens finished every sequence
            return 0, self.num_emitted if self.spec is not None and self.spec.overlaps else 0
        try:
            self._propose(prev)
            seqs, is_prefill = self._schedule(prev)
        except BaseException:
            self._settle_drafts()
            if prev is not None:  # no pending token outlives the engine step
                self._postprocess(prev)
            raise
        num_tokens = sum(seq.num_scheduled_tokens for seq in seqs)
        failed = False
        try:
            if seqs:  # none when the only sequences could not get KV blocks until prev's tokens are in
                self.in_flight = self._launch(seqs, is_prefill, prev)
        except Exception:
            logger.exception("launching a step of %d sequences failed; running it synchronously", len(seqs))
            failed = True
        finally:
            self._settle_drafts()  # read while the step runs, before anything reads them on the host
            if prev is not None:  # even on Ctrl-C: no pending token outlives the engine step
                self._postprocess(prev)
        if failed:
            self.run_sync(self._still_valid(seqs), is_prefill)
        elif self.in_flight is not None:
            self._sample(self.in_flight)
        launched = self.in_flight
        self.drop_if_idle()
        if self.spec is not None and self.spec.overlaps:  # a step's decoded tokens are known once read
            prompt = 0 if launched is None else sum(
                seq.num_scheduled_tokens for seq in launched.seqs if seq.num_uncomputed_tokens > 1)
            return prompt, self.num_emitted
        return (num_tokens, 0) if is_prefill else (0, num_tokens)

    def _propose(self, prev: InFlightStep | None) -> None:
        """Give the sequences that decode next their drafts (while self.spec overlaps): proposed past a
        pending token, which the proposer guesses (n-gram) or takes on the device from prev (a draft
        model's step, queued after prev)."""
        spec = self.spec
        if spec is None or not spec.overlaps:
            return
        running = self.scheduler.running
        for seq in running:
            seq.spec_token_ids = []
        pending = None if prev is None else PendingTokens.of(prev)
        spec.propose(running, self.scheduler.block_manager.append_slot, pending, defer_last=True)

    def _settle_drafts(self) -> None:
        """The drafts the proposal left on the device (the verification launched took them there), read
        and put in place on the host."""
        if self.spec is not None:
            self.spec.settle_last_drafts()

    def _still_valid(self, seqs: list[Sequence]) -> list[Sequence]:
        """seqs without those that finished, nor those whose rows in the step in flight are void (their
        settled tokens are scheduled afresh). After a failed launch there is no step in flight: a
        sequence whose drafts postprocessing rejected runs from its settled tokens, as its schedule
        counts from num_computed_tokens."""
        void = set() if self.in_flight is None else self.in_flight.void
        valid = []
        for seq in seqs:
            if seq.seq_id in void:
                seq.num_scheduled_tokens, seq.spec_token_ids = 0, []
            elif not seq.is_finished:
                valid.append(seq)
        return valid

    def _schedule(self, prev: InFlightStep | None) -> tuple[list[Sequence], bool]:
        """Schedule the next step, leaving out the sequences whose pending token ends them whatever
        its value (max_tokens or max_model_len), even were all their assumed drafts rejected: as in the
        synchronous loop, where they are finished by now, they take no row and reserve no KV block
        (postprocess retires them)."""
        max_model_len = self.scheduler.stop_checker.max_model_len
        finishing = []
        for seq in [] if prev is None else (prev.seqs[row] for row in prev.sample_rows):
            # Its assumed drafts (beyond its pending token) may all be rejected: it has that many fewer.
            drafts = seq.num_assumed_tokens - 1 if seq.num_assumed_tokens > 1 else 0
            if not seq.is_finished and (seq.num_completion_tokens - drafts >= seq.sampling_params.max_tokens
                                        or len(seq) - drafts >= max_model_len):
                finishing.append(seq)
        running = self.scheduler.running
        if not self.scheduler.waiting and len(finishing) == len(running):
            return [], False
        for seq in finishing:
            running.remove(seq)
        try:
            return self.scheduler.schedule()
        finally:
            running.extend(finishing)

    def drain(self) -> None:
        """Finish the step in flight, if any (commit, wait, postprocess): the synchronous loop takes
        over from here (speculative decoding's steps)."""
        prev, self.in_flight = self.in_flight, None
        if prev is not None:
            self._commit(prev)
            self._postprocess(prev)

    def _sample(self, step: InFlightStep) -> None:
        """Queue the sampling of the step just launched (a no-op unless its launch deferred it); one that
        fails is re-run synchronously, as a failed launch is."""
        try:
            step.output.sample()
        except Exception:
            logger.exception("sampling a step of %d sequences failed; running it synchronously",
                             len(step.seqs))
            seqs = self._still_valid(step.seqs)
            self.in_flight = None
            self.run_sync(seqs, step.is_prefill)

    def drop_if_idle(self) -> None:
        """Forget the step in flight when nothing is queued: each of its sequences finished or was
        aborted, so no token of it is wanted. Not waited for: whatever reuses its memory or KV blocks
        runs after it on the device."""
        if self.scheduler.is_finished():
            self.in_flight = None

    def _launch(self, seqs: list[Sequence], is_prefill: bool, prev: InFlightStep | None) -> InFlightStep:
        batch = build_batch(seqs, is_prefill)
        if prev is not None:
            feed_previous_tokens(batch, seqs, prev)
        previous = prev.output if prev is not None else None
        if batch.spec_token_ids:  # drafts the proposal left on the device: taken there too
            previous = self.spec.feed_last_drafts(batch, seqs, previous)
        needs_host_tokens = any(seq.reads_output_tokens or seq.needs_prompt_logprobs for seq in seqs)
        if batch.spec_token_ids and not needs_host_tokens:
            needs_host_tokens = self.spec.waits_for_tokens(seqs)
        # A constrained row's bitmask comes from its matcher, which takes prev's token at its postprocess:
        # sample after it, whether or not the step after this one waits for this one's tokens.
        defer_sampling = prev is not None and any(seq.grammar is not None for seq in seqs)
        output = self.executor.launch(batch, previous, defer_sampling)
        return InFlightStep(seqs, batch.sample_rows, output, needs_host_tokens, is_prefill,
                            batch.spec_token_ids)

    def _commit(self, step: InFlightStep) -> None:
        """Step `step` as if done, its sampled tokens pending and its drafts accepted (see the module
        docstring)."""
        void = step.void
        if void:
            for seq in step.seqs:
                if seq.seq_id in void:
                    seq.num_scheduled_tokens, seq.spec_token_ids = 0, []
        live = [seq for seq in step.seqs if not seq.is_finished and seq.seq_id not in void]
        if not step.drafts:  # a plain step: each sampling row's token pending
            self.scheduler.record_computed(live)
            for row in step.sample_rows:
                seq = step.seqs[row]
                if not seq.is_finished and seq.seq_id not in void:
                    seq.token_ids.append(PENDING_TOKEN_ID)
                    seq.num_assumed_tokens = 1
            return
        verifying = {step.seqs[row].seq_id for row, drafts in zip(step.sample_rows, step.drafts) if drafts}
        self.scheduler.record_computed([seq for seq in live if seq.seq_id not in verifying])
        self.scheduler.record_computed([seq for seq in live if seq.seq_id in verifying], share_blocks=False)
        for row, drafts in zip(step.sample_rows, step.drafts, strict=True):
            seq = step.seqs[row]
            step.starts.append(len(seq.token_ids))
            step.preemptions.append(seq.num_preemptions)
            if not seq.is_finished and seq.seq_id not in void:
                seq.token_ids.extend(drafts)
                seq.token_ids.append(PENDING_TOKEN_ID)
                seq.num_assumed_tokens = len(drafts) + 1
                seq.spec_token_ids = []

    def _postprocess(self, step: InFlightStep) -> None:
        """Wait for the step's sampled ids (the sync), put them in place of the assumed tokens and run
        the stop checks; the tokens of sequences that finished meanwhile, or whose rows are void, are
        dropped. A verification that rejected a draft voids its sequence's rows in the step in flight."""
        out = step.output.wait()
        finished, sampled = [], []
        emitted = 0
        token_ids, all_logprobs, void = out.token_ids, out.logprobs, step.void
        for i, (row, last) in enumerate(zip(step.sample_rows, step.last_ids, strict=True)):
            seq = step.seqs[row]
            if seq.is_finished or seq.seq_id in void:
                continue
            drafts = step.drafts[i] if step.drafts else None
            assert seq.token_ids[-1] == PENDING_TOKEN_ID, f"sequence {seq.seq_id} has no pending token"
            if not drafts:
                token = seq.token_ids[-1] = token_ids[last]
                seq.num_assumed_tokens = 0
                if all_logprobs is not None and (logprob := all_logprobs[last]) is not None:
                    seq.logprobs.append(logprob)
                    seq.cumulative_logprob += logprob[token]
                sampled.append(seq)
                emitted += 1
                continue
            first = last - len(drafts)
            logprobs = None if all_logprobs is None else all_logprobs[first:last + 1]
            tokens = self.spec.accept(seq, token_ids[first:last + 1], drafts)
            before = len(seq.token_ids)
            if self.scheduler.settle_verified(seq, step.starts[i], tokens,
                                              None if logprobs is None else logprobs[:len(tokens)],
                                              kv_kept=seq.num_preemptions == step.preemptions[i]):
                finished.append(seq)
            elif len(tokens) <= len(drafts) and self.in_flight is not None:
                self.in_flight.void.add(seq.seq_id)  # its next rows took the rejected drafts
            emitted += len(seq.token_ids) - before + len(drafts) + 1
        for row, prompt_logprobs in (out.prompt_logprobs or {}).items():
            if not step.seqs[row].is_finished:
                step.seqs[row].prompt_logprobs.extend(prompt_logprobs)
        self.num_emitted = emitted
        self.on_finished(finished + self.scheduler.check_stops(sampled))
