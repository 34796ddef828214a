"""Tensor-parallel workers: ranks 1..N-1 of an engine, each in a process spawned here with its own
ModelRunner (its shard of the weights and of the KV cache). Rank 0 is the engine's own ModelRunner,
in the caller's process; `TPWorkers` is its handle on the others.

Each step, rank 0 sends the step's StepBatch record (nanovllm.engine.step) through the engine's
StepChannel; every worker builds the same inputs from it, runs the same forward and meets rank 0 in its
collectives. Only rank 0 samples.

Failures never hang and never leak:
- A worker that dies (killed, crashed, out of memory) wakes a watchdog thread on rank 0 the moment its
  process ends. The step in progress, or the next one, raises TPWorkerError (a RuntimeError) naming
  the rank, how it ended and its traceback, and the whole group is shut down. On CUDA the watchdog
  also aborts the NCCL communicator, which would otherwise wait for the dead rank forever; gloo
  raises by itself once the dead rank's sockets close.
- Any exception on rank 0 inside a step, Ctrl-C included, shuts the group down too: the ranks may be
  stopped mid-collective, and a half-done step cannot be resumed. Workers ignore SIGINT (rank 0
  decides) and exit by themselves when rank 0's process goes away.
- `shutdown()` sends the exit message, gives the workers EXIT_TIMEOUT_S to leave, terminates the
  rest, destroys rank 0's communicator and unlinks the shared memory. It also runs when the TPWorkers
  object is garbage-collected and at interpreter exit (weakref.finalize). Idempotent."""

import ctypes
import logging
import math
import os
import signal
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from multiprocessing.connection import Connection

import torch
import torch.multiprocessing as mp

from nanovllm.config import Config
from nanovllm.distributed.channel import ChannelHandle, StepChannel
from nanovllm.distributed.group import TPGroup, create_store
from nanovllm.distributed.state import DEATH_GRACE_S, HEARTBEAT_INTERVAL_S, TPGroupState, TPWorkerError
from nanovllm.engine.step import StepBatch, StepOutput
from nanovllm.layers.parallel import use_tp_group
from nanovllm.runner.model_runner import ModelRunner, runner_device
from nanovllm.utils.parent_watch import exit_with_parent

# Workers log at this level (e.g. INFO) to stderr when it is set; they are silent otherwise.
LOG_LEVEL_ENV_VAR = "NANOVLLM_WORKER_LOG_LEVEL"

# Upper bounds for sizing the channel: a pickled int or float takes at most 9 bytes, and a sequence's
# list headers and per-sequence fields well under 128.
PICKLED_INT_BYTES = 9
PICKLED_SEQ_OVERHEAD = 128
CHANNEL_SLACK_BYTES = 64 * 1024
# A worker's traceback goes through a pipe before the worker exits; keep it under the pipe's buffer
# (64 KiB on Linux) so that sending it can never block a dying worker.
MAX_ERROR_CHARS = 8 * 1024  # <= 32 KiB even in 4-byte UTF-8


def threads_per_rank(world_size: int) -> int:
    """CPU threads for one rank, so that N ranks on one host do not fight over the cores (OpenMP
    threads spinning on a busy core make a gloo run many times slower)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cpus // world_size)


def channel_size(config: Config) -> int:
    """Bytes of the largest StepBatch as the workers get it (no sampling part): per token its id,
    position, slot, prompt-logprob target and, speculating, the draft it is (at most
    max_num_batched_tokens of them), per sequence its block table (at most max_model_len / block_size
    entries), its lengths and its prompt-logprob span (at most max_num_seqs of them)."""
    max_blocks = math.ceil(config.max_model_len / config.kvcache_block_size)
    num_ints = 5 * config.max_num_batched_tokens + config.max_num_seqs * (max_blocks + 8)
    return num_ints * PICKLED_INT_BYTES + config.max_num_seqs * PICKLED_SEQ_OVERHEAD + CHANNEL_SLACK_BYTES


# ---- a worker process ----
def _start_heartbeat(heartbeats: "ctypes.Array[ctypes.c_double]", index: int) -> None:
    """Stamp this worker's heartbeat slot from a thread of its own (see tp_state.HEARTBEAT_TIMEOUT_S):
    it beats whatever the main thread is doing, and stops only when the whole process stops."""
    def beat() -> None:
        while True:
            heartbeats[index] = time.monotonic()
            time.sleep(HEARTBEAT_INTERVAL_S)

    threading.Thread(target=beat, name="nanovllm-heartbeat", daemon=True).start()


def _worker_main(config: Config, rank: int, store_port: int, handle: ChannelHandle,
                 errors: Connection, heartbeats: "ctypes.Array[ctypes.c_double]") -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle: it shuts us down
    if os.environ.get(LOG_LEVEL_ENV_VAR):  # spawned: the caller's logging setup does not reach us
        logging.basicConfig(level=os.environ[LOG_LEVEL_ENV_VAR],
                            format=f"%(asctime)s [rank {rank}] %(name)s: %(message)s")
    exit_with_parent("tensor-parallel worker")
    _start_heartbeat(heartbeats, rank - 1)
    group = channel = None
    healthy = True
    try:
        device = runner_device(config, rank)
        if device.type == "cpu":
            torch.set_num_threads(threads_per_rank(config.tensor_parallel_size))
        else:
            # A daemon process may not start children: torch.compile must compile in-process here.
            import torch._inductor.config as inductor_config
            inductor_config.compile_threads = 1
        store = create_store(rank, config.tensor_parallel_size, store_port)
        store.set(f"joined/{rank}", "1")  # rank 0 waits for this before it starts the rendezvous
        group = TPGroup(store, rank, config.tensor_parallel_size, device)
        channel = StepChannel.attach(handle)
        with use_tp_group(group):
            runner = ModelRunner(config)
            while True:
                method, args = channel.receive()
                if method == "exit":
                    break
                assert method == "run", f"unknown step method {method!r}"
                runner.run(*args)
    except BaseException:
        healthy = False
        try:
            errors.send(traceback.format_exc()[-MAX_ERROR_CHARS:])
        except OSError:
            pass  # rank 0 is gone; nobody is left to tell
        sys.exit(1)
    finally:
        if channel is not None:
            channel.close()
        if group is not None:
            group.destroy(healthy)


# ---- rank 0 ----
class TPWorkers:
    """Rank 0's handle on ranks 1..N-1: starts them, runs steps on them, shuts them down."""

    def __init__(self, config: Config) -> None:
        ctx = mp.get_context("spawn")
        world_size = config.tensor_parallel_size
        self.device = runner_device(config, 0)
        self.num_threads = threads_per_rank(world_size)
        # One heartbeat slot per worker; lock=False: each slot has one writer, and a torn read of a
        # double cannot happen on the platforms torch supports.
        self._state = state = TPGroupState(ctx.Array("d", world_size - 1, lock=False))
        # The finalizer holds the state, never self, so that dropping the engine collects this object.
        self._finalizer = weakref.finalize(self, state.release)
        try:
            store = create_store(0, world_size)
            state.channel = StepChannel.create(world_size - 1, channel_size(config), ctx)
            for rank in range(1, world_size):
                errors, errors_writer = ctx.Pipe(duplex=False)
                process = ctx.Process(target=_worker_main, name=f"nanovllm-tp{rank}", daemon=True,
                                      args=(config, rank, store.port, state.channel.handle(rank - 1),
                                            errors_writer, state.heartbeats))
                process.start()
                errors_writer.close()
                state.add_worker(rank, process, errors)
            state.start_watchdog()
            state.wait_until_joined(store)
            state.group = TPGroup(store, 0, world_size, self.device)
        except BaseException as e:
            state.fail(f"rank 0 failed while starting the workers: {e!r}")
            self.shutdown()
            raise

    @property
    def processes(self) -> list[mp.Process]:
        return [worker.process for worker in self._state.workers]

    @property
    def channel_name(self) -> str | None:
        return self._state.channel_name

    @property
    def is_shut_down(self) -> bool:
        return self._state.closed

    @contextmanager
    def scope(self) -> Iterator[None]:
        """Rank 0's share of the group's work: the group is current, the CPU threads are shared out,
        and any failure shuts the group down; a dead worker surfaces as TPWorkerError."""
        state = self._state
        if state.closed:
            why = state.failure or "exit() was called"
            raise TPWorkerError(f"the tensor-parallel workers are shut down ({why}); create a new LLM")
        threads = torch.get_num_threads()
        try:
            if self.device.type == "cpu":
                torch.set_num_threads(self.num_threads)
            state.raise_if_failed()
            with use_tp_group(state.group):
                yield
            # On CUDA an aborted collective can return garbage instead of raising: check after, too.
            state.raise_if_failed()
        except BaseException as e:
            # A collective that failed on rank 0 raises a RuntimeError: give the dead worker a moment to
            # be reaped so that the error can say which rank died, and how. Anything else (a ValueError
            # every rank raised alike, Ctrl-C) reaches the caller as it is.
            collective_failed = isinstance(e, RuntimeError) and not isinstance(e, TPWorkerError)
            report = state.dead_worker_report(DEATH_GRACE_S) if collective_failed else state.failure
            state.fail(report or f"rank 0 raised {e!r} during a step")
            self.shutdown()
            if collective_failed and report is not None:
                raise TPWorkerError(f"{report}\nThe engine is shut down; create a new LLM.") from e
            raise
        finally:
            torch.set_num_threads(threads)

    def run(self, runner: ModelRunner, batch: StepBatch) -> StepOutput | None:
        """One step on every rank; `runner` is rank 0's own. Returns what runner.run returns."""
        with self.scope():
            # Workers never sample: the sampling part (which may hold whole token histories for the
            # penalties) stays on rank 0.
            self._state.channel.send("run", replace(batch, sampling=None), check=self._state.raise_if_failed)
            return runner.run(batch)

    def shutdown(self) -> None:
        """Stop the workers, destroy rank 0's communicator, unlink the shared memory. Idempotent."""
        self._finalizer()
