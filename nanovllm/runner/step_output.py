"""A step's output on its way to the host. When the step is launched, its sampled ids (and the
logprobs some rows asked for) are copied without blocking into pinned host memory, behind one CUDA
event; `wait()` waits for that event, the one host sync of a step, and reads them. Until then the host
is free to schedule and launch the next step, whose decode rows take their input token from
`sampled`, still on the device (overlap scheduling, nanovllm.engine.overlap). The copies run on a
stream of their own when the runner gives one: on the compute stream the next step's first kernel
waited behind them (~8 us a step at one row, BENCHMARKS.md Q1). On the CPU there is nothing to wait
for: the tensors are read where they are."""

import torch

from nanovllm.layers.logprobs import SampledLogprobs
from nanovllm.outputs import TokenLogprobs
from nanovllm.runner.batch import StepOutput


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

    def wait(self) -> StepOutput:
        """Block until the step's sampled ids are on the host; returns them with their logprobs."""
        if self._event is not None:
            self._event.synchronize()
        token_ids = self._token_ids.tolist()
        logprobs = self._logprobs.dicts(len(token_ids)) if self._logprobs is not None else None
        return StepOutput(token_ids, logprobs, self._prompt_logprobs)
