"""Where each data-parallel replica (an engine process, engine_core.py) runs, what it reports once
built, and what is removed after it. Replica i runs on GPUs [i*T, (i+1)*T) of those visible to the
caller, or on the CPU on its own share of the cores.

A replica is placed before anything in it touches CUDA: CUDA reads CUDA_VISIBLE_DEVICES once, when it
initializes, so the replica is spawned with it already set (spawned_with_devices), sets it again first
thing, and checks that CUDA shows exactly its devices. On a CPU-only run it is pinned to its cores."""

import os
import signal
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.shared_memory import SharedMemory

from nanovllm.config import Config
from nanovllm.utils.device import cuda_device_count

CUDA_DEVICES_VAR = "CUDA_VISIBLE_DEVICES"
# A killed replica's tensor-parallel workers get this long to follow it, looked at this often.
KILL_TIMEOUT_S = 2.0
POLL_S = 0.01


@dataclass(slots=True)
class Placement:
    """Where one replica runs: CUDA_VISIBLE_DEVICES entries on a GPU run, CPU cores on a CPU run."""
    cuda_devices: list[str] | None = None
    cpus: list[int] | None = None

    def apply(self) -> None:
        import torch  # importing torch does not initialize CUDA

        if self.cuda_devices is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(self.cuda_devices)
            if torch.cuda.device_count() != len(self.cuda_devices):
                raise RuntimeError(
                    f"this replica should see the {len(self.cuda_devices)} GPUs {self.cuda_devices} but CUDA "
                    f"shows {torch.cuda.device_count()}: CUDA was initialized before the replica could pick "
                    "its devices; if your script touches CUDA at import time, move that code under "
                    "`if __name__ == '__main__':`")
        if self.cpus is not None:
            if hasattr(os, "sched_setaffinity"):
                os.sched_setaffinity(0, self.cpus)  # inherited by the replica's tensor-parallel workers
            torch.set_num_threads(len(self.cpus))


@dataclass(slots=True)
class ReplicaInfo:
    """What a started replica reports: its KV-cache size (its parent checks requests against the
    smallest), and the processes and shared memory it owns, so that they can be cleaned up after it
    even if it is killed."""
    num_kvcache_blocks: int
    worker_pids: list[int] = field(default_factory=list)
    shm_names: list[str] = field(default_factory=list)


def replica_info(engine) -> ReplicaInfo:
    """What a built engine (an LLMEngine in an engine process, nanovllm.dp.engine_core) reports to its
    parent: its KV blocks, and its tensor-parallel workers' processes and shared memory, if any."""
    executor = engine.executor
    return ReplicaInfo(engine.num_kvcache_blocks, list(getattr(executor, "worker_pids", [])),
                       list(getattr(executor, "shm_names", [])))


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


def placements(config: Config) -> list[Placement]:
    """Replica i on GPUs [i*T, (i+1)*T) of those visible here; on the CPU, on its share of the cores."""
    num_replicas, tp = config.data_parallel_size, config.tensor_parallel_size
    if config.device_type == "cuda":
        visible = os.environ.get(CUDA_DEVICES_VAR)
        ids = ([d.strip() for d in visible.split(",") if d.strip()] if visible
               else [str(i) for i in range(cuda_device_count())])
        return [Placement(cuda_devices=replica_devices(i, tp, ids)) for i in range(num_replicas)]
    cpus = (sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else list(range(os.cpu_count() or 1)))
    return [Placement(cpus=replica_cpus(i, num_replicas, cpus)) for i in range(num_replicas)]


@contextmanager
def spawned_with_devices(placement: Placement) -> Iterator[None]:
    """A spawned child starts with this process's environment: while a replica is started, that
    environment names the replica's GPUs, so that CUDA, whenever the child first touches it (even in
    an import before the replica's code runs), sees only those. This process's own CUDA view was
    fixed when Config counted the GPUs."""
    if placement.cuda_devices is None:
        yield
        return
    previous = os.environ.get(CUDA_DEVICES_VAR)
    os.environ[CUDA_DEVICES_VAR] = ",".join(placement.cuda_devices)
    try:
        yield
    finally:
        if previous is None:
            del os.environ[CUDA_DEVICES_VAR]
        else:
            os.environ[CUDA_DEVICES_VAR] = previous


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
