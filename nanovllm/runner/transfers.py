"""A step's transfers between host and device, both off the compute stream.

Up: the step's small host -> device inputs go in one copy on a stream of their own.

On the compute stream every copy is a node that the next kernel waits behind (2-8 us each on an H200,
docs/performance-notes.md, "Host overhead"), and a one-row decode step had three before its first kernel.
Here the step's
inputs (the decode graph's staging area, the sampler's per-row parameters) are written into one of two
pinned host slots, and `flush()` copies the slot on the copy stream; the compute stream only waits for
that copy's event. With overlap scheduling the host builds step n+1 while the GPU runs step n, so the
copy has landed long before step n+1's first kernel.

Slot i is reused two steps later: the host waits for its last copy before writing it again, and the copy
stream waits for a compute-stream event recorded when the step after slot i's last user began (by then
every kernel that read slot i was queued before that event). On the CPU there is nothing to overlap: a
reservation is a plain tensor.

Down: a step's output on its way to the host. When the step is launched, its sampled ids (and the
logprobs some rows asked for) are copied without blocking into pinned host memory, behind one CUDA
event; `wait()` waits for that event, the one host sync of a step, and reads them. Until then the host
is free to schedule and launch the next step, whose decode rows take their input token from
`sampled`, still on the device (overlap scheduling, nanovllm.engine.overlap). The copies run on a
stream of their own when the runner gives one: on the compute stream the next step's first kernel
waited behind them (~8 us a step at one row, docs/performance-notes.md, "Host overhead"). On the CPU there
is nothing to wait
for: the tensors are read where they are."""

from collections.abc import Callable

import numpy as np
import torch

from nanovllm.engine.step import StepOutput
from nanovllm.layers.logprobs import SampledLogprobs
from nanovllm.outputs import TokenLogprobs

NUM_SLOTS = 2
# Every reservation starts on this many bytes, so any dtype's view of the slot is aligned.
ALIGN = 16


class Uploads:
    def __init__(self, device: torch.device, capacity: int) -> None:
        """capacity: bytes of one slot; a step that asks for more copies the rest on the compute stream."""
        self.device = device
        self.capacity = capacity
        self.on_gpu = device.type == "cuda"
        self.slot = NUM_SLOTS - 1
        self.used = 0
        self.overflow: list[tuple[torch.Tensor, torch.Tensor]] = []  # (pinned host, device), beyond capacity
        if not self.on_gpu:
            return
        self.host = [torch.empty(capacity, dtype=torch.uint8, pin_memory=True) for _ in range(NUM_SLOTS)]
        self.dev = [torch.empty(capacity, dtype=torch.uint8, device=device) for _ in range(NUM_SLOTS)]
        self.copied: list[torch.cuda.Event | None] = [None] * NUM_SLOTS  # each slot's last copy
        self.stream = torch.cuda.Stream(device)
        self.begun: torch.cuda.Event | None = None  # compute stream when the current step began
        self.reuse_after: torch.cuda.Event | None = None  # ... when the previous step began

    def begin(self) -> None:
        """Start a step's reservations in the next slot."""
        if not self.on_gpu:
            return
        self.slot = (self.slot + 1) % NUM_SLOTS
        copied = self.copied[self.slot]
        if copied is not None:
            copied.synchronize()  # long done: its step has been waited for
        self.used = 0
        self.overflow.clear()
        # With two slots, this slot's last user is the step before the previous one: everything it queued
        # lies before the event the previous step's begin() recorded.
        self.reuse_after = self.begun
        self.begun = torch.cuda.Event()
        self.begun.record(torch.cuda.current_stream(self.device))

    def reserve(self, count: int, dtype: torch.dtype) -> tuple[np.ndarray, torch.Tensor]:
        """(a host array to fill now, the device tensor it reaches): [count] of dtype each. The device
        tensor may be read on the compute stream after `flush()`, within this step."""
        if not self.on_gpu:
            t = torch.empty(count, dtype=dtype)
            return t.numpy(), t
        start = -(-self.used // ALIGN) * ALIGN
        end = start + count * dtype.itemsize
        if end > self.capacity:
            host = torch.empty(count, dtype=dtype, pin_memory=True)
            dev = torch.empty(count, dtype=dtype, device=self.device)
            self.overflow.append((host, dev))
            return host.numpy(), dev
        self.used = end
        return self.host[self.slot][start:end].view(dtype).numpy(), self.dev[self.slot][start:end].view(dtype)

    def put(self, values: list | np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        """values as a [len(values)] device tensor of dtype, readable after `flush()`."""
        host, dev = self.reserve(len(values), dtype)
        host[:] = values
        return dev

    def flush(self) -> None:
        """Copy this step's reservations; the compute stream's next work waits for them."""
        if not self.on_gpu:
            return
        compute = torch.cuda.current_stream(self.device)
        if self.used:
            slot = self.slot
            with torch.cuda.stream(self.stream):
                if self.reuse_after is not None:
                    self.stream.wait_event(self.reuse_after)
                self.dev[slot][: self.used].copy_(self.host[slot][: self.used], non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(self.stream)
            self.copied[slot] = copied
            compute.wait_event(copied)
            self.used = 0
        for host, dev in self.overflow:
            dev.copy_(host, non_blocking=True)
        self.overflow.clear()

    def release(self) -> None:
        """Wait for the copies in flight (before the slots' memory is freed)."""
        if self.on_gpu:
            self.stream.synchronize()

def _to_host(t: torch.Tensor, host: torch.Tensor | None = None) -> torch.Tensor:
    """A host copy of t, queued on the current stream, that is only safe to read after the step's event
    (pinned, so the copy is asynchronous); t itself on the CPU. host: pinned memory of t's shape to copy
    into (t then lives as long as the caller says, as a decode graph's output does), else a new one."""
    if t.device.type == "cpu":
        return t
    if host is None:
        # t may be freed (logprobs' temporaries) before this stream has read it: keep its memory until then.
        t.record_stream(torch.cuda.current_stream(t.device))
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


class PendingOutput:
    def __init__(self, sampled: torch.Tensor, logprobs: SampledLogprobs | None,
                 prompt_logprobs: dict[int, list[TokenLogprobs]] | None,
                 copy_stream: torch.cuda.Stream | None = None, sampled_host: torch.Tensor | None = None
                 ) -> None:
        """sampled: [sampling rows] int64, on the step's device; prompt_logprobs are on the host already
        (those steps sync while they run, and overlap scheduling waits for them at once). copy_stream:
        where the copies to the host run (after the step's work so far), instead of the current stream.
        sampled_host: pinned memory for the sampled ids' copy, which nothing writes before `wait()`."""
        self.sampled = sampled
        self._prompt_logprobs = prompt_logprobs
        self._event: torch.cuda.Event | None = None
        if sampled.device.type != "cuda":
            self._token_ids = sampled
            self._logprobs = logprobs
            return
        stream = torch.cuda.current_stream(sampled.device)
        if copy_stream is not None:
            copy_stream.wait_stream(stream)
            stream = copy_stream
        with torch.cuda.stream(stream):
            self._token_ids = _to_host(sampled, sampled_host)
            self._logprobs = logprobs.map(_to_host) if logprobs is not None else None
            # Recorded after the copies: once it has passed, they have landed.
            self._event = torch.cuda.Event()
            self._event.record(stream)

    def sample(self) -> None:
        """Sampled already (at launch)."""

    def wait(self) -> StepOutput:
        """Block until the step's sampled ids are on the host; returns them with their logprobs."""
        if self._event is not None:
            self._event.synchronize()
        token_ids = self._token_ids.tolist()
        logprobs = self._logprobs.dicts(len(token_ids)) if self._logprobs is not None else None
        return StepOutput(token_ids, logprobs, self._prompt_logprobs)


class DeferredOutput:
    """A launched step whose sampling waits for `sample()` (Executor.launch's defer_sampling): its
    forward pass and logits are queued on the device; `sample()` queues the sampler and the copies to the
    host (`finish`), once. `sampled` and `wait()` sample first if it has not happened yet."""

    def __init__(self, finish: Callable[[], PendingOutput]) -> None:
        self._finish = finish
        self._output: PendingOutput | None = None

    def sample(self) -> None:
        if self._output is None:
            self._output = self._finish()

    @property
    def sampled(self) -> torch.Tensor:
        self.sample()
        return self._output.sampled

    def wait(self) -> StepOutput:
        self.sample()
        return self._output.wait()
