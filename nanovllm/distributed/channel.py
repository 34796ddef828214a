"""Step channel: rank 0 tells the tensor-parallel workers what to run, one message at a time.

A message is a pickled `(method, args)` in one shared-memory segment per engine, announced to every
worker by its own `ready` semaphore. A worker copies the message out, then releases its `taken`
semaphore; rank 0 writes the next message only once every worker has taken the previous one, so a
slow worker never reads a half-overwritten buffer (a step that samples nothing ends on rank 0
without waiting for the workers, so the collectives alone do not order this).

    shared memory: | length: u64 little-endian | pickle(method, args) | unused ... |

NOTE: semaphores, not multiprocessing.Event: Event.set() waits for every sleeping waiter to
acknowledge its wake-up, so one worker killed while it waits would hang rank 0 for good. Releasing a
semaphore never blocks.

Only rank 0 creates and unlinks the segment; workers attach and close."""

import os
import pickle
import secrets
import struct
import sys
from collections.abc import Callable
from multiprocessing.context import BaseContext
from multiprocessing.shared_memory import SharedMemory
from multiprocessing.synchronize import Semaphore

HEADER = struct.Struct("<Q")
# While rank 0 waits for a worker to take the previous message, it runs its `check` this often.
POLL_S = 0.05

# What a worker needs to attach: (segment name, its ready semaphore, its taken semaphore).
ChannelHandle = tuple[str, Semaphore, Semaphore]


def segment_name() -> str:
    """Unique per engine, and tells a reader of /dev/shm which process made it."""
    return f"nanovllm-{os.getpid()}-{secrets.token_hex(4)}"


class StepChannel:
    def __init__(self, shm: SharedMemory, ready: list[Semaphore], taken: list[Semaphore],
                 owner: bool) -> None:
        self._shm: SharedMemory | None = shm
        self._ready, self._taken, self._owner = ready, taken, owner
        self.name = shm.name

    @classmethod
    def create(cls, num_workers: int, size: int, ctx: BaseContext) -> "StepChannel":
        shm = SharedMemory(name=segment_name(), create=True, size=HEADER.size + size)
        ready = [ctx.Semaphore(0) for _ in range(num_workers)]
        taken = [ctx.BoundedSemaphore(1) for _ in range(num_workers)]  # 1: nothing sent, the buffer is free
        return cls(shm, ready, taken, owner=True)

    def handle(self, worker: int) -> ChannelHandle:
        return self.name, self._ready[worker], self._taken[worker]

    @classmethod
    def attach(cls, handle: ChannelHandle) -> "StepChannel":
        name, ready, taken = handle
        # Python < 3.13 registers even an attached segment with the resource tracker; spawned workers
        # share rank 0's tracker, so that only repeats rank 0's own registration.
        extra = {"track": False} if sys.version_info >= (3, 13) else {}
        return cls(SharedMemory(name=name, **extra), [ready], [taken], owner=False)

    # ---- rank 0 ----
    def send(self, method: str, *args, check: Callable[[], None] = lambda: None) -> None:
        """Broadcast `method(*args)` to every worker. Waits until each one took the previous message,
        calling `check` every POLL_S meanwhile: it raises to give up (e.g. when a worker died)."""
        assert self._owner, "only rank 0 sends"
        data = pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)
        assert HEADER.size + len(data) <= self._shm.size, (
            f"step message of {len(data)} bytes overflows the {self._shm.size}-byte channel")
        acquired: list[Semaphore] = []
        try:
            for taken in self._taken:
                while not taken.acquire(timeout=POLL_S):
                    check()
                acquired.append(taken)
        except BaseException:
            for taken in acquired:  # giving up leaves the channel as it was
                taken.release()
            raise
        HEADER.pack_into(self._shm.buf, 0, len(data))
        self._shm.buf[HEADER.size:HEADER.size + len(data)] = data
        for ready in self._ready:
            ready.release()

    # ---- a worker ----
    def receive(self) -> tuple[str, tuple]:
        """Block until rank 0 sends; returns (method, args)."""
        self._ready[0].acquire()
        (length,) = HEADER.unpack_from(self._shm.buf, 0)
        data = bytes(self._shm.buf[HEADER.size:HEADER.size + length])
        self._taken[0].release()  # from here on rank 0 may overwrite the buffer
        return pickle.loads(data)

    def close(self) -> None:
        """Release this process's mapping; rank 0 also removes the segment. Idempotent."""
        if self._shm is None:
            return
        shm, self._shm = self._shm, None
        # Dropping the semaphores lets multiprocessing unlink them (/dev/shm/sem.mp-*) now.
        self._ready, self._taken = [], []
        shm.close()
        if self._owner:
            shm.unlink()
