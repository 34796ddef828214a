"""The executor boundary: what the engine asks of the device side. The engine schedules and keeps
the books in plain Python; an Executor runs a step (a StepBatch record) on one or more ranks and hands
back the sampled tokens (a StepOutput). nanovllm.runner.model_runner.ModelRunner is the single-rank
executor; nanovllm.distributed.executor builds the tensor-parallel one. The engine sees no tensor:
what a step leaves on the device between an overlapped launch and its wait stays inside a
PendingStep."""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from nanovllm.config import Config
from nanovllm.engine.step import SamplingBatch, StepBatch, StepOutput


class PendingStep(Protocol):
    """A launched step whose sampled tokens are on their way to the host."""

    def sample(self) -> None:
        """Queue the step's sampling where its launch deferred it (Executor.launch's defer_sampling);
        nothing otherwise. `wait` calls it first."""
        ...

    def wait(self) -> StepOutput:
        """Block until the step's tokens (and the logprobs its rows asked for) are on the host."""
        ...


@dataclass(frozen=True, slots=True)
class ExecutorInfo:
    """What the startup line reports of the device side."""

    device: str  # "cpu", "cuda:0"
    dtype: str  # "bfloat16"
    attention_backend: str
    num_kvcache_blocks: int  # what the memory allowed, on every rank
    cpu_threads: int | None  # the CPU operators' threads now (None on a GPU)


class Executor(Protocol):
    info: ExecutorInfo
    # Ranks a step runs on. One rank can `launch` (overlap scheduling, engine/overlap.py) and re-run a
    # failed step request by request; more cannot (a failed collective leaves the group unusable).
    world_size: int

    def run(self, batch: StepBatch) -> StepOutput:
        """Run one step on every rank and wait for it; rank 0's sampled tokens."""
        ...

    def launch(self, batch: StepBatch, previous: PendingStep | None, defer_sampling: bool = False
               ) -> PendingStep:
        """Queue one step without waiting for it (world_size 1 only). The batch's prev_token_* inputs
        are read on the device from `previous`'s sampled ids: the step launched before it's (or those
        joined with a draft model's last drafts, speculative/draft_steps.FedTokens). defer_sampling: queue the
        forward pass only, and sample at the PendingStep's `sample()`: what sampling reads on the host
        (a structured output's matcher) may take the previous step's tokens meanwhile."""
        ...

    def check_sampling(self, sampling: SamplingBatch) -> None:
        """Raise what rank 0 alone would raise turning these sampling rows into tensors (on the host),
        so that under tensor parallelism a bad row fails before the step reaches the other ranks."""
        ...

    def shutdown(self) -> None:
        """Stop every rank and free the model and its KV cache. Idempotent."""
        ...


ExecutorFactory = Callable[[Config], Executor]
