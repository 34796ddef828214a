"""The HTTP process's side of the engine: it starts the engine process (one per data-parallel
replica, nanovllm.dp.engine_process), sends it checked requests and aborts, and fans each step
message out to the requests' streams. The pipes are read on the event loop itself (a reader callback,
not a thread): one wake-up per step, and no second thread taking turns with the handlers for the GIL.

Failures never hang a request: an engine process that dies, or fails and exits, ends every request
it had with finish_reason "error" (its error in the output), and /health reports it. One that stops
answering (a hang in a kernel, a collective, the driver) while it has requests is stopped by a
watchdog after `step_timeout` seconds without a message, with the same outcome. Stopping (SIGTERM,
Ctrl-C) aborts what is still in flight; its requests end with finish_reason "abort"."""

import asyncio
import logging
import weakref
from dataclasses import fields
from itertools import zip_longest

from nanovllm.config import Config
from nanovllm.dp.engine_core import EngineStats
from nanovllm.dp.engine_process import EngineProcess, EngineStartError
from nanovllm.dp.replica import placements
from nanovllm.serve.request_metrics import RequestMetrics
from nanovllm.serve.request_stream import RequestStream, ServerRequest
from nanovllm.utils.tokenizer import load_engine_tokenizer

logger = logging.getLogger(__name__)

# Seconds an engine with requests may go without a message (one comes after every step) before it is
# taken for hung. Generous: a step is milliseconds on a GPU, but a first compile or a long prompt on a
# CPU can take minutes, and the tensor-parallel collectives give up after 10 (distributed/group.py).
STEP_TIMEOUT_S = 600.0
# The watchdog looks this often, at most (a quarter of the timeout when that is shorter).
WATCHDOG_POLL_S = 5.0

__all__ = ["EngineClient", "EngineStartError"]


def _close_all(engines: list[EngineProcess]) -> None:
    for engine in engines:
        engine.close()


class EngineClient:
    def __init__(self, model: str, options: dict, step_timeout: float = STEP_TIMEOUT_S) -> None:
        """Check the options here (TypeError/ValueError), start the engine processes and wait until
        they are built (EngineStartError if one fails). step_timeout: seconds an engine with requests
        may stay silent before the watchdog stops it (0: no watchdog)."""
        if not isinstance(step_timeout, int | float) or step_timeout < 0:
            raise ValueError(f"step_timeout must be a number of seconds >= 0 (0: off), got {step_timeout!r}")
        self.step_timeout = float(step_timeout)
        self.config = config = Config.from_options(model, **options)
        engine_options = {**options, "data_parallel_size": 1}
        layout = placements(config) if config.data_parallel_size > 1 else [None]
        self.engines: list[EngineProcess] = []
        # Also at interpreter exit: a non-daemon child that was never stopped would hang it.
        self._finalizer = weakref.finalize(self, _close_all, self.engines)
        try:
            for index, placement in enumerate(layout):
                self.engines.append(EngineProcess(index, model, engine_options, placement, detailed=True))
            self.tokenizer = load_engine_tokenizer(config)  # while the engines load
            for engine in self.engines:
                engine.wait_ready()
        except BaseException:
            self.close()
            raise
        # A request must fit whichever engine it goes to.
        self.num_kvcache_blocks = min(engine.info.num_kvcache_blocks for engine in self.engines)
        self.num_total_blocks = sum(engine.info.num_kvcache_blocks for engine in self.engines)
        self.error: str | None = None  # why an engine failed; /health reports it
        self._streams: dict[int, tuple[RequestStream, EngineProcess]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self._num_running = len(self.engines)
        self._all_gone: asyncio.Event | None = None
        self.request_metrics = RequestMetrics(config.max_model_len)

    # ---- the event loop's side ----
    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start reading the engines' messages on `loop` (the server's, at startup)."""
        self._loop, self._all_gone = loop, asyncio.Event()
        for engine in self.engines:
            loop.add_reader(engine.outbox.fileno(), self._on_readable, engine)
        if self.step_timeout:
            loop.call_later(self._watchdog_poll, self._watch)

    @property
    def healthy(self) -> bool:
        return (self.error is None and not self._stopping
                and all(engine.process.is_alive() for engine in self.engines))

    def submit(self, request: ServerRequest) -> RequestStream:
        """Send a checked request to the least loaded engine; returns the stream its tokens arrive on."""
        if not self.healthy:
            raise RuntimeError(f"the engine is not running ({self.error or 'the server is stopping'})")
        engine = min(self.engines, key=lambda e: e.num_pending_tokens)
        stream = RequestStream(request, self._loop)
        self._streams[request.request_id] = (stream, engine)
        if not engine.num_pending_tokens:  # it was idle, so silent: its clock starts now
            engine.last_heard = self._loop.time()
        engine.num_pending_tokens += _cost(request)
        engine.send(("add", request.request_id, request.prompt_token_ids, request.sampling_params))
        return stream

    def abort(self, request_id: int) -> None:
        """Abort a request (its client left); its KV blocks are freed in the engine process."""
        entry = self._streams.get(request_id)
        if entry is not None:  # else it has finished already
            entry[1].send(("abort", request_id))

    def abort_all(self, reason: str) -> None:
        """Abort every request in flight; each ends with finish_reason "abort" and `reason` as its
        error (the server stops: better an error event than a cut-off stream)."""
        for request_id, (stream, engine) in self._streams.items():
            stream.error = reason
            engine.send(("abort", request_id))

    def stats(self) -> EngineStats:
        """The engines' latest figures, summed."""
        per_engine = [engine.stats for engine in self.engines]
        if len(per_engine) == 1:
            return per_engine[0]
        by_position = ("finish_reasons", "num_spec_accepted_tokens_per_pos")  # tuples, summed item by item
        totals = {f.name: sum(getattr(s, f.name) for s in per_engine)
                  for f in fields(EngineStats) if f.name not in by_position}
        for name in by_position:
            totals[name] = tuple(map(sum, zip_longest(*(getattr(s, name) for s in per_engine), fillvalue=0)))
        return EngineStats(**totals)

    @property
    def _watchdog_poll(self) -> float:
        return min(WATCHDOG_POLL_S, self.step_timeout / 4)

    def _watch(self) -> None:
        """Stop every engine that has requests and has said nothing for step_timeout seconds (its EOF
        then fails its requests); look again later while any engine runs."""
        if self._stopping or self._num_running == 0:
            return
        now = self._loop.time()
        for engine in self.engines:
            silent = now - engine.last_heard
            if (engine.hung is None and engine.num_pending_tokens and engine.process.is_alive()
                    and silent > self.step_timeout):
                engine.hung = f"no step for {silent:.0f} s with requests in flight"
                logger.error("%s stopped responding (%s); stopping it", engine, engine.hung)
                # Unhealthy from now on, not only once it is gone (SIGKILL may take a moment).
                self.error = self.error or f"{engine} stopped responding ({engine.hung})"
                self._loop.run_in_executor(None, engine.stop_hung)
        self._loop.call_later(self._watchdog_poll, self._watch)

    def _on_readable(self, engine: EngineProcess) -> None:
        try:
            message = engine.outbox.recv()
        except (EOFError, OSError):
            self._engine_gone(engine)
            return
        engine.last_heard = now = self._loop.time()
        if message[0] == "step":
            _, updates, engine.stats = message
            metrics = self.request_metrics
            for request_id, new_token_ids, output, details in updates:
                stream, _ = self._streams[request_id]
                token_ids = logprobs = None
                if details is not None:
                    token_ids, logprobs = details.token_ids, details.logprobs
                    if details.queue_time is not None:
                        metrics.request_queue_time.observe(details.queue_time)
                if new_token_ids or token_ids:
                    if stream.first_token_time is None:
                        stream.first_token_time = now
                        metrics.time_to_first_token.observe(now - stream.request.arrival)
                    else:
                        metrics.inter_token_latency.observe(now - stream.last_token_time)
                    stream.last_token_time = now
                if output is not None:
                    del self._streams[request_id]
                    engine.num_pending_tokens -= _cost(stream.request)
                    self._observe_finished(stream, output, now)
                stream.add(new_token_ids, output, token_ids, logprobs)
        elif message[0] == "error":  # it exits next: its EOF ends its requests
            engine.traceback = message[1]
            logger.error("%s failed:\n%s", engine, message[1])

    def _observe_finished(self, stream: RequestStream, output: dict, now: float) -> None:
        metrics = self.request_metrics
        if output["finish_reason"] == "error":
            return
        metrics.e2e_request_latency.observe(now - stream.request.arrival)
        metrics.request_prompt_tokens.observe(stream.request.num_prompt_tokens)
        completions = output.get("outputs") or [output]
        metrics.request_generation_tokens.observe(sum(len(c["token_ids"]) for c in completions))

    def _engine_gone(self, engine: EngineProcess) -> None:
        """End every request the engine had: aborted when the server stops, failed otherwise."""
        self._loop.remove_reader(engine.outbox.fileno())
        if self._stopping:
            output = {"finish_reason": "abort", "error": "the server is stopping"}
        else:
            why = engine.describe_end()
            logger.error("%s; failing its requests", why)
            self.error = self.error or why
            output = {"finish_reason": "error", "error": f"the engine failed: {why}"}
        for request_id, (stream, owner) in list(self._streams.items()):
            if owner is engine:
                del self._streams[request_id]
                stream.add([], {**output, "text": "", "token_ids": []})
        # Now rather than at exit: a server may run on for long (answering 503s) after its engine died.
        self._loop.run_in_executor(None, engine.clean_up)
        self._num_running -= 1
        if self._num_running == 0:
            self._all_gone.set()

    async def stop(self, timeout: float) -> None:
        """Abort what is in flight (its requests end with "abort") and wait up to `timeout` s for the
        engines to shut down; `close()` finishes the job."""
        self._stopping = True
        for engine in self.engines:
            engine.send(("stop",))
        try:
            await asyncio.wait_for(self._all_gone.wait(), timeout)
        except asyncio.TimeoutError:
            logger.warning("the engine did not stop in %.0f s; it will be terminated", timeout)

    # ---- lifetime ----
    def close(self) -> None:
        """Stop every engine process (terminate or kill one that does not stop) and clean up after
        it. Idempotent; also runs at interpreter exit."""
        self._finalizer()


def _cost(request: ServerRequest) -> int:
    """What a request may take of an engine's KV cache: prompt + max_tokens."""
    return request.num_prompt_tokens + request.sampling_params.max_tokens

