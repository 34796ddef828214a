"""The server's engine process: it owns the LLM (and, through it, any tensor-parallel workers) and
runs its steps, so that the HTTP process's per-token Python work (detokenizing, server-sent events)
runs beside the steps instead of taking turns with them for one GIL (vLLM's EngineCore does the same).

Messages, over two one-way pipes:

    HTTP -> engine   [message, ...], batched, each one of
                     ("add", request id, prompt token ids, SamplingParams)   ("abort", request id)
                     ("stop",): abort everything in flight, publish it, exit
    engine -> HTTP   ("ready", ReplicaInfo)         once the LLM is built: its KV blocks, and what a
                                                    kill would leave behind (nanovllm.dp.replica)
                     ("step", updates, EngineStats) after each step (or inbox drain) that changed
                                                    anything: one message for all requests, each
                                                    update (request id, new token ids, output or None);
                                                    with requests, at least every KEEPALIVE_S (the
                                                    server takes a long silence for a hang)
                     ("error", traceback)           just before it exits with code 1

The HTTP process checked every request already; a request the engine still rejects ends at once with
finish_reason "error", and the loop goes on. The process ignores Ctrl-C (it reaches the whole process
group; the HTTP process decides how to stop), takes SIGTERM as a request to clean up and leave, and
exits by itself when the HTTP process goes away."""

import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from nanovllm.dp.replica import Placement, replica_info
from nanovllm.engine.sequence import Sequence
from nanovllm.utils.parent_watch import become_engine_child, exit_released

if TYPE_CHECKING:
    from nanovllm.llm import LLM

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


@dataclass(slots=True)
class _Tracked:
    engine_request_id: int
    seq: Sequence  # the request's one sequence (the server sends n=1 only)
    num_sent: int = 0  # its completion tokens sent to the HTTP process so far


class EngineCore:
    """The loop: drain the inbox, run a step, publish what changed."""

    def __init__(self, llm: "LLM", outbox: Connection, clock: Callable[[], float] = time.monotonic) -> None:
        self.engine, self.outbox, self.clock = llm.engine, outbox, clock
        self.last_sent = clock()
        self.requests: dict[int, _Tracked] = {}  # by the HTTP process's request id
        self.rejected: list[tuple[int, list[int], dict]] = []  # updates for requests refused here
        self.num_prompt_tokens = self.num_generation_tokens = 0
        self.finish_reasons: Counter[str] = Counter()
        self.last_stats: EngineStats | None = None

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
                self.engine.advance()  # every request here is tracked: collected by publish
            self.publish()

    def handle(self, message: tuple) -> None:
        if message[0] == "add":
            _, request_id, prompt_token_ids, params = message
            try:
                (seq,) = self.engine.make_request(prompt_token_ids, params)
            except (TypeError, ValueError) as e:
                error = {"finish_reason": "error", "error": f"the engine refused the request: {e}",
                         "text": "", "token_ids": []}
                self.rejected.append((request_id, [], error))
                return
            self.requests[request_id] = _Tracked(self.engine.start_request([seq]), seq)
            self.num_prompt_tokens += seq.num_prompt_tokens
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
        for request_id, tracked in list(self.requests.items()):
            seq = tracked.seq
            output = self.engine.take_output(tracked.engine_request_id) if seq.is_finished else None
            num_tokens = seq.num_completion_tokens
            if output is None and num_tokens == tracked.num_sent:
                continue
            start = seq.num_prompt_tokens + tracked.num_sent
            updates.append((request_id, seq.token_ids[start:start + num_tokens - tracked.num_sent], output))
            self.num_generation_tokens += num_tokens - tracked.num_sent
            tracked.num_sent = num_tokens
            if output is not None:
                del self.requests[request_id]
        for _, _, output in updates:
            if output is not None:
                self.finish_reasons[output["finish_reason"]] += 1
        stats = self.stats()
        now = self.clock()
        if updates or stats != self.last_stats or (self.requests and now - self.last_sent >= KEEPALIVE_S):
            self.outbox.send(("step", updates, stats))
            self.last_stats, self.last_sent = stats, now

    def stats(self) -> EngineStats:
        scheduler = self.engine.scheduler
        return EngineStats(len(scheduler.running), len(scheduler.waiting),
                           scheduler.block_manager.num_free_blocks, scheduler.num_preemptions,
                           self.num_prompt_tokens, self.num_generation_tokens,
                           tuple(self.finish_reasons[reason] for reason in FINISH_REASONS))


def engine_main(index: int, model: str, options: dict, placement: Placement | None, inbox: Connection,
                outbox: Connection) -> None:
    """The entry point of engine process `index` (spawned by nanovllm.serve.engine_process); with
    data_parallel_size > 1 each of them is one replica, on the devices or cores of `placement`."""
    become_engine_child("server engine")
    exit_code = 0
    llm = None
    try:
        if placement is not None:
            placement.apply()
        import torch

        from nanovllm.llm import LLM

        llm = LLM(model, **options)
        if index:  # replicas built with one seed would sample alike: each draws its own stream
            torch.manual_seed(llm.config.seed + index)
        outbox.send(("ready", replica_info(llm.engine)))
        EngineCore(llm, outbox).run(inbox)
    except BaseException:
        exit_code = 1
        try:
            outbox.send(("error", traceback.format_exc()[-MAX_ERROR_CHARS:]))
        except OSError:
            pass  # the HTTP process is gone; nobody is left to tell
    finally:
        if llm is not None:
            llm.shutdown()
    del llm
    exit_released(exit_code)
