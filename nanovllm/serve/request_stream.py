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

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(slots=True)
class Update:
    """New tokens of one request since its last update; `output` is set on the last one."""
    new_token_ids: list[int]
    output: dict | None = None


class RequestStream:
    """One request's mailbox on its event loop: each engine step adds tokens, the handler takes all
    that arrived since it last looked. Steps that land while a handler is still busy with an earlier
    one merge, so a slow handler sends fewer, larger chunks instead of falling behind. A list and a
    future, not an asyncio.Queue: one append and one wake-up per step."""

    __slots__ = ("request", "loop", "_token_ids", "_output", "_waiter")

    def __init__(self, request: ServerRequest, loop: asyncio.AbstractEventLoop) -> None:
        self.request, self.loop = request, loop
        self._token_ids: list[int] = []
        self._output: dict | None = None
        self._waiter: asyncio.Future | None = None

    def add(self, new_token_ids: list[int], output: dict | None) -> None:
        """On the event loop (the engine client's reader calls it)."""
        self._token_ids += new_token_ids
        if output is not None:
            self._output = output
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def next(self) -> Update:
        """Everything since the last call, waiting for at least one token or the output. Cancelling
        the wait (a timeout) loses nothing."""
        while not self._token_ids and self._output is None:
            self._waiter = self.loop.create_future()
            await self._waiter
        update = Update(self._token_ids, self._output)
        self._token_ids = []
        return update
