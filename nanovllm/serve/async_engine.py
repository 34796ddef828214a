"""The bridge between asyncio handlers and the engine: one background thread owns the LLM and runs
its steps; requests from every connection join the running batch (continuous batching), and each
request's new tokens are posted to its RequestStream after every step. Handlers never touch the
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


class RequestStream:
    """One request's mailbox on its event loop: the loop thread's steps add tokens, the handler
    takes all that arrived since it last looked. Steps that land while a handler is still busy with
    an earlier one merge, so a slow handler sends fewer, larger chunks instead of falling behind. A
    list and a future, not an asyncio.Queue: one append and one wake-up per step."""

    __slots__ = ("seq", "loop", "num_sent", "_token_ids", "_output", "_waiter")

    def __init__(self, seq: Sequence, loop: asyncio.AbstractEventLoop) -> None:
        self.seq, self.loop = seq, loop
        self.num_sent = 0  # tokens handed to the loop so far (the loop thread's count)
        self._token_ids: list[int] = []
        self._output: dict | None = None
        self._waiter: asyncio.Future | None = None

    def _add(self, new_token_ids: list[int], output: dict | None) -> None:
        """On the event loop."""
        self._token_ids += new_token_ids
        if output is not None:
            self._output = output
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def post(self, new_token_ids: list[int], output: dict | None) -> None:
        """From any thread."""
        try:
            self.loop.call_soon_threadsafe(self._add, new_token_ids, output)
        except RuntimeError:  # the event loop is closed
            pass

    async def next(self) -> Update:
        """Everything since the last call, waiting for at least one token or the output. Cancelling
        the wait (a timeout) loses nothing."""
        while not self._token_ids and self._output is None:
            self._waiter = self.loop.create_future()
            await self._waiter
        update = Update(self._token_ids, self._output)
        self._token_ids = []
        return update


def _deliver(batch: list[tuple[RequestStream, list[int], dict | None]]) -> None:
    for stream, new_token_ids, output in batch:
        stream._add(new_token_ids, output)


class AsyncEngine:
    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[int, RequestStream] = {}
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

    def submit(self, seq: Sequence) -> RequestStream:
        """Queue a request made with `llm.engine.make_sequence`; returns the stream its Updates arrive on."""
        if not self.healthy:
            raise RuntimeError("the engine is not running")
        stream = RequestStream(seq, asyncio.get_running_loop())
        self._inbox.put(("add", stream))
        return stream

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
                    item.post([], {"finish_reason": "abort", "error": "the server is stopping"})
                    continue
                self.llm.engine.start_request([item.seq])
                self._streams[item.seq.seq_id] = item
                self.num_prompt_tokens += item.seq.num_prompt_tokens
            elif kind == "abort":
                self.llm.engine.abort_request(item)

    def _publish(self) -> None:
        """Post each request's new tokens; the last update carries its output. One wake-up of each
        event loop per step, not one per request: at 256 streams that is 255 fewer syscalls."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, list[int], dict | None]]] = {}
        for seq_id, stream in list(self._streams.items()):
            seq = stream.seq
            output = self.llm.engine.take_output(seq_id) if seq.is_finished else None
            num_tokens = seq.num_completion_tokens
            if output is None and num_tokens == stream.num_sent:
                continue
            start = seq.num_prompt_tokens + stream.num_sent
            new_token_ids = seq.token_ids[start:start + num_tokens - stream.num_sent]
            batches.setdefault(stream.loop, []).append((stream, new_token_ids, output))
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
