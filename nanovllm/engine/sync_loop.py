"""The synchronous step, nano-vllm's loop: schedule, run the batch and wait for its tokens, postprocess.
A request whose part of a step fails is finished alone with finish_reason "error" and the exception's
text; the others keep running (failures.py). It is also the overlap loop's fallback (overlap.py) for a
step it cannot overlap or whose launch failed. Pure Python: the model is reached through `run_batch`."""

from collections.abc import Callable

from nanovllm.engine.failures import run_isolating_failures
from nanovllm.engine.request import record_step
from nanovllm.engine.request_tracker import request_id_of
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.runner.batch import SamplingBatch, StepBatch, StepOutput, build_batch, sampling_batch


class SyncLoop:
    """run_batch: runs a batch on every rank and returns rank 0's output. check_sampling: with tensor
    parallelism, what rank 0 alone could fail on, tried before a step is sent (failures.py); None on
    one rank. finish_early(request_id, reason, error) ends a request; finish_requests(seqs) makes the
    outputs of requests whose last sequence finished."""

    def __init__(self, scheduler: Scheduler, run_batch: Callable[[StepBatch], StepOutput],
                 check_sampling: Callable[[SamplingBatch], None] | None,
                 finish_early: Callable[[int, str, str], None],
                 finish_requests: Callable[[list[Sequence]], None]) -> None:
        self.scheduler = scheduler
        self.run_batch = run_batch
        self.check_sampling = check_sampling
        self.finish_early = finish_early
        self.finish_requests = finish_requests

    def step(self) -> tuple[int, bool]:
        """Schedule and run one step; returns (tokens computed, whether it prefilled)."""
        seqs, is_prefill = self.scheduler.schedule()
        num_tokens = sum(seq.num_scheduled_tokens for seq in seqs)
        self.run(seqs, is_prefill)
        return num_tokens, is_prefill

    def run(self, seqs: list[Sequence], is_prefill: bool) -> None:
        """Run a scheduled step and postprocess it, failing alone each request whose part fails."""
        check = self._check if self.check_sampling is not None else None
        token_ids, failures = run_isolating_failures(self._run_model, seqs, is_prefill, check)
        if failures:  # a request fails with all its completions
            failed = {request_id_of(seq): error for seq in seqs if (error := failures.get(seq.seq_id))}
            for request_id, error in failed.items():
                self.finish_early(request_id, "error", error)
            ok = [i for i, seq in enumerate(seqs) if request_id_of(seq) not in failed]
            seqs, token_ids = [seqs[i] for i in ok], [token_ids[i] for i in ok]
        self.finish_requests(self.scheduler.postprocess(seqs, token_ids))

    def _run_model(self, seqs: list[Sequence], is_prefill: bool) -> list[int | None]:
        """The sampled token of each sequence (None for those that only computed part of their prompt);
        records on them the logprobs and prompt logprobs they asked for."""
        batch = build_batch(seqs, is_prefill)
        return record_step(seqs, batch.sample_rows, self.run_batch(batch))

    def _check(self, seqs: list[Sequence]) -> None:
        self.check_sampling(sampling_batch(seqs))
