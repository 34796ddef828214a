"""One engine process (nanovllm.dp.engine_core) seen from the HTTP process: it is spawned (not a
daemon: its LLM may start tensor-parallel workers, and a daemon cannot have children) with two one-way
pipes, no sockets; messages to it go through a sender thread, so that a handler never blocks on a full
pipe while the engine is inside a long step; `close()` stops it and removes whatever a killed engine
left behind (its workers, its shared memory)."""

import queue
import signal
import threading
import time
from multiprocessing.connection import wait

import torch.multiprocessing as mp

from nanovllm.dp.engine_core import EngineStats, engine_main
from nanovllm.dp.replica import Placement, ReplicaInfo, clean_up_after, spawned_with_devices

# After the stop message an engine gets this long to abort its requests and shut down, then this
# long after SIGTERM (and again after SIGKILL).
EXIT_TIMEOUT_S = 10.0
KILL_TIMEOUT_S = 2.0


class EngineStartError(RuntimeError):
    """An engine process failed (or died) before it was ready; `traceback` is its own, if it sent one."""

    def __init__(self, message: str, traceback: str | None = None) -> None:
        super().__init__(message)
        self.traceback = traceback


class EngineProcess:
    def __init__(self, index: int, model: str, options: dict, placement: Placement | None,
                 detailed: bool = False) -> None:
        """detailed: the server's engine, whose updates carry engine_core.Details."""
        ctx = mp.get_context("spawn")
        inbox_reader, self.inbox = ctx.Pipe(duplex=False)
        self.outbox, outbox_writer = ctx.Pipe(duplex=False)
        self.index, self.placement = index, placement
        self.process = ctx.Process(target=engine_main, name=f"nanovllm-engine-{index}",
                                   args=(index, model, options, placement, inbox_reader, outbox_writer,
                                         detailed))
        with spawned_with_devices(placement or Placement()):
            self.process.start()
        # Only the child holds these ends now: its exit is an EOF here.
        inbox_reader.close()
        outbox_writer.close()
        self.info: ReplicaInfo | None = None  # set once it is ready
        self.stats = EngineStats()  # as of its latest step message
        self.traceback: str | None = None  # what it sent before it exited, if anything
        self.num_pending_tokens = 0  # prompt + max_tokens of its unfinished requests, for routing
        # The event loop's clock when it last sent a message, or when work arrived while it had none;
        # EngineClient's watchdog compares it with the step timeout.
        self.last_heard = 0.0
        self.hung: str | None = None  # why the watchdog stopped it, if it did
        self._outgoing: queue.SimpleQueue = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_loop, name=f"nanovllm-engine-{index}-sender",
                                        daemon=True)
        self._sender.start()
        self.closed = False

    def __str__(self) -> str:
        where = "" if self.placement is None else (
            f", GPUs {','.join(self.placement.cuda_devices)}" if self.placement.cuda_devices is not None
            else f", CPUs {self.placement.cpus}")
        return f"engine process {self.index} (pid {self.process.pid}{where})"

    def send(self, message: tuple) -> None:
        """Queue a message; never blocks."""
        self._outgoing.put(message)

    def _send_loop(self) -> None:
        while True:
            batch = [self._outgoing.get()]
            while not self._outgoing.empty():
                batch.append(self._outgoing.get())
            done = batch[-1] is None  # close() asked the thread to leave
            batch = [message for message in batch if message is not None]
            try:
                if batch:
                    self.inbox.send(batch)
            except OSError:  # the engine is gone; its end shows as an EOF on the outbox
                return
            if done:
                return

    def wait_ready(self) -> None:
        """Block until the engine is built; EngineStartError (with its error) if it fails first."""
        while self.info is None:
            wait([self.outbox, self.process.sentinel])
            try:
                kind, payload = self.outbox.recv()
            except (EOFError, OSError):
                raise EngineStartError(self.describe_end()) from None
            if kind == "ready":
                self.info = payload
                self.stats = EngineStats(num_free_blocks=payload.num_kvcache_blocks)
            elif kind == "error":
                self.traceback = payload
                raise EngineStartError(self.describe_end(), payload)

    def describe_end(self) -> str:
        """How the process ended, with the last line of its error when it sent one."""
        self.process.join(KILL_TIMEOUT_S)
        code = self.process.exitcode
        how = ("is still running" if code is None else f"was killed by {signal.Signals(-code).name}"
               if code < 0 else f"exited with code {code}")
        if self.hung is not None:
            how = f"stopped responding ({self.hung}) and was stopped"
        error = self.traceback.strip().splitlines()[-1] if self.traceback else None
        return f"{self} {how}" + (f": {error}" if error else "")

    def stop_hung(self) -> None:
        """Stop a process that no longer answers: SIGTERM, then SIGKILL (which also ends a stopped or
        uninterruptible one); its EOF then fails its requests. Blocks up to 2 * KILL_TIMEOUT_S."""
        for stop in (self.process.terminate, self.process.kill):
            if self.process.is_alive():
                stop()
                self.process.join(KILL_TIMEOUT_S)

    def close(self) -> None:
        """Stop the process (asking first; the stop message is a no-op if it was sent already),
        then terminate or kill what is left and clean up after it. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self.send(("stop",))
        self.send(None)
        self._sender.join(KILL_TIMEOUT_S)
        # One still loading reads no message until it is built (which may take minutes): SIGTERM now.
        self._drain_until_exit(time.monotonic() + (EXIT_TIMEOUT_S if self.info is not None else 0))
        for stop in (self.process.terminate, self.process.kill):
            if self.process.is_alive():
                stop()
                self._drain_until_exit(time.monotonic() + KILL_TIMEOUT_S)
        self.process.join()
        self.inbox.close()
        self.outbox.close()
        self.clean_up()

    def clean_up(self) -> None:
        """Remove what the process left if it was killed (nothing if it shut down cleanly). Blocks
        up to KILL_TIMEOUT_S for its workers to follow it."""
        if self.info is not None:
            clean_up_after(self.info)

    def _drain_until_exit(self, deadline: float) -> None:
        """Wait for the process to leave, reading (and dropping) what it still sends meanwhile: an
        engine blocked on a full pipe would never see the stop message."""
        readable = not self.outbox.closed
        while self.process.is_alive() and time.monotonic() < deadline:
            ready = wait([self.process.sentinel, *([self.outbox] if readable else [])],
                         deadline - time.monotonic())
            if self.outbox in ready:
                try:
                    self.outbox.recv()
                except (EOFError, OSError):
                    readable = False
