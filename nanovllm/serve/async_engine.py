"""The bridge between asyncio handlers and the engine: one background thread owns the LLM and runs
its steps; requests from every connection join the running batch (continuous batching), and each
request's new tokens are posted to its asyncio queue after every step. Handlers never touch the
engine's scheduler: they send "add" and "abort" through a thread-safe inbox, which the loop drains
between steps. Stopping aborts whatever is still in flight, so no KV block outlives a request."""

import asyncio
import logging
import queue
import threading
from collections import Counter
from dataclasses import dataclass

from nanovllm.engine.sequence import Sequence
from nanovllm.llm import LLM

logger = logging.getLogger(__name__)

# How long the idle loop waits for a request before checking whether it should stop.
IDLE_POLL_S = 0.05


@dataclass(slots=True)
class Update:
    """New tokens of one request since its last update; `output` is set on the last one."""
    new_token_ids: list[int]
    output: dict | None = None


@dataclass(slots=True)
class _Stream:
    seq: Sequence
    loop: asyncio.AbstractEventLoop
    updates: asyncio.Queue
    num_sent: int = 0

    def post(self, update: Update) -> None:
        try:
            self.loop.call_soon_threadsafe(self.updates.put_nowait, update)
        except RuntimeError:  # the event loop is closed
            pass


def _deliver(batch: list[tuple[asyncio.Queue, Update]]) -> None:
    for updates, update in batch:
        updates.put_nowait(update)


class AsyncEngine:
    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[int, _Stream] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nanovllm-engine-loop", daemon=True)
        self.error: BaseException | None = None  # set if the engine itself failed; /health reports it
        # Lifetime counters for /metrics (written by the loop thread only).
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.finish_reasons: Counter[str] = Counter()

    @property
    def healthy(self) -> bool:
        return self.error is None and self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the loop; requests still in flight are aborted and their callers told."""
        self._stop.set()
        self._thread.join(timeout)

    def submit(self, seq: Sequence) -> asyncio.Queue:
        """Queue a request made with `llm.engine.make_sequence`; returns the queue its Updates arrive on."""
        if not self.healthy:
            raise RuntimeError("the engine is not running")
        updates: asyncio.Queue = asyncio.Queue()
        self._inbox.put(("add", _Stream(seq, asyncio.get_running_loop(), updates)))
        return updates

    def abort(self, seq_id: int) -> None:
        self._inbox.put(("abort", seq_id))

    # ---- the loop thread ----
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_inbox(block=not self._streams)
                if self._streams:
                    self.llm.engine.advance()  # every request here is tracked: collected by _publish
                    self._publish()
        except BaseException as e:  # the engine is broken (e.g. a tensor-parallel worker died)
            logger.exception("the engine loop failed; failing every request in flight")
            self.error = e
        finally:
            self._drain_inbox(block=False)
            for seq_id in list(self._streams):
                self.llm.engine.abort_request(seq_id)
            self._publish()

    def _drain_inbox(self, block: bool) -> None:
        while True:
            try:
                kind, item = self._inbox.get(timeout=IDLE_POLL_S) if block else self._inbox.get_nowait()
            except queue.Empty:
                return
            block = False
            if kind == "add":
                if self._stop.is_set():  # arrived while stopping: end it at once
                    item.post(Update([], {"finish_reason": "abort", "error": "the server is stopping"}))
                    continue
                self.llm.engine.start_request([item.seq])
                self._streams[item.seq.seq_id] = item
                self.num_prompt_tokens += item.seq.num_prompt_tokens
            elif kind == "abort":
                self.llm.engine.abort_request(item)

    def _publish(self) -> None:
        """Post each request's new tokens; the last update carries its output. One wake-up of each
        event loop per step, not one per request: at 256 streams that is 255 fewer syscalls."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Update]]] = {}
        for seq_id, stream in list(self._streams.items()):
            seq = stream.seq
            output = self.llm.engine.take_output(seq_id) if seq.is_finished else None
            num_tokens = seq.num_completion_tokens
            if output is None and num_tokens == stream.num_sent:
                continue
            start = seq.num_prompt_tokens + stream.num_sent
            update = Update(seq.token_ids[start:start + num_tokens - stream.num_sent], output)
            batches.setdefault(stream.loop, []).append((stream.updates, update))
            self.num_generation_tokens += num_tokens - stream.num_sent
            stream.num_sent = num_tokens
            if output is not None:
                self.finish_reasons[output["finish_reason"]] += 1
                del self._streams[seq_id]
        for loop, batch in batches.items():
            try:
                loop.call_soon_threadsafe(_deliver, batch)
            except RuntimeError:  # that event loop is closed: nobody is left to read these
                pass
