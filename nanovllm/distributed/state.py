"""Rank 0's record of one engine's tensor-parallel group: the worker processes, the step channel and
the communicator; whether the group failed and why; a watchdog thread that notices a worker's death
the moment its process ends, and a worker that stops responding (stopped by SIGSTOP, hung) within
HEARTBEAT_TIMEOUT_S; and the release of all of it. It holds no reference to the engine, so
that a finalizer can own it (see nanovllm.distributed.worker for the semantics)."""

import ctypes
import multiprocessing
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess

import torch.distributed as dist

from nanovllm.distributed.channel import StepChannel
from nanovllm.distributed.group import COLLECTIVE_TIMEOUT, TPGroup

# Workers get this long to leave after the exit message, and then this long after SIGTERM.
EXIT_TIMEOUT_S = 10.0
KILL_TIMEOUT_S = 2.0
# After a collective fails on rank 0, how long to wait for the dead worker's exit status (its sockets
# close a moment before the process is reaped).
DEATH_GRACE_S = 5.0
# How often rank 0 looks for the workers while they start.
JOIN_POLL_S = 0.02
# Each worker stamps time.monotonic() (one clock for every process of the host) into its slot of a
# shared array this often, from a thread of its own; rank 0's watchdog looks every HEARTBEAT_POLL_S.
# A worker whose stamp is older than HEARTBEAT_TIMEOUT_S has stopped responding: the group fails
# naming it, and it is killed so that the other ranks' collectives return (instead of waiting for the
# 10-minute COLLECTIVE_TIMEOUT). 30 s leaves room for a loaded host; the interval is far below it.
HEARTBEAT_INTERVAL_S = 0.5
HEARTBEAT_POLL_S = 0.5
HEARTBEAT_TIMEOUT_S = 30.0
# A watchdog poll that took this much longer than asked means rank 0 itself was suspended (Ctrl-Z, a
# debugger): the workers' stamps are then stale through no fault of theirs, so they get a fresh start.
SUSPENDED_SLACK_S = 2.0
SPAWN_HINT = ("Workers are started with the 'spawn' method, which re-imports your main script: create the "
              "LLM under `if __name__ == '__main__':`.")


def _process_state(pid: int | None) -> str | None:
    """The one-letter state of a Linux process ("T": stopped), or None where /proc cannot say."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return None


class TPWorkerError(RuntimeError):
    """A tensor-parallel worker died, or the group failed; the engine is shut down."""


@dataclass(slots=True)
class WorkerHandle:
    rank: int
    process: BaseProcess
    errors: Connection  # the worker sends its traceback here before it exits on an exception


class TPGroupState:
    def __init__(self, heartbeats: "ctypes.Array[ctypes.c_double] | None" = None) -> None:
        self.heartbeats = heartbeats  # worker i (rank i + 1) stamps heartbeats[i]; 0.0 until it starts
        self.workers: list[WorkerHandle] = []
        self.channel: StepChannel | None = None
        self.group: TPGroup | None = None
        self.failure: str | None = None  # why the group cannot run any more; None while healthy
        self.closed = False
        self._lock = threading.Lock()
        self._stop_reader, self._stop_writer = multiprocessing.Pipe(duplex=False)
        self._watchdog: threading.Thread | None = None

    def add_worker(self, rank: int, process: BaseProcess, errors: Connection) -> None:
        self.workers.append(WorkerHandle(rank, process, errors))

    @property
    def channel_name(self) -> str | None:
        return None if self.channel is None else self.channel.name

    # ---- failures ----
    def fail(self, reason: str) -> None:
        with self._lock:
            if self.failure is None:
                self.failure = reason

    def raise_if_failed(self) -> None:
        if self.failure is not None:
            raise TPWorkerError(f"{self.failure}\nThe engine is shut down; create a new LLM.")

    def dead_worker_report(self, timeout: float) -> str | None:
        """The failure, if there is one or a worker dies within `timeout` seconds; else None."""
        if self.failure is None:
            ready = wait([worker.process.sentinel for worker in self.workers], timeout)
            dead = [worker for worker in self.workers if worker.process.sentinel in ready]
            with self._lock:  # the watchdog and the stepping thread may both get here
                if dead and self.failure is None:
                    self.failure = self._describe(dead[0])
        return self.failure

    @staticmethod
    def _describe(worker: WorkerHandle) -> str:
        # Its sentinel fired, so the exit status is moments away; another thread may be the one that
        # reaps it, hence the wait for `exitcode` rather than only join().
        worker.process.join(KILL_TIMEOUT_S)
        deadline = time.monotonic() + KILL_TIMEOUT_S
        while worker.process.exitcode is None and time.monotonic() < deadline:
            time.sleep(JOIN_POLL_S)
        code = worker.process.exitcode
        if code is not None and code < 0:
            how = f"was killed by {signal.Signals(-code).name}"
        else:
            how = f"exited with code {code}"
        report = f"tensor-parallel worker rank {worker.rank} (pid {worker.process.pid}) {how}"
        try:
            if worker.errors.poll():
                report += f"; its error:\n{worker.errors.recv()}"
        except (EOFError, OSError):
            pass  # it died without a word (e.g. SIGKILL)
        return report

    # ---- the watchdog ----
    def start_watchdog(self) -> None:
        self._watchdog = threading.Thread(target=self._watch, name="nanovllm-tp-watchdog", daemon=True)
        self._watchdog.start()

    def _watch(self) -> None:
        waitables = [*(worker.process.sentinel for worker in self.workers), self._stop_reader]
        awake_since = last = time.monotonic()
        while True:
            ready = wait(waitables, HEARTBEAT_POLL_S)
            if self._stop_reader in ready:
                return
            if ready:  # a worker's process ended
                self.dead_worker_report(0)
                break
            now = time.monotonic()
            if now - last > HEARTBEAT_POLL_S + SUSPENDED_SLACK_S:
                awake_since = now
            last = now
            stalled = self._stalled_worker(awake_since)
            if stalled is not None:
                worker, report = stalled
                self.fail(report)
                worker.process.kill()  # works on a stopped process too; its sockets close, gloo returns
                break
        group = self.group
        if group is not None:  # NCCL would wait for the dead rank forever: make rank 0's wait end
            group.abort()

    def _stalled_worker(self, awake_since: float) -> tuple[WorkerHandle, str] | None:
        """The first worker whose heartbeat is older than HEARTBEAT_TIMEOUT_S, and why; else None.
        A worker that has not stamped yet is still starting (wait_until_joined bounds that)."""
        if self.heartbeats is None:
            return None
        now = time.monotonic()
        for index, worker in enumerate(self.workers):
            beat = self.heartbeats[index]
            if beat > 0.0 and now - max(beat, awake_since) > HEARTBEAT_TIMEOUT_S:
                pid = worker.process.pid
                how = "is stopped (SIGSTOP?)" if _process_state(pid) == "T" else "may be hung"
                return worker, (f"tensor-parallel worker rank {worker.rank} (pid {pid}) stopped responding: "
                                f"no heartbeat for {now - beat:.1f} s (limit {HEARTBEAT_TIMEOUT_S} s); "
                                f"it {how}, and was killed so that the other ranks stop waiting for it")
        return None

    # ---- startup ----
    def wait_until_joined(self, store: dist.Store) -> None:
        """Return once every worker has reached the store; raise if one dies first."""
        keys = [f"joined/{worker.rank}" for worker in self.workers]
        deadline = time.monotonic() + COLLECTIVE_TIMEOUT.total_seconds()
        while not store.check(keys):
            report = self.dead_worker_report(JOIN_POLL_S)
            if report is not None:
                raise TPWorkerError(f"{report}\n{SPAWN_HINT}")
            if time.monotonic() > deadline:
                raise TPWorkerError(f"tensor-parallel workers did not start within {COLLECTIVE_TIMEOUT}")

    # ---- release ----
    def _exit_check(self, deadline: float) -> Callable[[], None]:
        def check() -> None:
            if time.monotonic() > deadline or not all(w.process.is_alive() for w in self.workers):
                raise TimeoutError("a worker did not take the exit message")
        return check

    def release(self) -> None:
        """Stop the workers (gracefully unless the group failed), destroy rank 0's communicator and
        unlink the shared memory. Idempotent."""
        if self.closed:
            return
        self.closed = True
        graceful = self.failure is None
        self._stop_writer.send(None)
        if self._watchdog is not None:
            self._watchdog.join()
        if graceful and self.channel is not None:
            try:
                self.channel.send("exit", check=self._exit_check(time.monotonic() + EXIT_TIMEOUT_S))
            except TimeoutError:
                graceful = False
        if self.group is not None:
            self.group.destroy(graceful)
            self.group = None
        deadline = time.monotonic() + (EXIT_TIMEOUT_S if graceful else 0.0)
        for worker in self.workers:
            worker.process.join(max(0.0, deadline - time.monotonic()))
        for worker in self.workers:
            if worker.process.is_alive():
                worker.process.terminate()
                worker.process.join(KILL_TIMEOUT_S)
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join()
            worker.errors.close()
        if self.channel is not None:
            self.channel.close()
        self._stop_reader.close()
        self._stop_writer.close()
