"""The server-sent events of one streamed request: a chunk per step with the text (and token ids)
that became final, then the finish reason, usage when asked, and `data: [DONE]`. Text is decoded
incrementally and never splits a character, so the deltas join to the non-streamed text.

This runs once per stream per engine step on the event loop, where the Python work of every stream
adds up each step (the steps themselves run in the engine process), so it does as little as it can
per chunk: whatever arrived since the last chunk goes out as one (a handler that fell behind catches
up in one send), text is decoded only where there is a tokenizer (without one, chunks carry token ids
alone), and the chunk is filled into its request's template. `stream_interval` > 1 sends a chunk
only every that-many tokens (the first and the last at once): fewer, larger events."""

import json
from collections.abc import AsyncIterator

from nanovllm.engine.detokenizer import IncrementalDetokenizer
from nanovllm.serve.engine_client import EngineClient
from nanovllm.serve.protocol import RequestError, error_body, usage
from nanovllm.serve.request_stream import RequestStream, Update
from nanovllm.serve.responses import Reply, check_finished


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
            check_finished(output)
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
