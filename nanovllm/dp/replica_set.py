"""The coordinator's record of its replica processes: their handles, why the group failed, and the
release of everything they hold, including what a killed replica leaves behind (its tensor-parallel
workers and its shared memory). It holds no reference to the coordinator, so that a finalizer can own
it (see nanovllm.dp.coordinator for the semantics)."""

import os
import signal
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from multiprocessing.shared_memory import SharedMemory

from nanovllm.dp.replica import Placement, ReplicaInfo

# Replicas get this long to leave after the exit message, then this long after SIGTERM.
EXIT_TIMEOUT_S = 10.0
KILL_TIMEOUT_S = 2.0
# How often to look whether a killed replica's workers have followed it.
POLL_S = 0.01


class DataParallelError(RuntimeError):
    """A data-parallel replica died or failed; every replica is shut down."""


@dataclass(slots=True)
class Replica:
    index: int
    process: BaseProcess
    conn: Connection
    placement: Placement
    info: ReplicaInfo | None = None  # set once the replica reports ready

    def __str__(self) -> str:
        where = (f"GPUs {','.join(self.placement.cuda_devices)}" if self.placement.cuda_devices is not None
                 else f"CPUs {self.placement.cpus}")
        return f"data-parallel replica {self.index} (pid {self.process.pid}, {where})"


def _is_running(pid: int) -> bool:
    """Whether a process (not one of ours to reap) still runs; a zombie does not."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def clean_up_after(info: ReplicaInfo) -> None:
    """An engine process (a replica, the server's engine) shut down cleanly leaves nothing; a killed one
    leaves its tensor-parallel workers (they follow it within moments, see nanovllm.distributed.worker)
    and its step channel."""
    deadline = time.monotonic() + KILL_TIMEOUT_S
    for pid in info.worker_pids:
        while _is_running(pid) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        if _is_running(pid):
            os.kill(pid, signal.SIGKILL)
    for name in info.shm_names:
        try:
            shm = SharedMemory(name=name)
        except FileNotFoundError:
            continue
        shm.close()
        shm.unlink()


class ReplicaSet:
    """The replicas and why they failed; holds no reference to the coordinator, so that a finalizer
    can own it."""

    def __init__(self) -> None:
        self.replicas: list[Replica] = []
        self.failure: str | None = None
        self.closed = False

    def error(self, replica: Replica, traceback: str | None = None) -> DataParallelError:
        """Record why `replica` failed (it died, or sent its traceback) and return the error to raise."""
        if self.failure is None:
            self.failure = self._describe(replica, traceback)
        return DataParallelError(f"{self.failure}\nEvery replica is shut down; create a new LLM.")

    @staticmethod
    def _describe(replica: Replica, traceback: str | None) -> str:
        if traceback is None:  # it may have sent one before it died
            try:
                while traceback is None and replica.conn.poll():
                    message = replica.conn.recv()
                    traceback = message[1] if message[0] == "error" else None
            except (EOFError, OSError):
                pass
        replica.process.join(KILL_TIMEOUT_S)
        code = replica.process.exitcode
        how = ("is still running" if code is None else f"was killed by {signal.Signals(-code).name}"
               if code < 0 else f"exited with code {code}")
        report = f"{replica} {how}"
        return report if traceback is None else f"{report}; its error:\n{traceback}"

    def raise_if_unusable(self) -> None:
        if self.closed:
            why = self.failure or "shutdown() was called"
            raise DataParallelError(f"the data-parallel replicas are shut down ({why}); create a new LLM")
        for replica in self.replicas:
            if not replica.process.is_alive():
                raise self.error(replica)

    def release(self) -> None:
        """Stop every replica, then whatever a killed one left behind. Idempotent."""
        if self.closed:
            return
        self.closed = True
        for replica in self.replicas:
            try:
                replica.conn.send(("exit",))
            except OSError:
                pass  # already gone
        self._wait_for_exit(time.monotonic() + EXIT_TIMEOUT_S)
        for replica in self.replicas:
            for stop in (replica.process.terminate, replica.process.kill):
                if replica.process.is_alive():
                    stop()
                    replica.process.join(KILL_TIMEOUT_S)
            replica.process.join()
            replica.conn.close()
            if replica.info is not None:
                clean_up_after(replica.info)

    def _wait_for_exit(self, deadline: float) -> None:
        """Wait for the replicas to leave, reading (and dropping) what they still send meanwhile: a
        replica blocked on a full pipe would never see the exit message."""
        pending = [replica for replica in self.replicas if replica.process.is_alive()]
        open_conns = {replica.conn for replica in pending}
        while pending and time.monotonic() < deadline:
            ready = wait([*(r.process.sentinel for r in pending), *open_conns], deadline - time.monotonic())
            for conn in open_conns & set(ready):
                try:
                    conn.recv()
                except (EOFError, OSError):
                    open_conns.discard(conn)
            pending = [replica for replica in pending if replica.process.is_alive()]
