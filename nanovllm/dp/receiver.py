"""The caller's record of its replicas' requests, kept by a thread of its own that takes in every
message the replicas send. A message is read and recorded whole, out of reach of the caller's
KeyboardInterrupt: Ctrl-C (in a terminal or a notebook) lands in the caller's thread at any bytecode,
and one landing between reading a request's last message and recording its end would leave the
caller waiting for that request forever; one landing inside `Connection.recv` would leave the pipe
halfway through a message. The caller's thread only waits (interruptibly) for what this thread
records. A request that reaches a replica but not the record (add_request interrupted in between) is
aborted when its first message arrives.

`changed` guards the record (live, done, load, failure, the news) and is notified after each message
and when a replica, or this thread, fails."""

import os
import threading
from dataclasses import dataclass
from multiprocessing.connection import wait
from traceback import format_exc

from nanovllm.dp.engine_process import EngineProcess
from nanovllm.engine.llm_engine import StepResult
from nanovllm.outputs import RequestOutput

# The caller's waits wake this often: Linux hands a process's SIGINT to any of its threads, and one that
# lands on another thread raises KeyboardInterrupt in the caller's only once it runs again.
WAKE_S = 0.1


@dataclass(slots=True)
class Remote:
    replica: EngineProcess
    cost: int  # prompt + max_tokens, counted against the replica until the request ends
    token_ids: list[int]  # its first completion's tokens so far


class Receiver:
    def __init__(self, replicas: list[EngineProcess]) -> None:
        self.replicas = replicas
        self.changed = threading.Condition()
        self.live: dict[int, Remote] = {}
        self.done: dict[int, RequestOutput] = {}
        self.load: dict[int, int] = {}  # tokens outstanding, by replica index
        self.failure: str | None = None  # which replica died or failed, and how
        self._counted: dict[int, tuple[int, int]] = {}  # each replica's prefill, decode tokens so far
        self._news: StepResult | None = None  # tokens computed since the last take_news()
        self._wake_reader, self._wake_writer = os.pipe()  # stop() wakes the thread through it
        self._thread = threading.Thread(target=self._run, name="nanovllm-dp-receiver", daemon=True)
        self._stopping = False
        self._stopped_here = False

    def start(self) -> None:
        """Start listening; the replicas are ready and nothing else reads their pipes from now on."""
        for replica in self.replicas:
            self.load[replica.index] = 0
            self._counted[replica.index] = (0, 0)
        self._thread.start()

    def stop(self) -> None:
        """Stop listening (before the replicas are closed: closing reads their pipes). Idempotent."""
        if self._stopping:
            return
        self._stopping = True
        os.write(self._wake_writer, b"x")
        if self._thread is threading.current_thread():
            self._stopped_here = True  # garbage collection ran the engine's finalizer on this thread
            return  # _run closes the pipe on its way out
        if self._thread.is_alive():
            self._thread.join()
        self._close_wake_pipe()

    def _close_wake_pipe(self) -> None:
        os.close(self._wake_reader)
        os.close(self._wake_writer)

    # ---- the caller's side ----
    def take_news(self) -> StepResult:
        """Block until some replica reports a step or fails (the caller checks `failure`); the tokens
        computed since the last call. Returns at once when no request is live or after stop()."""
        with self.changed:
            while self._news is None and self.live and self.failure is None and not self._stopping:
                self.changed.wait(WAKE_S)
            news, self._news = self._news or StepResult(0, 0), None
        return news

    def wait_ended(self, request_ids: list[int]) -> None:
        """Block until none of request_ids is live, a replica fails (the caller checks `failure`) or
        stop() is called."""
        with self.changed:
            while (self.failure is None and not self._stopping
                   and any(request_id in self.live for request_id in request_ids)):
                self.changed.wait(WAKE_S)

    # ---- the thread ----
    def _run(self) -> None:
        try:
            self._listen()
        except Exception:  # noqa: BLE001 - raised in the caller's thread instead
            # Closed pipes are expected once stop() began; anything else must not leave the caller
            # waiting for messages nobody takes in.
            if not self._stopping:
                self._set_failure(f"the thread taking in the replicas' messages failed:\n{format_exc()}")
        if self._stopped_here:
            self._close_wake_pipe()

    def _listen(self) -> None:
        replicas = self.replicas
        watched = [self._wake_reader, *(r.outbox for r in replicas), *(r.process.sentinel for r in replicas)]
        while True:
            ready = wait(watched)
            if self._wake_reader in ready:
                return
            for replica in replicas:
                if replica.outbox in ready:  # before the sentinel: what it sent before dying counts
                    try:
                        message = replica.outbox.recv()
                    except (EOFError, OSError):
                        message = None
                elif replica.process.sentinel in ready:
                    message = None
                else:
                    continue
                if message is None or message[0] == "error":
                    if message is not None:
                        replica.traceback = message[1]
                    self._fail(replica)
                    return
                _, updates, stats = message
                self._record(replica, updates, stats)

    def _record(self, replica: EngineProcess, updates: list[tuple], stats) -> None:
        with self.changed:
            replica.stats = stats
            prefill, decode = self._counted[replica.index]
            self._counted[replica.index] = (stats.num_prefill_tokens, stats.num_decode_tokens)
            news = self._news or StepResult(0, 0)
            self._news = StepResult(news.num_prefill_tokens + stats.num_prefill_tokens - prefill,
                                    news.num_decode_tokens + stats.num_decode_tokens - decode)
            for request_id, new_token_ids, output in updates:
                remote = self.live.get(request_id)
                if remote is None:  # its add_request was interrupted after sending it: nobody waits for it
                    if output is None:
                        replica.send(("abort", request_id))  # (again, if it steps before the first lands)
                    continue
                remote.token_ids += new_token_ids
                if output is not None:
                    del self.live[request_id]
                    self.load[replica.index] -= remote.cost
                    self.done[request_id] = output
            self.changed.notify_all()

    def _fail(self, replica: EngineProcess) -> None:
        failure = replica.describe_end()  # waits a moment for the process to end
        if replica.traceback:
            failure += f"; its error:\n{replica.traceback}"
        self._set_failure(failure)

    def _set_failure(self, failure: str) -> None:
        with self.changed:
            self.failure = failure
            self.changed.notify_all()
