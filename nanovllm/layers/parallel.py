"""What a layer sees of tensor parallelism: its rank, the group's size, and the collectives it calls in
forward (`all_reduce`, `gather_to_rank0`), over the communicator that `use_tp_group` makes current.

The communicator is per engine (built in nanovllm.distributed.group) and current only inside the
engine's own scope, through a ContextVar: two engines in two threads never see each other's group.
Outside any group a layer is rank 0 of 1 and communicates with no one."""

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Protocol

import torch


class Communicator(Protocol):
    rank: int
    world_size: int
    device: torch.device

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor: ...

    def gather_to_rank0(self, x: torch.Tensor, dim: int) -> torch.Tensor | None: ...


_current: ContextVar[Communicator | None] = ContextVar("nanovllm_tp_group", default=None)


@contextmanager
def use_tp_group(group: Communicator | None) -> Iterator[Communicator | None]:
    """Make `group` the one the layers build for and communicate over, until the block ends."""
    token = _current.set(group)
    try:
        yield group
    finally:
        _current.reset(token)


def get_tp_group() -> Communicator | None:
    return _current.get()


def get_tp_rank() -> int:
    group = _current.get()
    return 0 if group is None else group.rank


def get_tp_size() -> int:
    group = _current.get()
    return 1 if group is None else group.world_size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    group = _current.get()
    return x if group is None or group.world_size == 1 else group.all_reduce(x)


def gather_to_rank0(x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
    """Concatenate each rank's x along dim on rank 0; other ranks get None."""
    group = _current.get()
    return x if group is None or group.world_size == 1 else group.gather_to_rank0(x, dim)


def min_across_ranks(value: int) -> int:
    """The smallest of every rank's value (each rank passes its own); a no-op without a group."""
    group = _current.get()
    if group is None or group.world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=group.device)
    return int(group.all_reduce(t, "min").item())
