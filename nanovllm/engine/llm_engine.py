"""The engine: validates and tokenizes requests, schedules steps, runs each on its executor and turns
finished sequences into outputs. Plain Python: the model is behind the Executor protocol
(engine/executor.py), built by the factory the engine is given (nanovllm.distributed.executor).

    add_request(prompt, params) -> request id      validated here; bad input raises, nothing queued
    step() -> StepResult                           one scheduled step on the executor
    take_outputs(request ids) -> [(id, output)]    finished requests, each output handed out once
    completion_token_ids(request id, start)        a running request's tokens so far (streaming)
    progress(request id, starts)                   every completion's new tokens and logprobs
    abort_request(request id or ids) -> bool       stop them and free their KV blocks at once
    is_finished(), stats(), shutdown()

A request is its n sequences (SamplingParams.n completions, requests.py), finished, aborted or failed
together; its id is its first sequence's. A request whose part of a step fails ends alone with
finish_reason "error" (failures.py). With async_scheduling (on by default with CUDA and one rank)
`step` launches a step before it waits for the previous one's tokens (overlap.py), so a request's
output comes one step later. With speculative_config, the sequences that decode next get drafts, which
their next step verifies (nanovllm.speculative.decoding), in the overlap loop too (n-gram and draft
model proposers both propose past the token still being sampled).

Threads: one engine may be driven from several threads at once (generate, stream, the server's loop):
a lock serializes the calls, and each caller takes exactly its own requests' outputs by id, whichever
thread ran the step that finished them."""

import threading
from collections.abc import Container, Iterable
from dataclasses import dataclass

from nanovllm.config import Config
from nanovllm.engine import failures
from nanovllm.engine.executor import Executor, ExecutorFactory
from nanovllm.engine.overlap import OverlapLoop
from nanovllm.engine.requests import (
    RequestTracker,
    StopChecker,
    eos_token_ids,
    make_sequences,
    record_step,
    request_id_of,
    request_output,
)
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence, SequenceStatus
from nanovllm.engine.step import build_batch, sampling_batch
from nanovllm.engine.structured_outputs import GrammarCompiler
from nanovllm.engine.validation import Prompt, check_request
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import SamplingParams, StructuredOutputsParams
from nanovllm.speculative.decoding import SpecDecodeStats, SpeculativeDecoding
from nanovllm.speculative.proposer import make_proposer
from nanovllm.utils.log import ensure_default_handler, logger, startup_line
from nanovllm.utils.tokenizer import load_engine_tokenizer


@dataclass(slots=True)
class StepResult:
    num_prefill_tokens: int  # prompt tokens computed in the step
    num_decode_tokens: int  # tokens decoded in the step


@dataclass(slots=True)
class RequestProgress:
    """A running request as a streaming caller sees it (LLMEngine.progress)."""

    started: bool  # some of it was scheduled: it left the waiting queue at least once
    token_ids: list[list[int]]  # per completion, its tokens from the asked start on
    logprobs: list[list | None]  # per completion, those tokens' logprobs (None unless asked)


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """The scheduler's figures now, for /metrics and progress reports."""

    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    num_preemptions: int  # since start
    spec_decode: SpecDecodeStats | None = None  # speculative decoding's counters (None: it is off)


class LLMEngine:
    def __init__(self, config: Config, make_executor: ExecutorFactory) -> None:
        if config.data_parallel_size != 1:
            raise ValueError(f"an LLMEngine is one engine, but data_parallel_size="
                             f"{config.data_parallel_size}; create LLM(..., data_parallel_size=N) for N "
                             "replicas (nanovllm.dp)")
        self.config = config
        # Re-entrant: add_request validates under it and then queues under it again.
        self._lock = threading.RLock()
        self._requests = RequestTracker()
        self.tokenizer = load_engine_tokenizer(config)  # before the weights: a missing one fails fast
        self.executor: Executor = make_executor(config)
        self._running = True  # until shutdown
        try:
            self.num_kvcache_blocks = self.executor.info.num_kvcache_blocks
            self.eos_token_ids = eos_token_ids(config, self.tokenizer)
            stop_checker = StopChecker(self.eos_token_ids, config.max_model_len, self.tokenizer)
            self.scheduler = Scheduler(config, self.num_kvcache_blocks, stop_checker)
            self._grammars = GrammarCompiler(self.tokenizer, config.hf_config.vocab_size,
                                             self.eos_token_ids)
            self._overlap: OverlapLoop | None = None
            self._spec: SpeculativeDecoding | None = None  # speculative decoding (nanovllm.speculative)
            if config.speculative_config is not None:
                self._spec = SpeculativeDecoding(config, make_proposer(config, self.num_kvcache_blocks))
            if config.async_scheduling and self.executor.world_size == 1:
                self._overlap = OverlapLoop(self.scheduler, self.executor, self._run_sync,
                                            self._finish_requests, self._spec)
        except BaseException:
            self.shutdown()  # no worker outlives a failed constructor
            raise
        ensure_default_handler()
        logger.info(startup_line(config, self.executor.info))

    # ---- requests ----
    def add_request(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> int:
        """Validate and queue a request; returns its id. Bad input raises here and queues nothing. Its
        output waits for `take_outputs` once it finishes."""
        # A structured output's constraint compiles here, before the lock: steps go on meanwhile
        # (structured_outputs.GrammarCompiler says why synchronously); a bad one raises, nothing queued.
        constraint = getattr(sampling_params, "structured_outputs", None)
        grammar = (self._grammars.compile(constraint) if isinstance(constraint, StructuredOutputsParams)
                   else None)
        with self._lock:
            self._check_running()
            config = self.config
            token_ids, params = check_request(config, self.num_kvcache_blocks, self.tokenizer, prompt,
                                              sampling_params)
            seqs = make_sequences(token_ids, params, config.kvcache_block_size, self.eos_token_ids,
                                  self.tokenizer, grammar)
            request_id = self._requests.add(seqs)
            for seq in seqs:
                self.scheduler.add(seq)
            return request_id

    def take_outputs(self, request_ids: Container[int]) -> list[tuple[int, RequestOutput]]:
        """(id, output) of the finished requests among request_ids (a set), each handed out once; costs
        what finished, not len(request_ids)."""
        with self._lock:
            return self._requests.take_done(request_ids)

    def completion_token_ids(self, request_id: int, start: int = 0) -> list[int] | None:
        """The tokens a running request's first completion has generated so far, from index `start`
        (for streaming); None once it finished (its output has them all) or for an unknown id."""
        with self._lock:
            seqs = self._requests.live.get(request_id)
            if seqs is None:
                return None
            return seqs[0].token_ids[seqs[0].num_prompt_tokens + start:]

    def progress(self, request_id: int, starts: list[int]) -> RequestProgress | None:
        """What each of a running request's completions generated from token starts[i] on, with the
        logprobs it asked for (for streaming n > 1 and logprobs); None once it finished (its output
        has everything) or for an unknown id."""
        with self._lock:
            seqs = self._requests.live.get(request_id)
            if seqs is None:
                return None
            started = any(seq.num_computed_tokens or seq.status is not SequenceStatus.WAITING for seq in seqs)
            token_ids = [seq.token_ids[seq.num_prompt_tokens + start:] for seq, start in zip(seqs, starts)]
            logprobs = [None if seq.logprobs is None else seq.logprobs[start:start + len(new)]
                        for seq, start, new in zip(seqs, starts, token_ids)]
            return RequestProgress(started, token_ids, logprobs)

    def abort_request(self, request_ids: int | Iterable[int]) -> bool:
        """Stop a request (all n completions), or several at once, and free their KV blocks now,
        whatever their state (waiting, prefilling, decoding, preempted); each output ends with
        finish_reason "abort" (completions that had finished keep their own). True if any was live;
        unknown and already finished ids are skipped (a request may finish just before its abort
        arrives)."""
        ids = [request_ids] if isinstance(request_ids, int) else list(request_ids)
        with self._lock:
            live = [request_id for request_id in ids if request_id in self._requests.live]
            for request_id in live:
                self._finish_early(request_id, "abort")
            if live and self._overlap is not None:
                self._overlap.drop_if_idle()
            return bool(live)

    def _finish_early(self, request_id: int, reason: str, error: str | None = None) -> None:
        seqs = self._requests.live[request_id]
        for seq in seqs:
            if not seq.is_finished:
                self.scheduler.finish_early(seq, reason)
        output = request_output(seqs, self.tokenizer)
        if error is not None:
            output["error"] = error
        self._requests.finish(request_id, output)

    def _finish_requests(self, finished: list[Sequence]) -> None:
        """Make the outputs of the requests whose last sequence is among `finished`."""
        for seq in finished:
            request_id = request_id_of(seq)
            group = self._requests.live.get(request_id)  # None: a sibling finishing now ended it
            if group is not None and all(s.is_finished for s in group):
                self._requests.finish(request_id, request_output(group, self.tokenizer))

    # ---- the loop ----
    def step(self) -> StepResult:
        """Schedule and run one step (none when nothing is queued). With async_scheduling the step is
        launched, and the one before it finished (engine/overlap.py)."""
        with self._lock:
            if self.scheduler.is_finished():
                return StepResult(0, 0)
            self._check_running()
            spec, overlap = self._spec, self._overlap
            if overlap is not None and (spec is None or spec.overlaps
                                        or not spec.verifies_next(self.scheduler.running)):
                return StepResult(*overlap.step())
            if overlap is not None:
                overlap.drain()  # its tokens first: drafts follow a sequence's last token
                if self.scheduler.is_finished():
                    return StepResult(0, 0)
            seqs, is_prefill = self.scheduler.schedule()
            num_tokens = sum(seq.num_scheduled_tokens for seq in seqs)
            if spec is not None and any(seq.spec_token_ids for seq in seqs):
                return self._run_verify_step(seqs, is_prefill, num_tokens)
            self._run_sync(seqs, is_prefill)
            return StepResult(num_tokens, 0) if is_prefill else StepResult(0, num_tokens)

    def _run_verify_step(self, seqs: list[Sequence], is_prefill: bool, num_tokens: int) -> StepResult:
        """_run_sync for a step that verifies drafts: its decoding sequences count what they emitted."""
        decoding = [seq for seq in seqs if seq.num_uncomputed_tokens == 1]
        num_verified, before = sum(s.num_scheduled_tokens for s in decoding), sum(len(s) for s in decoding)
        self._run_sync(seqs, is_prefill)
        return StepResult(num_tokens - num_verified, sum(len(s) for s in decoding) - before)

    def _run_sync(self, seqs: list[Sequence], is_prefill: bool) -> None:
        """Run a scheduled step, wait for its tokens and postprocess it; a request whose part fails
        ends alone with finish_reason "error" (failures.py), the others go on."""
        executor = self.executor
        if executor.world_size > 1:  # a step that fails on many ranks cannot be re-run: check first
            failed = failures.sampling_failures(
                seqs, lambda part: executor.check_sampling(sampling_batch(part)))
            seqs = [seqs[i] for i in self._fail(seqs, failed)]
        spec = self._spec
        verify = spec is not None and any(seq.spec_token_ids for seq in seqs)
        run_model = self._run_verify if verify else self._run_model
        try:
            token_ids = run_model(seqs, is_prefill) if seqs else []
        except Exception:
            if executor.world_size > 1:
                self.shutdown()  # the workers are gone already; free rank 0's share as well
                raise
            token_ids, failed = failures.rerun_one_by_one(run_model, seqs, is_prefill)
            kept = self._fail(seqs, failed)
            seqs, token_ids = [seqs[i] for i in kept], [token_ids[i] for i in kept]
        if verify:
            self._finish_requests(self.scheduler.postprocess_verified(seqs, token_ids))
        else:
            self._finish_requests(self.scheduler.postprocess(seqs, token_ids))
        if spec is not None:
            spec.propose(self.scheduler.running, self.scheduler.block_manager.append_slot)

    def _fail(self, seqs: list[Sequence], failed: dict[int, str]) -> list[int]:
        """End each request with a failed sequence (all its completions, finish_reason "error", the
        error in its output); returns the indices in seqs of the other requests' sequences."""
        errors = {request_id_of(seq): error for seq in seqs if (error := failed.get(seq.seq_id))}
        for request_id, error in errors.items():
            self._finish_early(request_id, "error", error)
        return [i for i, seq in enumerate(seqs) if request_id_of(seq) not in errors]

    def _run_model(self, seqs: list[Sequence], is_prefill: bool) -> list[int | None]:
        """The sampled token of each sequence (None for those that only computed part of their prompt);
        records on them the logprobs and prompt logprobs they asked for."""
        batch = build_batch(seqs, is_prefill)
        return record_step(seqs, batch.sample_rows, self.executor.run(batch))

    def _run_verify(self, seqs: list[Sequence], is_prefill: bool) -> list:
        """_run_model for a step in which some sequences verify drafts: what each emitted."""
        batch = build_batch(seqs, is_prefill)
        return self._spec.record(seqs, batch, self.executor.run(batch))

    def is_finished(self) -> bool:
        """True when no request is queued or running."""
        with self._lock:
            return self.scheduler.is_finished()

    def stats(self) -> SchedulerStats:
        with self._lock:
            scheduler = self.scheduler
            return SchedulerStats(len(scheduler.running), len(scheduler.waiting),
                                  scheduler.block_manager.num_free_blocks, self.num_kvcache_blocks,
                                  scheduler.num_preemptions, self._spec and self._spec.stats())

    # ---- lifetime ----
    def _check_running(self) -> None:
        if not self._running:
            raise RuntimeError("this LLM is shut down (exit() was called, or a tensor-parallel worker "
                               "failed); create a new one")

    def shutdown(self) -> None:
        """Stop the executor's ranks and free the model and its KV cache; any later call raises
        RuntimeError. Idempotent."""
        self._overlap = None  # a step in flight is dropped with the model
        if self._running:
            self._running = False
            if getattr(self, "_spec", None) is not None:  # None when the constructor failed before it
                self._spec.shutdown()
            self.executor.shutdown()
