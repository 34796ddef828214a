"""The engine: validates and tokenizes requests, schedules steps, runs each on the model runner (and
the tensor-parallel workers) and turns finished sequences into outputs. `add_request`, `step` and
`is_finished` are the loop; `abort_request` retires a request early; nanovllm.llm.LLM drives it for
`generate` and `stream`. A request is its n sequences (SamplingParams.n completions, request.py),
finished, aborted or failed together; its id is its first sequence's.

Threads: one engine may be driven from several threads at once (generate, stream, add_request, step,
abort_request, the server's loop): `lock` serializes the steps, and each caller gets exactly its own
requests' outputs, whichever thread ran the step that finished them (request_tracker.py).

Steps run in sync_loop.py (a request whose step fails ends alone, with finish_reason "error"), or with
async_scheduling (Config; on by default on CUDA with one rank) in overlap.py, which launches each step
before it waits for the previous one's sampled ids: a step's tokens reach its sequences one `advance`
later.

With tensor_parallel_size=N > 1, the engine's own ModelRunner is rank 0 and ranks 1..N-1 run in
worker processes (nanovllm.distributed.worker). `shutdown()` stops them and frees the model; it also
happens when a step fails under tensor parallelism (a dead worker, Ctrl-C), after which every call
raises RuntimeError."""

import threading
from collections.abc import Container
from contextlib import nullcontext
from dataclasses import dataclass

from nanovllm.config import Config
from nanovllm.distributed.worker import TPWorkers
from nanovllm.engine.overlap import OverlapLoop
from nanovllm.engine.request import make_sequences, request_output
from nanovllm.engine.request_tracker import RequestTracker, request_id_of
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.stop_checker import StopChecker, eos_token_ids
from nanovllm.engine.sync_loop import SyncLoop
from nanovllm.engine.validation import Prompt, check_request, tokenize_prompt
from nanovllm.outputs import RequestOutput
from nanovllm.runner.batch import StepBatch, StepOutput, build_batch
from nanovllm.runner.model_runner import ModelRunner
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.log import ensure_default_handler, logger, startup_line
from nanovllm.utils.tokenizer import load_engine_tokenizer


@dataclass(slots=True)
class StepResult:
    outputs: list[tuple[int, RequestOutput]]  # (request id, output) of add_request requests that finished
    num_prefill_tokens: int  # prompt tokens computed in the step
    num_decode_tokens: int  # tokens decoded in the step


class LLMEngine:
    def __init__(self, model: str, **options) -> None:
        self.config = config = Config.from_options(model, **options)
        if config.data_parallel_size != 1:
            raise ValueError(f"an LLMEngine is one engine, but data_parallel_size="
                             f"{config.data_parallel_size}; create LLM(..., data_parallel_size=N) for N "
                             "replicas (nanovllm.dp)")
        # Re-entrant: a caller may hold it across take_output and advance, which take it again.
        self.lock = threading.RLock()
        self.requests = RequestTracker()
        self.tokenizer = load_engine_tokenizer(config)
        # Ranks 1..N-1 start loading in their own processes while rank 0 loads here.
        self.workers = TPWorkers(config) if config.tensor_parallel_size > 1 else None
        self.model_runner: ModelRunner | None = None
        self.overlap: OverlapLoop | None = None  # with async_scheduling
        try:
            with self.workers.scope() if self.workers else nullcontext():
                self.model_runner = ModelRunner(config)
            # What the memory allowed; the option (config.num_kvcache_blocks) stays what the user asked.
            self.num_kvcache_blocks = self.model_runner.num_kvcache_blocks
            self.eos_token_ids = eos_token_ids(config, self.tokenizer)
            stop_checker = StopChecker(self.eos_token_ids, config.max_model_len, self.tokenizer)
            self.scheduler = Scheduler(config, self.num_kvcache_blocks, stop_checker)
            check = self.model_runner.check_sampling if self.workers is not None else None
            self.sync = SyncLoop(self.scheduler, self._run_batch, check, self._finish_early,
                                 self._finish_requests)
            if config.async_scheduling:
                self.overlap = OverlapLoop(self.scheduler, self.model_runner, self.sync.run,
                                           self._finish_requests)
        except BaseException:
            self.shutdown()  # no worker outlives a failed constructor
            raise
        ensure_default_handler()
        runner = self.model_runner
        threads = runner.cpu_threads.num_threads if runner.cpu_threads is not None else None
        logger.info(startup_line(config, runner.device, runner.dtype, runner.backend.name, threads,
                                 self.num_kvcache_blocks))

    # ---- requests ----
    def make_request(self, prompt: Prompt, params: SamplingParams | None) -> list[Sequence]:
        """Validate and tokenize one request without queueing it: its n sequences (one per
        completion). Bad input raises here."""
        self._check_running()
        config, tokenizer = self.config, self.tokenizer
        token_ids, params = check_request(config, self.num_kvcache_blocks, tokenizer, prompt, params)
        return make_sequences(token_ids, params, config.kvcache_block_size, self.eos_token_ids, tokenizer)

    def make_sequence(self, prompt: Prompt, params: SamplingParams | None) -> Sequence:
        """`make_request` for a request of one completion (n=1), as one Sequence."""
        if len(seqs := self.make_request(prompt, params)) != 1:
            raise ValueError(f"make_sequence makes one sequence, but n={len(seqs)}; use make_request")
        return seqs[0]

    def add_sequence(self, seq: Sequence | list[Sequence]) -> int:
        """Queue a request from `make_sequence`/`make_request`; its output comes back from `step()`."""
        with self.lock:
            return self._queue(seq if isinstance(seq, list) else [seq], tracked=False)

    def add_request(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> int:
        """Queue a request; returns its id. Bad input raises here and leaves the engine untouched.
        Its output comes back from the `step()` call that finishes it, or a later one."""
        return self.add_sequence(self.make_request(prompt, sampling_params))

    def start_request(self, seqs: list[Sequence]) -> int:
        """Queue a request from `make_request` whose progress the caller follows itself: tokens
        appear in each `seq.completion_token_ids` as steps run, and the output is collected once with
        `take_output(request id)`; `step()` never returns it. Returns the request id."""
        with self.lock:
            return self._queue(seqs, tracked=True)

    def _queue(self, seqs: list[Sequence], tracked: bool) -> int:
        request_id = self.requests.add(seqs, tracked)
        for seq in seqs:
            self.scheduler.add(seq)
        return request_id

    def take_output(self, request_id: int) -> RequestOutput | None:
        """The output of a finished `start_request` request (once), or None while it runs."""
        with self.lock:
            return self.requests.take(request_id)

    def take_outputs(self, request_ids: Container[int]) -> list[tuple[int, RequestOutput]]:
        """(id, output) of the finished `start_request` requests among request_ids (a set), each once;
        costs what finished, not len(request_ids)."""
        with self.lock:
            return self.requests.take_done(request_ids)

    def abort_request(self, request_id: int) -> bool:
        """Stop a request (all n completions) and free its KV blocks at once, whatever its state
        (waiting, prefilling, decoding, preempted). Returns True if it was live; an unknown or already
        finished id is a no-op that returns False, since a request may finish just before its abort
        arrives. An aborted `add_request` request is not returned by `step()`; a tracked one ends
        with finish_reason "abort" (its completions that had finished keep their own)."""
        with self.lock:
            if request_id not in self.requests.live:
                return False
            self._finish_early(request_id, "abort")
            if self.overlap is not None:
                self.overlap.drop_if_idle()
            return True

    def abandon(self, request_ids: list[int]) -> None:
        """The caller of these tracked requests is gone (an exception, Ctrl-C, a closed stream):
        abort them and drop their outputs."""
        with self.lock:
            for request_id in request_ids:
                self.abort_request(request_id)
                self.requests.forget(request_id)

    def _finish_early(self, request_id: int, reason: str, error: str | None = None) -> None:
        seqs = self.requests.live[request_id]
        for seq in seqs:
            if not seq.is_finished:
                self.scheduler.finish_early(seq, reason)
        output = request_output(seqs, self.tokenizer)
        if error is not None:
            output["error"] = error
        self.requests.finish(request_id, output, report=reason != "abort")

    # ---- lifetime ----
    def _check_running(self) -> None:
        if self.model_runner is None:
            raise RuntimeError("this LLM is shut down (exit() was called, or a tensor-parallel worker "
                               "failed); create a new one")

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers and free the model and its KV cache; any later call raises
        RuntimeError. Idempotent."""
        if self.workers is not None:
            self.workers.shutdown()
        self.overlap = None  # a step in flight is dropped with the model
        if self.model_runner is not None:
            runner, self.model_runner = self.model_runner, None
            runner.release()

    # ---- the loop ----
    def _run_batch(self, batch: StepBatch) -> StepOutput:
        """Run one batch on every rank; rank 0's output."""
        self._check_running()
        if self.workers is None:
            return self.model_runner.run(batch)
        try:
            return self.workers.run(self.model_runner, batch)
        except BaseException:
            self.shutdown()  # the workers are gone already; free rank 0's share as well
            raise

    def _finish_requests(self, finished: list[Sequence]) -> None:
        """Make the outputs of the requests whose last sequence is among `finished`."""
        for seq in finished:
            request_id = request_id_of(seq)
            group = self.requests.live.get(request_id)  # None: a sibling finishing now ended it
            if group is not None and all(s.is_finished for s in group):
                self.requests.finish(request_id, request_output(group, self.tokenizer))

    def advance(self) -> StepResult:
        """Schedule and run one step (none when nothing is queued), for callers that collect their own
        requests with `take_output`: the outputs of `add_request` requests stay for `step()`, and
        the result's `outputs` is empty. With async_scheduling the step is launched, and the one
        before it is finished (engine/overlap.py): a request's output comes one call later."""
        with self.lock:
            if self.scheduler.is_finished():
                return StepResult([], 0, 0)
            self._check_running()
            num_tokens, is_prefill = (self.overlap or self.sync).step()
            return StepResult([], num_tokens if is_prefill else 0, 0 if is_prefill else num_tokens)

    def run_step(self) -> StepResult:
        """Schedule and run one step; returns the (request id, output) of the `add_request` requests
        that finished (in this step, or in steps that generate/stream calls ran since) and how many
        tokens were computed."""
        with self.lock:
            result = self.advance()
            result.outputs = self.requests.drain_unreturned()
            return result

    def step(self) -> tuple[list[tuple[int, RequestOutput]], int]:
        """Run one step (nano-vllm's shape). Returns the (request id, output) of `add_request`
        requests that finished, and the number of tokens computed: positive for a prefill step,
        negative for a decode step, 0 when nothing was left to run."""
        result = self.run_step()
        return result.outputs, result.num_prefill_tokens or -result.num_decode_tokens

    def is_finished(self) -> bool:
        """True when nothing is queued and `step()` has returned every `add_request` output."""
        with self.lock:
            return self.scheduler.is_finished() and not self.requests.unreturned

    def prompt_logits(self, token_ids: list[int]):
        """The model's next-token logits after a whole prompt ([vocab] tensor), from one prefill through
        this engine's own runner (prefix cache included) on blocks lent by the block manager and given
        back: for checks against a reference implementation. Single-rank engines only."""
        self._check_running()
        if self.workers is not None:
            raise ValueError("prompt_logits runs on single-rank engines only (tensor_parallel_size=1)")
        token_ids = tokenize_prompt(token_ids, self.tokenizer, self.config.hf_config.vocab_size)
        seq = Sequence(token_ids, block_size=self.config.kvcache_block_size)
        block_manager = self.scheduler.block_manager
        block_manager.allocate(seq)
        try:
            seq.num_scheduled_tokens = seq.num_uncomputed_tokens
            return self.model_runner.logits(build_batch([seq], is_prefill=True))[0]
        finally:
            block_manager.deallocate(seq)
