"""An engine in a process of its own, as vLLM's EngineCore: a data-parallel replica (dp/engine.py), or
the server's engine process (nanovllm.serve). It owns an LLMEngine (and, through it, any tensor-parallel
workers) and runs its steps, so that its parent's per-token Python work (detokenizing, server-sent
events) runs beside the steps instead of taking turns with them for one GIL.

Messages, over two one-way pipes:

    HTTP -> engine   [message, ...], batched, each one of
                     ("add", request id, prompt token ids, SamplingParams)   ("abort", request id)
                     ("stop",): abort everything in flight, publish it, exit
    engine -> HTTP   ("ready", ReplicaInfo)         once the engine is built: its KV blocks, and what a
                                                    kill would leave behind (nanovllm.dp.replica)
                     ("step", updates, EngineStats) after each step (or inbox drain) that changed
                                                    anything: one message for all requests, each
                                                    update (request id, new token ids, output or None)
                                                    of the request's first completion; with
                                                    `detailed` (the server) a fourth item, None or a
                                                    Details: every completion's new tokens and
                                                    logprobs, and the request's queue time;
                                                    with requests, at least every KEEPALIVE_S (the
                                                    server takes a long silence for a hang)
                     ("error", traceback)           just before it exits with code 1

The parent checked every request already; a request the engine still rejects (add_request's
TypeError, ValueError or ImportError) ends at once with finish_reason "error" and `refused: True` in
its output, and the loop goes on. The process ignores Ctrl-C (it reaches the whole process
group; the parent decides how to stop), takes SIGTERM as a request to clean up and leave, and exits by
itself when its parent goes away."""

import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

from nanovllm.config import Config
from nanovllm.distributed.executor import make_executor
from nanovllm.dp.replica import Placement, replica_info
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.utils.parent_watch import become_engine_child, exit_released

# A traceback goes through the pipe before the process exits: keep it well under the pipe's buffer
# (64 KiB on Linux) so that sending it never blocks a dying process.
MAX_ERROR_CHARS = 8 * 1024
FINISH_REASONS = ("stop", "length", "abort", "error")
# With requests in flight, a step message goes out at least this often, also when the steps changed
# nothing the HTTP process sees (prompt chunks that took no new block): the watchdog there
# (engine_client.STEP_TIMEOUT_S) must hear from an engine that is working.
KEEPALIVE_S = 1.0


@dataclass(slots=True, frozen=True)
class EngineStats:
    """The figures behind /metrics, as of the step that sent them (the counters since start)."""
    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_preemptions: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    finish_reasons: tuple[int, ...] = (0,) * len(FINISH_REASONS)  # counts in FINISH_REASONS' order
    num_prefill_tokens: int = 0  # prompt tokens computed (a preempted request's again)
    num_decode_tokens: int = 0  # tokens decoded
    # Prompt tokens looked up in the prefix cache (each completion's, at its first admission) and
    # those found there (block_manager.num_cache_hit_tokens: re-admissions after preemption count too).
    num_prefix_cache_queries: int = 0
    num_prefix_cache_hits: int = 0
    # Speculative decoding (nanovllm.speculative.decoding.SpecDecodeStats), 0 and () when it is off.
    num_spec_drafts: int = 0
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    num_spec_accepted_tokens_per_pos: tuple[int, ...] = ()


@dataclass(slots=True)
class Details:
    """What a server's update adds to (request id, new token ids, output): each completion's new tokens
    and their logprobs (n > 1, or logprobs asked for; the last update's are in its output), and the
    seconds from the request's arrival here to its first step (once)."""
    token_ids: list[list[int]] | None = None
    logprobs: list[list[dict[int, float]]] | None = None
    queue_time: float | None = None


@dataclass(slots=True)
class _Tracked:
    engine_request_id: int
    num_sent: int = 0  # its first completion's tokens sent to the parent so far
    arrival: float = 0.0  # when the "add" arrived (detailed only)
    scheduled: bool = False  # whether its queue time was sent (detailed only)
    # detailed, n > 1 or logprobs: tokens sent so far per completion
    num_sent_each: list[int] | None = None


class EngineCore:
    """The loop: drain the inbox, run a step, publish what changed."""

    def __init__(self, engine: LLMEngine, outbox: Connection, clock: Callable[[], float] = time.monotonic,
                 detailed: bool = False) -> None:
        self.engine, self.outbox, self.clock, self.detailed = engine, outbox, clock, detailed
        self.last_sent = clock()
        self.requests: dict[int, _Tracked] = {}  # by the HTTP process's request id
        self.rejected: list[tuple] = []  # updates for requests refused here
        self.num_prompt_tokens = self.num_generation_tokens = 0
        self.num_prefill_tokens = self.num_decode_tokens = 0
        self.num_prefix_cache_queries = 0
        self.finish_reasons: Counter[str] = Counter()
        self.last_stats: EngineStats | None = None
        self.step_started = clock()  # when the latest step began: a request's first one ends its queue time

    def run(self, inbox: Connection) -> None:
        while True:
            # Idle: block until a request arrives. Busy: take what is there and step.
            messages = inbox.recv() if not self.requests else []
            while inbox.poll():
                messages += inbox.recv()
            for message in messages:
                if message[0] == "stop":
                    for tracked in self.requests.values():
                        self.engine.abort_request(tracked.engine_request_id)
                    self.publish()
                    return
                self.handle(message)
            if self.requests:
                self.step_started = self.clock()
                result = self.engine.step()
                self.num_prefill_tokens += result.num_prefill_tokens
                self.num_decode_tokens += result.num_decode_tokens
            self.publish()

    def handle(self, message: tuple) -> None:
        if message[0] == "add":
            _, request_id, prompt_token_ids, params = message
            try:
                engine_request_id = self.engine.add_request(prompt_token_ids, params)
            except (TypeError, ValueError, ImportError) as e:  # ImportError: structured outputs' extra
                # `refused`: the request's fault (the server answers 400), not the engine's (500).
                error = {"finish_reason": "error", "error": f"the engine refused the request: {e}",
                         "text": "", "token_ids": [], "refused": True}
                update = (request_id, [], error)
                self.rejected.append((*update, None) if self.detailed else update)
                return
            tracked = self.requests[request_id] = _Tracked(engine_request_id)
            if self.detailed:
                tracked.arrival = self.clock()
                if params.n > 1 or params.logprobs is not None:
                    tracked.num_sent_each = [0] * params.n
            self.num_prompt_tokens += len(prompt_token_ids)
            self.num_prefix_cache_queries += len(prompt_token_ids) * params.n
        elif message[0] == "abort":
            tracked = self.requests.get(message[1])
            if tracked is not None:  # else it finished before the abort arrived
                self.engine.abort_request(tracked.engine_request_id)
        else:
            raise AssertionError(f"unknown message {message[0]!r} from the HTTP process")

    def publish(self) -> None:
        """Send every request's new tokens, the last update with its output, in one message; also
        when only the figures changed (an abort freed blocks), so that /metrics stays current."""
        updates, self.rejected = self.rejected, []
        engine = self.engine
        for request_id, tracked in list(self.requests.items()):
            output = None
            new_token_ids = engine.completion_token_ids(tracked.engine_request_id, tracked.num_sent)
            if new_token_ids is None:  # finished: its output holds the rest
                ((_, output),) = engine.take_outputs({tracked.engine_request_id})
                new_token_ids = output["token_ids"][tracked.num_sent:]
            details = self._details(tracked, output) if self.detailed else None
            if output is None and not new_token_ids and details is None:
                continue
            updates.append((request_id, new_token_ids, output, details) if self.detailed
                           else (request_id, new_token_ids, output))
            self.num_generation_tokens += len(new_token_ids)
            tracked.num_sent += len(new_token_ids)
            if output is not None:
                del self.requests[request_id]
                # The other completions' tokens that were not counted as they streamed.
                each = tracked.num_sent_each
                self.num_generation_tokens += sum(len(c["token_ids"]) - (each[c["index"]] if each else 0)
                                                  for c in output["outputs"][1:])
        for update in updates:
            if update[2] is not None:
                self.finish_reasons[update[2]["finish_reason"]] += 1
        stats = self.stats()
        now = self.clock()
        if updates or stats != self.last_stats or (self.requests and now - self.last_sent >= KEEPALIVE_S):
            self.outbox.send(("step", updates, stats))
            self.last_stats, self.last_sent = stats, now

    def _details(self, tracked: _Tracked, output: dict | None) -> Details | None:
        details = None
        progress = None if output is not None else self.engine.progress(
            tracked.engine_request_id, tracked.num_sent_each or [0])
        if not tracked.scheduled and (progress is None or progress.started):
            tracked.scheduled = True
            details = Details(queue_time=max(0.0, self.step_started - tracked.arrival))
        if tracked.num_sent_each is None or progress is None:  # the output has the rest
            return details
        for i, new in enumerate(progress.token_ids):
            tracked.num_sent_each[i] += len(new)
            if i:
                self.num_generation_tokens += len(new)
        if any(progress.token_ids):
            details = details or Details()
            details.token_ids = progress.token_ids
            logprobs = [lps or [] for lps in progress.logprobs]
            details.logprobs = logprobs if any(logprobs) else None
        return details

    def stats(self) -> EngineStats:
        now = self.engine.stats()
        block_manager = getattr(getattr(self.engine, "scheduler", None), "block_manager", None)
        spec = getattr(now, "spec_decode", None)
        spec_figures = () if spec is None else (spec.num_drafts, spec.num_draft_tokens,
                                                spec.num_accepted_tokens, spec.num_accepted_tokens_per_pos)
        return EngineStats(now.num_running, now.num_waiting, now.num_free_blocks, now.num_preemptions,
                           self.num_prompt_tokens, self.num_generation_tokens,
                           tuple(self.finish_reasons[reason] for reason in FINISH_REASONS),
                           self.num_prefill_tokens, self.num_decode_tokens, self.num_prefix_cache_queries,
                           getattr(block_manager, "num_cache_hit_tokens", 0), *spec_figures)


def engine_main(index: int, model: str, options: dict, placement: Placement | None, inbox: Connection,
                outbox: Connection, detailed: bool = False) -> None:
    """The entry point of engine process `index` (spawned by nanovllm.dp.engine_process): with
    data_parallel_size > 1, one replica, on the devices or cores of `placement`. detailed: the
    server's engine (updates carry Details)."""
    become_engine_child("server engine")
    exit_code = 0
    engine = None
    try:
        if placement is not None:
            placement.apply()
        import torch

        engine = LLMEngine(Config.from_options(model, **options), make_executor)
        if index:  # replicas built with one seed would sample alike: each draws its own stream
            torch.manual_seed(engine.config.seed + index)
        outbox.send(("ready", replica_info(engine)))
        EngineCore(engine, outbox, detailed=detailed).run(inbox)
    except BaseException:
        exit_code = 1
        try:
            outbox.send(("error", traceback.format_exc()[-MAX_ERROR_CHARS:]))
        except OSError:
            pass  # the HTTP process is gone; nobody is left to tell
    finally:
        if engine is not None:
            engine.shutdown()
    del engine
    exit_released(exit_code)
