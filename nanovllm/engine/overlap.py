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
from dataclasses import dataclass

from nanovllm.engine.executor import Executor, PendingStep
from nanovllm.engine.requests import record_step
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import PENDING_TOKEN_ID, Sequence
from nanovllm.engine.step import StepBatch, build_batch

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class InFlightStep:
    seqs: list[Sequence]
    sample_rows: list[int]
    output: PendingStep
    # Some sequence builds its next step from this step's tokens on the host: wait for them first.
    needs_host_tokens: bool
    is_prefill: bool


def feed_previous_tokens(batch: StepBatch, seqs: list[Sequence], prev: InFlightStep) -> None:
    """Point each sampling row of `batch` whose last input token is still pending at its row of the
    previous step's sampled ids."""
    prev_rows = {prev.seqs[row].seq_id: i for i, row in enumerate(prev.sample_rows)}
    for row in batch.sample_rows:
        prev_row = prev_rows.get(seqs[row].seq_id)
        if prev_row is None:
            continue
        index = batch.cu_seqlens_q[row + 1] - 1  # the row's last token: its pending one
        assert batch.input_ids[index] == PENDING_TOKEN_ID, f"sequence {seqs[row].seq_id} has no pending token"
        batch.prev_token_indices.append(index)
        batch.prev_token_rows.append(prev_row)


class OverlapLoop:
    """One engine's step in flight. `run_sync(seqs, is_prefill)` runs a step synchronously with
    failure isolation; `on_finished(seqs)` is told of the sequences each postprocess finished."""

    def __init__(self, scheduler: Scheduler, executor: Executor,
                 run_sync: Callable[[list[Sequence], bool], None],
                 on_finished: Callable[[list[Sequence]], None]) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.run_sync = run_sync
        self.on_finished = on_finished
        self.in_flight: InFlightStep | None = None

    def step(self) -> tuple[int, bool]:
        """Commit the step in flight, schedule and launch the next, then wait for and postprocess the
        one before. Returns the number of tokens of the step launched and whether it is a prefill."""
        prev, self.in_flight = self.in_flight, None
        if prev is not None:
            self._commit(prev)
            if prev.needs_host_tokens:
                self._postprocess(prev)
                prev = None
        if self.scheduler.is_finished():  # prev's tokens finished every sequence
            return 0, False
        seqs, is_prefill = self._schedule(prev)
        num_tokens = sum(seq.num_scheduled_tokens for seq in seqs)
        failed = False
        try:
            if seqs:  # none when the only sequences could not get KV blocks until prev's tokens are in
                self.in_flight = self._launch(seqs, is_prefill, prev)
        except Exception:
            logger.exception("launching a step of %d sequences failed; running it synchronously", len(seqs))
            failed = True
        finally:
            if prev is not None:  # even on Ctrl-C: no pending token outlives the engine step
                self._postprocess(prev)
        if failed:
            self.run_sync([seq for seq in seqs if not seq.is_finished], is_prefill)
        elif self.in_flight is not None:
            self._sample(self.in_flight)
        self.drop_if_idle()
        return num_tokens, is_prefill

    def _schedule(self, prev: InFlightStep | None) -> tuple[list[Sequence], bool]:
        """Schedule the next step, leaving out the sequences whose pending token ends them whatever
        its value (max_tokens or max_model_len): as in the synchronous loop, where they are finished
        by now, they take no row and reserve no KV block (postprocess retires them)."""
        max_model_len = self.scheduler.stop_checker.max_model_len
        finishing = [] if prev is None else [
            seq for seq in (prev.seqs[row] for row in prev.sample_rows) if not seq.is_finished and (
                seq.num_completion_tokens >= seq.sampling_params.max_tokens or len(seq) >= max_model_len)]
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
            self.in_flight = None
            self.run_sync([seq for seq in step.seqs if not seq.is_finished], step.is_prefill)

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
        needs_host_tokens = any(seq.reads_output_tokens or seq.needs_prompt_logprobs for seq in seqs)
        defer_sampling = not needs_host_tokens and any(seq.grammar is not None for seq in seqs)
        output = self.executor.launch(batch, prev.output if prev is not None else None, defer_sampling)
        return InFlightStep(seqs, batch.sample_rows, output, needs_host_tokens, is_prefill)

    def _commit(self, step: InFlightStep) -> None:
        """Step `step` as if done, its sampled tokens pending (see the module docstring)."""
        self.scheduler.record_computed([seq for seq in step.seqs if not seq.is_finished])
        for row in step.sample_rows:
            seq = step.seqs[row]
            if not seq.is_finished:
                seq.token_ids.append(PENDING_TOKEN_ID)

    def _postprocess(self, step: InFlightStep) -> None:
        """Wait for the step's sampled ids (the sync), put them in place of the pending tokens and run
        the stop checks; the tokens of sequences that finished meanwhile are dropped."""
        token_ids = record_step(step.seqs, step.sample_rows, step.output.wait())
        sampled = []
        for seq, token_id in zip(step.seqs, token_ids, strict=True):
            if token_id is not None:
                assert seq.token_ids[-1] == PENDING_TOKEN_ID, f"sequence {seq.seq_id} has no pending token"
                seq.token_ids[-1] = token_id
                sampled.append(seq)
        self.on_finished(self.scheduler.check_stops(sampled))
