"""`DataParallelEngine`: the engine behind `LLM(model, data_parallel_size=N, ...)` when N > 1. It speaks
LLMEngine's protocol (add_request, step, take_outputs, completion_token_ids, abort_request,
is_finished, stats, shutdown) over N replicas, each an LLMEngine in an engine process of its own
(engine_core.py) on its own devices, so `generate`, `chat`, `stream` and nano-vllm's loop work as with
one engine.

Everything is checked here, in the caller's process, before a request leaves it: the options once
(Config) before a replica is spawned, and every prompt (tokenized here, checked against the smallest
replica's KV cache), so bad input raises ValueError/TypeError and the replicas never see it. Each
request goes to the replica with the fewest tokens outstanding (prompt + max_tokens).

`step()` waits for the replicas' next step messages (each replica steps on its own, as fast as it
can) and takes in their new tokens and finished outputs. A replica that dies or fails makes the call
in progress raise DataParallelError (a RuntimeError) naming it, its pid and devices and how it ended;
every replica is then shut down. `shutdown()`, garbage collection and interpreter exit stop them all
and remove what they held."""

import weakref
from collections.abc import Container, Iterable
from dataclasses import dataclass
from itertools import count, zip_longest
from multiprocessing.connection import wait

from nanovllm.config import Config
from nanovllm.dp.engine_process import EngineProcess, EngineStartError
from nanovllm.dp.replica import placements
from nanovllm.engine.llm_engine import SchedulerStats, StepResult
from nanovllm.engine.validation import Prompt, check_request
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import SamplingParams
from nanovllm.speculative.decoding import SpecDecodeStats
from nanovllm.utils.tokenizer import load_engine_tokenizer

SPAWN_HINT = ("Replicas are started with the 'spawn' method, which re-imports your main script: create the "
              "LLM under `if __name__ == '__main__':`.")


class DataParallelError(RuntimeError):
    """A data-parallel replica died or failed; every replica is shut down."""


@dataclass(slots=True)
class _Remote:
    replica: EngineProcess
    cost: int  # prompt + max_tokens, counted against the replica until the request ends
    token_ids: list[int]  # its first completion's tokens so far


def _close_all(replicas: list[EngineProcess]) -> None:
    for replica in replicas:
        replica.close()


class DataParallelEngine:
    def __init__(self, config: Config, options: dict) -> None:
        self.config = config
        self.tokenizer = load_engine_tokenizer(config)
        self.replicas: list[EngineProcess] = []
        # Also at interpreter exit: a non-daemon child that was never stopped would hang it.
        self._finalizer = weakref.finalize(self, _close_all, self.replicas)
        self.failure: str | None = None
        replica_options = {**options, "data_parallel_size": 1}
        try:
            for index, placement in enumerate(placements(config)):
                self.replicas.append(EngineProcess(index, config.model, replica_options, placement))
            for replica in self.replicas:
                replica.wait_ready()
        except EngineStartError as e:
            self.shutdown()
            error = f"{e}\n{SPAWN_HINT}" + (f"\n{e.traceback}" if e.traceback else "")
            raise DataParallelError(error) from None
        except BaseException:
            self.shutdown()  # no replica outlives a failed constructor
            raise
        # A request must fit whichever replica it goes to.
        self.num_kvcache_blocks = min(replica.info.num_kvcache_blocks for replica in self.replicas)
        self._ids = count()
        self._live: dict[int, _Remote] = {}
        self._done: dict[int, RequestOutput] = {}
        self._load = {replica.index: 0 for replica in self.replicas}  # tokens outstanding
        self._counted = {replica.index: (0, 0) for replica in self.replicas}  # prefill, decode so far

    # ---- requests ----
    def add_request(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> int:
        self._check_running()
        token_ids, params = check_request(self.config, self.num_kvcache_blocks, self.tokenizer, prompt,
                                          sampling_params)
        replica = min(self.replicas, key=lambda r: self._load[r.index])
        request_id = next(self._ids)
        cost = len(token_ids) + params.max_tokens * params.n
        self._load[replica.index] += cost
        self._live[request_id] = _Remote(replica, cost, [])
        replica.send(("add", request_id, token_ids, params))
        return request_id

    def take_outputs(self, request_ids: Container[int]) -> list[tuple[int, RequestOutput]]:
        ready = [request_id for request_id in self._done if request_id in request_ids]
        return [(request_id, self._done.pop(request_id)) for request_id in ready]

    def completion_token_ids(self, request_id: int, start: int = 0) -> list[int] | None:
        remote = self._live.get(request_id)
        return None if remote is None else remote.token_ids[start:]

    def progress(self, request_id: int, starts: list[int]) -> None:
        raise NotImplementedError(
            "progress() reads every completion's tokens and logprobs inside one engine; a "
            "DataParallelEngine's replicas send each request's first completion only until it ends: use "
            "completion_token_ids() and the finished output")

    def abort_request(self, request_ids: int | Iterable[int]) -> bool:
        """Stop requests on their replicas (one id, or several at once); returns once the replicas have
        ended them (their outputs, with finish_reason "abort", then wait for take_outputs). True if
        any was live; unknown and finished ids are skipped."""
        ids = [request_ids] if isinstance(request_ids, int) else list(request_ids)
        live = [request_id for request_id in ids if request_id in self._live]
        for request_id in live:
            self._live[request_id].replica.send(("abort", request_id))
        while any(request_id in self._live for request_id in live):
            self._receive()
        return bool(live)

    # ---- the loop ----
    def step(self) -> StepResult:
        """Wait until some replica reports progress, and take it in; nothing to wait for when no
        request is live."""
        if not self._live:
            return StepResult(0, 0)
        return self._receive()

    def _receive(self) -> StepResult:
        self._check_running()
        replicas = self.replicas
        ready = wait([*(r.outbox for r in replicas), *(r.process.sentinel for r in replicas)])
        num_prefill = num_decode = 0
        for replica in replicas:
            if replica.outbox not in ready:  # before the sentinel: what it sent before dying counts
                if replica.process.sentinel in ready:
                    self._fail(replica)
                continue
            try:
                kind, *payload = replica.outbox.recv()
            except (EOFError, OSError):
                self._fail(replica)
            if kind == "error":
                replica.traceback = payload[0]
                self._fail(replica)
            updates, stats = payload
            replica.stats = stats
            prefill, decode = self._counted[replica.index]
            num_prefill += stats.num_prefill_tokens - prefill
            num_decode += stats.num_decode_tokens - decode
            self._counted[replica.index] = (stats.num_prefill_tokens, stats.num_decode_tokens)
            for request_id, new_token_ids, output in updates:
                remote = self._live[request_id]
                remote.token_ids += new_token_ids
                if output is not None:
                    del self._live[request_id]
                    self._load[replica.index] -= remote.cost
                    self._done[request_id] = output
        return StepResult(num_prefill, num_decode)

    def is_finished(self) -> bool:
        return not self._live

    def stats(self) -> SchedulerStats:
        """The replicas' figures as of their latest step messages, summed."""
        stats = [replica.stats for replica in self.replicas]
        spec = None
        if self.config.speculative_config is not None:
            per_pos = tuple(map(sum, zip_longest(*(s.num_spec_accepted_tokens_per_pos for s in stats),
                                                 fillvalue=0)))
            spec = SpecDecodeStats(sum(s.num_spec_drafts for s in stats),
                                   sum(s.num_spec_draft_tokens for s in stats),
                                   sum(s.num_spec_accepted_tokens for s in stats), per_pos)
        return SchedulerStats(sum(s.num_running for s in stats), sum(s.num_waiting for s in stats),
                              sum(s.num_free_blocks for s in stats),
                              sum(replica.info.num_kvcache_blocks for replica in self.replicas),
                              sum(s.num_preemptions for s in stats), spec)

    # ---- lifetime ----
    def _check_running(self) -> None:
        if self._finalizer.alive:
            return
        why = self.failure or "shutdown() was called"
        raise DataParallelError(f"the data-parallel replicas are shut down ({why}); create a new LLM")

    def _fail(self, replica: EngineProcess) -> None:
        """`replica` died or failed: shut every replica down and raise."""
        self.failure = replica.describe_end()
        if replica.traceback:
            self.failure += f"; its error:\n{replica.traceback}"
        self.shutdown()
        raise DataParallelError(f"{self.failure}\nEvery replica is shut down; create a new LLM.")

    def shutdown(self) -> None:
        """Stop every replica (each shuts its own engine down) and remove what they held; any later
        call raises DataParallelError. Idempotent."""
        self._finalizer()
