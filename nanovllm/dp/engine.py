"""`DataParallelEngine`: the engine behind `LLM(model, data_parallel_size=N, ...)` when N > 1. It speaks
LLMEngine's protocol (add_request, step, take_outputs, completion_token_ids, abort_request,
is_finished, stats, shutdown) over N replicas, each an LLMEngine in an engine process of its own
(engine_core.py) on its own devices, so `generate`, `chat`, `stream` and nano-vllm's loop work as with
one engine.

Everything is checked here, in the caller's process, before a request leaves it: the options once
(Config) before a replica is spawned, and every prompt (tokenized here, checked against the smallest
replica's KV cache), so bad input raises ValueError/TypeError and the replicas never see it. Each
request goes to the replica with the fewest tokens outstanding (prompt + max_tokens).

Each replica steps on its own, as fast as it can; a thread of the caller's process (receiver.py)
takes in their new tokens and finished outputs as they come, and `step()` waits for the next of them. A
replica that dies or fails makes the call in progress raise DataParallelError (a RuntimeError) naming
it, its pid and devices and how it ended; every replica is then shut down. `shutdown()`, garbage
collection and interpreter exit stop them all and remove what they held."""

import weakref
from collections.abc import Container, Iterable
from itertools import count, zip_longest

from nanovllm.config import Config
from nanovllm.dp.engine_process import EngineProcess, EngineStartError
from nanovllm.dp.receiver import Receiver, Remote
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


def _shut_down(receiver: Receiver, replicas: list[EngineProcess]) -> None:
    receiver.stop()  # first: closing a replica reads its pipe
    for replica in replicas:
        replica.close()


class DataParallelEngine:
    def __init__(self, config: Config, options: dict) -> None:
        self.config = config
        self.tokenizer = load_engine_tokenizer(config)
        self.replicas: list[EngineProcess] = []
        self.receiver = Receiver(self.replicas)
        # Also at interpreter exit: a non-daemon child that was never stopped would hang it.
        self._finalizer = weakref.finalize(self, _shut_down, self.receiver, self.replicas)
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
        self.receiver.start()

    # ---- requests ----
    def add_request(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> int:
        self._check_running()
        token_ids, params = check_request(self.config, self.num_kvcache_blocks, self.tokenizer, prompt,
                                          sampling_params)
        receiver = self.receiver
        with receiver.changed:
            replica = min(self.replicas, key=lambda r: receiver.load[r.index])
            request_id = next(self._ids)
            cost = len(token_ids) + params.max_tokens * params.n
            # Sent before it is recorded: a Ctrl-C in between leaves a request nobody waits for (the
            # receiver aborts it), never one waited for that no replica has.
            replica.send(("add", request_id, token_ids, params))
            receiver.live[request_id] = Remote(replica, cost, [])
            receiver.load[replica.index] += cost
        return request_id

    def take_outputs(self, request_ids: Container[int]) -> list[tuple[int, RequestOutput]]:
        done = self.receiver.done
        with self.receiver.changed:
            ready = [request_id for request_id in done if request_id in request_ids]
            return [(request_id, done.pop(request_id)) for request_id in ready]

    def completion_token_ids(self, request_id: int, start: int = 0) -> list[int] | None:
        with self.receiver.changed:
            remote = self.receiver.live.get(request_id)
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
        receiver = self.receiver
        with receiver.changed:
            replicas = {request_id: receiver.live[request_id].replica
                        for request_id in ids if request_id in receiver.live}
        if not replicas:
            return False
        for request_id, replica in replicas.items():
            replica.send(("abort", request_id))
        receiver.wait_ended(list(replicas))
        self._check_running()
        return True

    # ---- the loop ----
    def step(self) -> StepResult:
        """Wait until some replica reports progress; the tokens computed since the last step. Nothing
        to wait for when no request is live."""
        if not self.receiver.live:  # as LLMEngine's: nothing to run, whatever the state
            return self.receiver.take_news()
        self._check_running()
        news = self.receiver.take_news()
        self._check_running()
        return news

    def is_finished(self) -> bool:
        return not self.receiver.live

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
        """Raise DataParallelError if a replica failed (shutting every replica down first) or if the
        replicas are shut down."""
        failure = self.receiver.failure
        if self._finalizer.alive:
            if failure is None:
                return
            self.shutdown()
            raise DataParallelError(f"{failure}\nEvery replica is shut down; create a new LLM.")
        why = failure or "shutdown() was called"
        raise DataParallelError(f"the data-parallel replicas are shut down ({why}); create a new LLM")

    def shutdown(self) -> None:
        """Stop every replica (each shuts its own engine down) and remove what they held; any later
        call raises DataParallelError. Idempotent."""
        self._finalizer()
