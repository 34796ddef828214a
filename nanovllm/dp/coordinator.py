"""The coordinator: the caller's side of data parallelism. It spawns one replica process per engine
(nanovllm.dp.replica), splits each batch between them by tokens, gathers the outputs back into input
order under one progress bar, and owns their shutdown.

Failures never hang and never leak:
- A replica that dies (killed, crashed, out of memory) or reports an error ends the `generate` in
  progress at once (the coordinator waits on every replica's pipe and process sentinel together), or
  the next one before anything is sent: DataParallelError (a RuntimeError) names the replica, its
  pid and devices, how it ended and its traceback; every other replica is shut down.
- Ctrl-C, or any exception, during a `generate` shuts every replica down as well: a replica's batch
  cannot be taken back half-done.
- `shutdown()` asks each replica to exit (it shuts its own engine and tensor-parallel workers down),
  terminates and then kills what is left after EXIT_TIMEOUT_S, and removes what a killed replica
  could not: its workers' processes and its shared memory. It also runs when the coordinator is
  garbage-collected and at interpreter exit (weakref.finalize). Idempotent."""

import os
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import wait

import torch.multiprocessing as mp
from tqdm.auto import tqdm

from nanovllm.config import Config
from nanovllm.dp.balance import replica_cpus, replica_devices, split_by_tokens
from nanovllm.dp.replica import Placement, replica_main
from nanovllm.dp.replica_set import DataParallelError, Replica, ReplicaSet
from nanovllm.sampling_params import SamplingParams

# Seconds between redraws of the progress bar's throughput.
BAR_REFRESH_S = 0.5
SPAWN_HINT = ("Replicas are started with the 'spawn' method, which re-imports your main script: create the "
              "LLM under `if __name__ == '__main__':`.")

CUDA_DEVICES_VAR = "CUDA_VISIBLE_DEVICES"

Request = tuple[list[int], SamplingParams]


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


def placements(config: Config) -> list[Placement]:
    """Replica i on GPUs [i*T, (i+1)*T) of those visible here; on the CPU, on its share of the cores."""
    num_replicas, tp = config.data_parallel_size, config.tensor_parallel_size
    if config.device_type == "cuda":
        import torch

        visible = os.environ.get(CUDA_DEVICES_VAR)
        ids = ([d.strip() for d in visible.split(",") if d.strip()] if visible
               else [str(i) for i in range(torch.cuda.device_count())])
        return [Placement(cuda_devices=replica_devices(i, tp, ids)) for i in range(num_replicas)]
    cpus = (sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else list(range(os.cpu_count() or 1)))
    return [Placement(cpus=replica_cpus(i, num_replicas, cpus)) for i in range(num_replicas)]


class DPCoordinator:
    """Starts `config.data_parallel_size` replicas of the engine that `model` and `options` describe
    (options already validated into `config`), and runs batches on them."""

    def __init__(self, model: str, options: dict, config: Config) -> None:
        ctx = mp.get_context("spawn")
        self._state = state = ReplicaSet()
        self._finalizer = weakref.finalize(self, state.release)
        replica_options = {**options, "data_parallel_size": 1}
        try:
            for index, placement in enumerate(placements(config)):
                conn, replica_conn = ctx.Pipe(duplex=True)
                # Not a daemon: a replica with tensor_parallel_size > 1 starts worker processes itself.
                process = ctx.Process(target=replica_main, name=f"nanovllm-dp{index}",
                                      args=(index, model, replica_options, placement, replica_conn))
                with spawned_with_devices(placement):
                    process.start()
                replica_conn.close()
                state.replicas.append(Replica(index, process, conn, placement))
            self._wait_until_ready()
        except BaseException:
            self.shutdown()  # no replica outlives a failed constructor
            raise

    @property
    def replica_set(self) -> ReplicaSet:
        """The replicas' record; it outlives the coordinator until it is released."""
        return self._state

    @property
    def replicas(self) -> list[Replica]:
        return self._state.replicas

    @property
    def num_kvcache_blocks(self) -> int:
        """The smallest replica's KV cache: a request must fit whichever replica it goes to."""
        return min(replica.info.num_kvcache_blocks for replica in self.replicas)

    def _wait_until_ready(self) -> None:
        state = self._state
        while starting := [replica for replica in state.replicas if replica.info is None]:
            ready = wait([*(r.conn for r in starting), *(r.process.sentinel for r in starting)])
            for replica in starting:
                if replica.conn in ready:
                    try:
                        kind, payload = replica.conn.recv()
                    except EOFError:
                        kind, payload = "died", None
                    if kind == "ready":
                        replica.info = payload
                        continue
                    state.error(replica, payload)
                    raise DataParallelError(f"{state.failure}\n{SPAWN_HINT}")
                if replica.process.sentinel in ready:
                    state.error(replica)
                    raise DataParallelError(f"{state.failure}\n{SPAWN_HINT}")

    def check_running(self) -> None:
        """Raise DataParallelError if the replicas cannot take work (one failed, or shut down)."""
        self._state.raise_if_unusable()

    def generate(self, requests: list[Request], use_tqdm: bool = True) -> list[dict]:
        """Run validated requests; returns one output per request, in input order."""
        state = self._state
        state.raise_if_unusable()
        costs = [len(token_ids) + params.max_tokens for token_ids, params in requests]
        parts = split_by_tokens(costs, len(self.replicas))
        results: list[dict | None] = [None] * len(requests)
        try:
            for replica, part in zip(self.replicas, parts):
                if part:
                    try:
                        replica.conn.send(("generate", [requests[i] for i in part]))
                    except OSError:  # it died since the check above
                        raise state.error(replica) from None
            with _ProgressBar(len(requests), use_tqdm) as bar:
                while bar.n < len(requests):
                    self._receive(parts, results, bar)
        except BaseException as e:
            if state.failure is None:
                state.failure = f"the caller's process raised {e!r} during generate"
            self.shutdown()
            raise
        return results

    def _receive(self, parts: list[list[int]], results: list[dict | None], bar: "_ProgressBar") -> None:
        """Wait for any replica to speak or die, and take in what it says."""
        state = self._state
        ready = wait([*(r.conn for r in self.replicas), *(r.process.sentinel for r in self.replicas)])
        for replica in self.replicas:
            if replica.conn in ready:  # before the sentinel: outputs it sent before it died still count
                try:
                    message = replica.conn.recv()
                except EOFError:
                    raise state.error(replica) from None
                if message[0] == "error":
                    raise state.error(replica, message[1])
                _, outputs, num_prefill, num_decode = message
                for batch_index, output in outputs:
                    results[parts[replica.index][batch_index]] = output
                bar.advance(len(outputs), num_prefill, num_decode)
            elif replica.process.sentinel in ready:
                raise state.error(replica)

    def shutdown(self) -> None:
        """Stop every replica and free what they hold. Idempotent."""
        self._finalizer()


class _ProgressBar:
    """One bar for all replicas: requests done, and the prefill/decode throughput of them all."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.n = 0
        self._bar = tqdm(total=total, desc="Generating", dynamic_ncols=True, disable=not enabled)
        self._enabled = enabled
        self._window_start = time.perf_counter()
        self._num_prefill = self._num_decode = 0

    def advance(self, num_done: int, num_prefill: int, num_decode: int) -> None:
        self.n += num_done
        self._num_prefill += num_prefill
        self._num_decode += num_decode
        elapsed = time.perf_counter() - self._window_start
        if self._enabled and elapsed > BAR_REFRESH_S:
            self._bar.set_postfix({"Prefill": f"{self._num_prefill / elapsed:.0f}tok/s",
                                   "Decode": f"{self._num_decode / elapsed:.0f}tok/s"}, refresh=False)
            self._window_start, self._num_prefill, self._num_decode = time.perf_counter(), 0, 0
        if num_done:
            self._bar.update(num_done)

    def __enter__(self) -> "_ProgressBar":
        return self

    def __exit__(self, *exc_info) -> None:
        self._bar.close()
