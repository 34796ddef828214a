"""How a data-parallel `generate` divides its work, and where each replica runs. Pure Python.

Requests are split by their token budget (prompt tokens + max_tokens), not by count: 100 short
requests and 100 long ones on two replicas would otherwise leave one replica idle while the other
works through the long ones. The split is longest-first onto the least-loaded replica (LPT), which
is within 4/3 of the best possible split and, with many requests, close to even."""

import heapq
from collections.abc import Sequence


def split_by_tokens(costs: Sequence[int], num_replicas: int) -> list[list[int]]:
    """Indices of `costs` for each replica, each list in input order; deterministic (ties go to the
    earlier request and the lower replica)."""
    assert num_replicas >= 1, f"need at least one replica, got {num_replicas}"
    parts: list[list[int]] = [[] for _ in range(num_replicas)]
    loads = [(0, replica) for replica in range(num_replicas)]  # a heap of (tokens so far, replica)
    for index in sorted(range(len(costs)), key=lambda i: -costs[i]):
        load, replica = heapq.heappop(loads)
        parts[replica].append(index)
        heapq.heappush(loads, (load + costs[index], replica))
    return [sorted(part) for part in parts]


def replica_devices(replica: int, tensor_parallel_size: int, visible: Sequence[str]) -> list[str]:
    """The GPUs of replica i: [i*T, (i+1)*T) of those visible to the caller, as CUDA_VISIBLE_DEVICES
    entries (indices or UUIDs), so that inside the replica they are cuda:0..T-1."""
    first = replica * tensor_parallel_size
    devices = list(visible[first:first + tensor_parallel_size])
    assert len(devices) == tensor_parallel_size, (
        f"replica {replica} needs devices [{first}, {first + tensor_parallel_size}) of {list(visible)}")
    return devices


def replica_cpus(replica: int, num_replicas: int, cpus: Sequence[int]) -> list[int]:
    """The CPU cores of replica i on a CPU-only run: an even, disjoint share of the caller's cores (a
    replica's tensor-parallel workers share its cores in turn). With fewer cores than replicas,
    replicas share cores round-robin."""
    cpus = sorted(cpus)
    if len(cpus) < num_replicas:
        return [cpus[replica % len(cpus)]]
    return cpus[replica * len(cpus) // num_replicas:(replica + 1) * len(cpus) // num_replicas]
