"""Tensor-parallel rank and world size as the layers see them (rank 0 of 1 when torch.distributed
is not initialised), and the collectives they use."""

import torch
import torch.distributed as dist


def get_tp_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def get_tp_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if get_tp_size() > 1:
        dist.all_reduce(x)
    return x


def gather_to_rank0(x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
    """Concatenate each rank's x along dim on rank 0; other ranks get None."""
    size = get_tp_size()
    if size == 1:
        return x
    rank = get_tp_rank()
    parts = [torch.empty_like(x) for _ in range(size)] if rank == 0 else None
    dist.gather(x, parts, dst=0)
    return torch.cat(parts, dim) if rank == 0 else None
