"""One request as the HTTP process holds it: what was checked and sent to the engine process
(ServerRequest), and the mailbox its handler reads the engine's tokens from (RequestStream)."""

import asyncio
from dataclasses import dataclass

from nanovllm.sampling_params import SamplingParams


@dataclass(slots=True)
class ServerRequest:
    """A request checked in the HTTP process (nanovllm.serve.admission), ready for the engine."""
    request_id: int  # the HTTP process's own id; the engine process maps it to its engine's
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival: float = 0.0  # time.monotonic() when its HTTP request came in, for the latency metrics
    prompt_text: str | None = None  # for echo: the prompt as text
    index: int = 0  # which prompt of its HTTP request: its choices are index * n + completion index

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def detailed(self) -> bool:
        """Whether its updates carry every completion's tokens and logprobs (Update.token_ids)."""
        return self.sampling_params.n > 1 or self.sampling_params.logprobs is not None


@dataclass(slots=True)
class Update:
    """New tokens of one request since its last update; `output` is set on the last one. For a
    detailed request, `token_ids` and `logprobs` hold each completion's new ones (the last update's
    rest is in its output)."""
    new_token_ids: list[int]
    output: dict | None = None
    token_ids: list[list[int]] | None = None
    logprobs: list[list[dict[int, float]]] | None = None


class RequestStream:
    """One request's mailbox on its event loop: each engine step adds tokens, the handler takes all
    that arrived since it last looked. Steps that land while a handler is still busy with an earlier
    one merge, so a slow handler sends fewer, larger chunks instead of falling behind. A list and a
    future, not an asyncio.Queue: one append and one wake-up per step."""

    __slots__ = ("request", "loop", "_token_ids", "_output", "_waiter", "_each", "_logprobs", "error",
                 "first_token_time", "last_token_time")

    def __init__(self, request: ServerRequest, loop: asyncio.AbstractEventLoop) -> None:
        self.request, self.loop = request, loop
        self._token_ids: list[int] = []
        self._output: dict | None = None
        self._waiter: asyncio.Future | None = None
        self._each: list[list[int]] | None = None
        self._logprobs: list[list[dict]] | None = None
        self.error: str | None = None  # why the server aborted it, when it did (not the client)
        # loop.time() of its first and latest tokens (the engine client's, for the latency metrics)
        self.first_token_time: float | None = None
        self.last_token_time = 0.0

    def add(self, new_token_ids: list[int], output: dict | None, token_ids: list[list[int]] | None = None,
            logprobs: list[list[dict]] | None = None) -> None:
        """On the event loop (the engine client's reader calls it)."""
        self._token_ids += new_token_ids
        if token_ids is not None:
            if self._each is None:
                self._each = [[] for _ in token_ids]
            for mine, new in zip(self._each, token_ids):
                mine += new
        if logprobs is not None:
            if self._logprobs is None:
                self._logprobs = [[] for _ in logprobs]
            for mine, new in zip(self._logprobs, logprobs):
                mine += new
        if output is not None:
            self._output = output
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def next(self) -> Update:
        """Everything since the last call, waiting for at least one token or the output. Cancelling
        the wait (a timeout) loses nothing."""
        while not self._token_ids and self._output is None and not self._each:
            self._waiter = self.loop.create_future()
            await self._waiter
        update = Update(self._token_ids, self._output, self._each, self._logprobs)
        self._token_ids, self._each, self._logprobs = [], None, None
        return update

    async def result(self) -> dict:
        """The output, once the request finished (intermediate tokens are dropped)."""
        while self._output is None:
            await self.next()
        return self._output
