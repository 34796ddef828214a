"""The server-sent events of one streamed request: a chunk per step with the text (and token ids)
that became final, then the finish reason, usage when asked, and `data: [DONE]`. Text is decoded
incrementally and never splits a character, so the deltas join to the non-streamed text.

This runs once per stream per engine step on the event loop, where the Python work of every stream
adds up each step (the steps themselves run in the engine process), so it does as little as it can
per chunk: whatever arrived since the last chunk goes out as one (a handler that fell behind catches
up in one send), text is decoded only where there is a tokenizer (without one, chunks carry token ids
alone), and the chunk is filled into its request's template. `stream_interval` > 1 sends a chunk
only every that-many tokens (the first and the last at once): fewer, larger events.

That is `sse_events`, for one prompt and one completion without logprobs, echo or usage in every
chunk; `sse_events_general` serves the rest (several prompts, n > 1, logprobs, echo, continuous usage),
a chunk per completion per step, each with its choice index, and chat with tools: each completion's
text passes through its tool-call stream (tool_calls.py), which holds back what may be a call and
sends each call whole, as one `delta.tool_calls` chunk, once it is complete."""

import asyncio
import json
from collections.abc import AsyncIterator

from nanovllm.engine.detokenizer import IncrementalDetokenizer
from nanovllm.serve.engine_client import EngineClient
from nanovllm.serve.protocol import RequestError, error_body, usage
from nanovllm.serve.request_stream import RequestStream, Update
from nanovllm.serve.responses import (
    LogprobsFormatter,
    Reply,
    check_finished,
    completions_of,
    tool_finish_reason,
)


async def sse_events(engine: EngineClient, stream: RequestStream, reply: Reply, tokenizer,
                     with_token_ids: bool, include_usage: bool,
                     stream_interval: int = 1) -> AsyncIterator[str]:
    request = stream.request
    detokenizer = IncrementalDetokenizer(tokenizer, request.sampling_params.stop) if tokenizer else None
    update: Update | None = None
    num_streamed = 0  # tokens sent so far
    try:
        if first := reply.first_chunk():
            yield first
        while update is None or update.output is None:
            update = await stream.next()
            # After the first token, wait for stream_interval tokens (or the end) before sending.
            while (num_streamed and update.output is None
                   and len(update.new_token_ids) < stream_interval):
                more = await stream.next()
                update = Update(update.new_token_ids + more.new_token_ids, more.output)
            new_token_ids = update.new_token_ids
            num_streamed += len(new_token_ids)
            if detokenizer is None:
                text = ""
            elif update.output is None:
                text = detokenizer.push(new_token_ids)
            else:
                text = detokenizer.finish(update.output["text"], new_token_ids)
            if text or (with_token_ids and new_token_ids):
                yield reply.chunk(text, new_token_ids if with_token_ids else None)
        output = update.output
        try:
            check_finished(output, stream.error)
        except RequestError as e:
            yield f"data: {json.dumps(error_body(str(e), e.kind))}\n\n"
        else:
            yield reply.chunk("", None, output["finish_reason"])
            if include_usage:
                yield reply.usage_chunk(usage(request.num_prompt_tokens, len(output["token_ids"])))
        yield "data: [DONE]\n\n"
    finally:
        if update is None or update.output is None:  # the client left (or the server is stopping)
            engine.abort(request.request_id)


class _Choices:
    """The completions of one prompt as they stream: a detokenizer and a count of sent tokens each."""

    def __init__(self, stream: RequestStream, tokenizer, formatter: LogprobsFormatter | None,
                 tool_calls=None) -> None:
        request = stream.request
        params = request.sampling_params
        self.stream, self.n, self.formatter = stream, params.n, formatter
        self.tool_streams = None if tool_calls is None else [tool_calls() for _ in range(params.n)]
        self.num_calls = [0] * params.n  # tool calls sent
        self.detokenizers = [IncrementalDetokenizer(tokenizer, params.stop) if tokenizer else None
                             for _ in range(params.n)]
        self.num_sent = [0] * params.n
        self.text_offsets = [len(request.prompt_text or "")] * params.n

    def index(self, i: int) -> int:
        return self.stream.request.index * self.n + i

    def delta(self, i: int, token_ids: list[int], logprobs: list | None, final_text: str | None
              ) -> tuple[str, dict | None]:
        """Completion i's new text (its last when final_text is given) and the logprobs object."""
        detokenizer = self.detokenizers[i]
        if detokenizer is None:
            text = ""
        elif final_text is None:
            text = detokenizer.push(token_ids)
        else:
            text = detokenizer.finish(final_text, token_ids)
        formatted = None
        if self.formatter is not None and logprobs:
            formatted = self.formatter.format(token_ids, logprobs, self.text_offsets[i])
            self.text_offsets[i] += sum(len(self.formatter.token_text(t)) for t in token_ids)
        self.num_sent[i] += len(token_ids)
        return text, formatted


async def sse_events_general(engine: EngineClient, streams: list[RequestStream], reply: Reply, tokenizer,
                             with_token_ids: bool, include_usage: bool,
                             continuous_usage: bool, tool_calls=None) -> AsyncIterator[str]:
    """tool_calls: None, or a factory of the stream that finds one completion's tool calls."""
    params = streams[0].request.sampling_params
    formatter = None if params.logprobs is None else LogprobsFormatter(tokenizer, reply.is_chat,
                                                                       params.logprobs)
    states = {id(stream): _Choices(stream, tokenizer, formatter, tool_calls) for stream in streams}
    num_prompt_tokens = sum(stream.request.num_prompt_tokens for stream in streams)
    num_completion_tokens = 0
    pending: dict[asyncio.Future, RequestStream] = {}
    error = None

    def chunk(state: _Choices, i: int, text: str, token_ids: list[int], logprobs: dict | None,
              finish_reason: str | None = None) -> str:
        running = usage(num_prompt_tokens, num_completion_tokens) if continuous_usage else None
        return reply.chunk(text, token_ids if with_token_ids else None, finish_reason, state.index(i),
                           logprobs, running)

    def tool_chunks(state: _Choices, i: int, text: str, final: bool) -> tuple[str, list[str]]:
        """The content of `text` that is final, and an event for the tool calls that closed in it."""
        if state.tool_streams is None:
            return text, []
        tools = state.tool_streams[i]
        text, calls = tools.finish(text) if final else tools.push(text)
        if not calls:
            return text, []
        first, state.num_calls[i] = state.num_calls[i], state.num_calls[i] + len(calls)
        return text, [reply.tool_calls_chunk(calls, first, state.index(i))]

    try:
        for state in states.values():
            for i in range(state.n):
                if first := reply.first_chunk(state.index(i)):
                    yield first
                if state.stream.request.prompt_text:  # echo: the prompt opens each choice
                    yield reply.chunk(state.stream.request.prompt_text, None, None, state.index(i), None)
        pending = {asyncio.ensure_future(stream.next()): stream for stream in streams}
        while pending and error is None:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                stream = pending.pop(task)
                update, state = task.result(), states[id(stream)]
                if update.output is None:
                    each = update.token_ids if stream.request.detailed else [update.new_token_ids]
                    for i, new in enumerate(each or []):
                        if new:
                            num_completion_tokens += len(new)
                            lps = update.logprobs[i] if update.logprobs else None
                            text, formatted = state.delta(i, new, lps, None)
                            text, calls = tool_chunks(state, i, text, False)
                            if text or formatted or (with_token_ids and new):
                                yield chunk(state, i, text, new, formatted)
                            for event in calls:
                                yield event
                    pending[asyncio.ensure_future(stream.next())] = stream
                    continue
                try:
                    check_finished(update.output, stream.error)
                except RequestError as e:
                    error = e
                    break
                for i, completion in enumerate(completions_of(update.output)):
                    rest = completion["token_ids"][state.num_sent[i]:]
                    num_completion_tokens += len(rest)
                    lps = completion["logprobs"][state.num_sent[i]:] if completion.get("logprobs") else None
                    text, formatted = state.delta(i, rest, lps, completion["text"])
                    text, calls = tool_chunks(state, i, text, True)
                    if calls:  # the calls go before the chunk with the finish reason
                        if text or formatted:
                            yield chunk(state, i, text, rest, formatted)
                            text, rest, formatted = "", [], None
                        for event in calls:
                            yield event
                    finish_reason = tool_finish_reason(completion["finish_reason"], state.num_calls[i] > 0)
                    yield chunk(state, i, text, rest, formatted, finish_reason)
        if error is not None:
            yield f"data: {json.dumps(error_body(str(error), error.kind))}\n\n"
        elif include_usage:
            yield reply.usage_chunk(usage(num_prompt_tokens, num_completion_tokens))
        yield "data: [DONE]\n\n"
    finally:
        for task in pending:
            task.cancel()
        for stream in streams:  # those still running: the client left, or one of them failed
            engine.abort(stream.request.request_id)
