"""One data-parallel replica: a process of its own holding a full LLMEngine (scheduler, KV cache,
tensor-parallel workers) on its own devices, driven by the coordinator over a pipe.

Messages, all `(kind, *args)` tuples:

    coordinator -> replica   ("generate", [(prompt token ids, SamplingParams), ...])   ("exit",)
    replica -> coordinator   ("ready", ReplicaInfo)    once the engine is built
                             ("progress", [(index in batch, output), ...], prefill tokens, decode tokens)
                             ("error", traceback)      just before it exits with code 1

A replica is placed before anything in it touches CUDA: CUDA reads CUDA_VISIBLE_DEVICES once, when
it initializes, so the replica starts with it already set (see nanovllm.dp.coordinator), sets it
again first thing, and checks that CUDA shows exactly its devices. On a CPU-only run the
replica is pinned to its share of the cores instead. It ignores Ctrl-C (the coordinator decides and
shuts every replica down), takes SIGTERM as a request to clean up and leave, and exits by itself
when the coordinator's process goes away."""

import os
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

from nanovllm.utils.parent_watch import become_engine_child, exit_released

# A replica sends the throughput counters at least this often while it works, so that the progress
# bar stays live between finished requests (outputs that finish are sent after the step at once).
PROGRESS_INTERVAL_S = 0.5
# A traceback goes through the pipe before the replica exits: keep it well under the pipe's buffer
# (64 KiB on Linux) so that sending it never blocks a dying replica.
MAX_ERROR_CHARS = 8 * 1024


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
    """What a started replica reports: its KV-cache size (the coordinator checks requests against the
    smallest), and the processes and shared memory it owns, so that they can be cleaned up after it
    even if it is killed."""
    num_kvcache_blocks: int
    worker_pids: list[int] = field(default_factory=list)
    shm_names: list[str] = field(default_factory=list)


def replica_main(index: int, model: str, options: dict, placement: Placement, conn: Connection) -> None:
    become_engine_child("data-parallel replica")
    exit_code = 0
    engine = None
    try:
        placement.apply()
        import torch

        from nanovllm.engine.llm_engine import LLMEngine

        engine = LLMEngine(model, **options)
        # Replicas built with one seed would draw the same random numbers, so that copies of a prompt
        # sampled on two replicas would come out alike; each replica draws its own stream. (The seed
        # itself stays shared: dummy weights are drawn from it and must be one model everywhere.)
        torch.manual_seed(engine.config.seed + index)
        conn.send(("ready", replica_info(engine)))
        while True:
            message = conn.recv()
            if message[0] == "exit" or not _run_batch(engine, conn, message[1]):
                break
    except BaseException:
        exit_code = 1
        try:
            conn.send(("error", traceback.format_exc()[-MAX_ERROR_CHARS:]))
        except OSError:
            pass  # the coordinator is gone; nobody is left to tell
    finally:
        if engine is not None:
            engine.shutdown()
    del engine
    exit_released(exit_code)


def replica_info(engine) -> ReplicaInfo:
    """What a built engine (in a replica, or the server's engine process) reports to its parent."""
    info = ReplicaInfo(engine.num_kvcache_blocks)
    workers = getattr(engine, "workers", None)  # its tensor-parallel workers, when it has some
    if workers is not None:
        info.worker_pids = [process.pid for process in workers.processes]
        info.shm_names = [workers.channel_name]
    return info


def _run_batch(engine, conn: Connection, requests: list) -> bool:
    """Run one batch to the end, sending outputs as they finish. False when the coordinator asked the
    replica to exit meanwhile."""
    batch_index = {engine.add_request(prompt, params): i for i, (prompt, params) in enumerate(requests)}
    finished: list[tuple[int, dict]] = []
    num_prefill = num_decode = 0
    last_sent = time.monotonic()
    while not engine.is_finished():
        outputs, num_tokens = engine.step()
        finished += [(batch_index[seq_id], output) for seq_id, output in outputs]
        if num_tokens > 0:
            num_prefill += num_tokens
        else:
            num_decode -= num_tokens
        if finished or time.monotonic() - last_sent > PROGRESS_INTERVAL_S:
            conn.send(("progress", finished, num_prefill, num_decode))
            finished, num_prefill, num_decode = [], 0, 0
            last_sent = time.monotonic()
        # Until its last output is sent, the coordinator speaks only to stop us (Ctrl-C, a replica
        # died); after it, the next message may already be the next batch, read by the caller.
        if not engine.is_finished() and conn.poll():
            message = conn.recv()
            assert message[0] == "exit", f"unexpected message {message[0]!r} during a batch"
            return False
    return True
