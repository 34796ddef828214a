"""Tensor-parallel communicators: one `TPGroup` per engine, the store its ranks meet through, and
their teardown. The layers reach the current group through nanovllm.layers.parallel.

Each engine owns one `TPGroup`: its own TCP store and its own gloo (CPU) or NCCL (CUDA) communicator.
The groups are built directly rather than through torch.distributed's process-wide default group:
rank 0 of every engine lives in the caller's process, so two engines alive at once would otherwise
fight over the one default group.

"""

import datetime
import logging
import os
import socket
from collections.abc import Callable

import torch
import torch.distributed as dist

# How long a rank waits for the others in a collective before it gives up. Generous, because ranks
# load weights and capture CUDA graphs at their own pace; a rank that dies is noticed long before
# this (see nanovllm.distributed.worker), this only bounds a rank that hangs while alive.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)
LOCALHOST = "127.0.0.1"
# Pending connections the store's listening socket queues: one per rank is all a rendezvous needs.
STORE_BACKLOG = 128
NCCL_ERROR_HANDLING_VAR = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN}

logger = logging.getLogger("nanovllm")


def _loopback_listener() -> tuple[int, int]:
    """A TCP socket listening on 127.0.0.1 only, as (file descriptor, port); the caller owns the fd."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((LOCALHOST, 0))  # port 0: the OS picks a free one, so two engines never race for it
        sock.listen(STORE_BACKLOG)
        port = sock.getsockname()[1]
    except BaseException:
        sock.close()
        raise
    return sock.detach(), port


def create_store(rank: int, world_size: int, port: int = 0) -> dist.TCPStore:
    """Rank 0 hosts the store (read its port back from `store.port`); the other ranks connect to it.

    NOTE: TCPStore(host_name=...) names where clients connect, not where the server listens: its own
    socket listens on every interface (`::`), unauthenticated. Rank 0 therefore binds a socket to
    127.0.0.1 itself and hands the store the listening fd (`master_listen_fd`; the store owns and
    closes it from then on)."""
    if rank != 0:
        return dist.TCPStore(LOCALHOST, port, world_size, is_master=False, timeout=COLLECTIVE_TIMEOUT)
    assert port == 0, "rank 0 picks the store's port itself"
    fd, port = _loopback_listener()
    try:
        return dist.TCPStore(LOCALHOST, port, world_size, is_master=True, timeout=COLLECTIVE_TIMEOUT,
                             wait_for_workers=False, master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise


def _gloo_options(timeout: datetime.timedelta) -> dist.ProcessGroupGloo._Options:
    """Gloo's default device listens on the address the host name resolves to, which may be a LAN
    interface; the ranks of one engine share a host, so pin it to loopback."""
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=LOCALHOST)]
    return options


class TPGroup:
    """One engine's tensor-parallel ranks. Construction blocks until every rank has constructed its
    own (the rendezvous goes through the store)."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, device: torch.device) -> None:
        self.rank, self.world_size, self.device = rank, world_size, device
        self._aborted = False
        self._before_destroy: list[Callable[[], None]] = []
        self._store = dist.PrefixStore("tp/", store)  # keeps the communicator's keys apart from ours
        if device.type == "cuda":
            torch.cuda.set_device(device)  # NCCL binds the communicator to the current device
            options = dist.ProcessGroupNCCL.Options()
            options.is_high_priority_stream = False
            options._timeout = COLLECTIVE_TIMEOUT
            # Rank 0 lives in the caller's process: a dead worker must surface there as the engine's
            # RuntimeError (its watchdog aborts the communicator), not as torch's NCCL watchdog tearing
            # the whole process down. The setting is read once, here; a value the user set wins.
            own_setting = rank == 0 and NCCL_ERROR_HANDLING_VAR not in os.environ
            if own_setting:
                os.environ[NCCL_ERROR_HANDLING_VAR] = "0"
            try:
                self._backend = dist.ProcessGroupNCCL(self._store, rank, world_size, options)
            finally:
                if own_setting:
                    del os.environ[NCCL_ERROR_HANDLING_VAR]
        else:
            self._backend = dist.ProcessGroupGloo(self._store, rank, world_size,
                                                  _gloo_options(COLLECTIVE_TIMEOUT))

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In place; on CUDA the wait only orders the current stream after the collective."""
        options = dist.AllreduceOptions()
        options.reduceOp = REDUCE_OPS[op]
        self._backend.allreduce([x], options).wait()
        return x

    def gather_to_rank0(self, x: torch.Tensor, dim: int) -> torch.Tensor | None:
        options = dist.GatherOptions()
        options.rootRank = 0
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.rank == 0 else []
        self._backend.gather([parts] if self.rank == 0 else [], [x.contiguous()], options).wait()
        return torch.cat(parts, dim) if self.rank == 0 else None

    def before_destroy(self, release: Callable[[], None]) -> None:
        """Run `release` when the group is destroyed, before its communicator goes. CUDA graphs that
        captured this group's collectives register here: NCCL's shutdown waits for the resources those
        graphs hold, so destroying the communicator while they live hangs every rank."""
        self._before_destroy.append(release)

    def abort(self) -> None:
        """Make a collective stuck on a dead rank return (NCCL). Gloo needs no help: a dead peer closes
        its sockets and the collective raises by itself (and gloo's abort would not unblock it)."""
        if self.device.type == "cuda" and not self._aborted:
            self._aborted = True
            self._backend.abort()

    def destroy(self, healthy: bool = True) -> None:
        for release in self._before_destroy:
            try:
                release()
            except Exception:  # the communicator must go regardless
                logger.exception("releasing a user of the tensor-parallel group failed")
        self._before_destroy.clear()
        # A graceful NCCL shutdown flushes outstanding work, which never ends when a rank is gone.
        if healthy and hasattr(self._backend, "shutdown"):  # older torch: dropping it is the shutdown
            self._backend.shutdown()
        elif not healthy:
            self.abort()
        del self._backend, self._store
