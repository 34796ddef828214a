"""The streaming path without a server: a RequestStream merges the steps its handler has not taken
yet and loses nothing to a timed-out wait; the event stream's deltas join to the final text (with
multi-byte characters split across byte-level tokens) for every stream_interval, send a chunk per
step at interval 1 and every that-many tokens otherwise; a chunk filled into its request's template
is byte for byte the JSON of the chunk's body."""

import asyncio
import json

import pytest

from nanovllm.sampling_params import SamplingParams
from nanovllm.serve.request_stream import RequestStream, ServerRequest
from nanovllm.serve.responses import Reply
from nanovllm.serve.streaming import sse_events

TEXT = "Paris is the capital of France: café, naïve, 東京 — «ok» \"quoted\"\n\tend"


class FakeEngine:
    def __init__(self) -> None:
        self.aborted: list[int] = []

    def abort(self, request_id: int) -> None:
        self.aborted.append(request_id)


def test_request_stream_merges_steps_and_survives_timeouts():
    async def main():
        stream = RequestStream(None, asyncio.get_running_loop())
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(stream.next(), 0.01)  # nothing yet; the timed-out wait takes nothing
        stream.add([1, 2], None)
        stream.add([3], None)  # both steps land before the handler looks
        first = await stream.next()
        asyncio.get_running_loop().call_later(0.01, stream.add, [4], {"finish_reason": "length"})
        last = await asyncio.wait_for(stream.next(), 1)
        return first, last
    first, last = asyncio.run(main())
    assert (first.new_token_ids, first.output) == ([1, 2, 3], None)
    assert (last.new_token_ids, last.output) == ([4], {"finish_reason": "length"})


def events_of(tokenizer, token_ids: list[int], steps: list[int], stream_interval: int, with_ids: bool):
    """Run sse_events over a request whose tokens arrive `steps[i]` at a time, the handler taking
    each step before the next lands; returns the parsed events before [DONE], and the engine."""
    engine = FakeEngine()
    request = ServerRequest(7, [1, 2, 3], SamplingParams(max_tokens=len(token_ids)))
    output = {"text": tokenizer.decode(token_ids, skip_special_tokens=True), "token_ids": token_ids,
              "finish_reason": "length"}

    async def main():
        stream = RequestStream(request, asyncio.get_running_loop())
        events = sse_events(engine, stream, Reply("text_completion", "cmpl-1", "tiny"), tokenizer,
                            with_ids, include_usage=True, stream_interval=stream_interval)
        consumer = asyncio.create_task(anext_all(events))
        start = 0
        for i, num in enumerate(steps):
            stream.add(token_ids[start:start + num], output if i == len(steps) - 1 else None)
            start += num
            for _ in range(10):  # let the handler take this step before the next one lands
                await asyncio.sleep(0)
        return await asyncio.wait_for(consumer, 5)

    return asyncio.run(main()), engine, output


async def anext_all(events) -> list[dict]:
    out = [chunk async for chunk in events]
    assert out[-1] == "data: [DONE]\n\n"
    return [json.loads(chunk[len("data: "):]) for chunk in out[:-1]]


@pytest.mark.parametrize("stream_interval", [1, 3, 1000])
def test_deltas_join_to_the_final_text_at_every_interval(tokenizer, stream_interval):
    token_ids = tokenizer.encode(TEXT)
    steps = [1] * len(token_ids)
    events, engine, output = events_of(tokenizer, token_ids, steps, stream_interval, with_ids=True)
    deltas = [e["choices"][0] for e in events if e["choices"]]
    assert "".join(d["text"] for d in deltas) == output["text"] == TEXT
    assert [i for d in deltas for i in d.get("token_ids", [])] == token_ids
    sizes = [len(d["token_ids"]) for d in deltas if "token_ids" in d]
    if stream_interval == 1:
        assert sizes == steps  # each token as it is produced
    else:  # the first at once, then every stream_interval tokens, the rest with the last
        assert sizes[0] == 1 and all(n == stream_interval for n in sizes[1:-1])
        assert 1 <= sizes[-1] <= stream_interval
    assert deltas[-1]["finish_reason"] == "length"
    assert events[-1]["usage"]["completion_tokens"] == len(token_ids)
    assert engine.aborted == []  # it finished: nothing to abort


def test_a_handler_behind_by_several_steps_sends_them_as_one_chunk(tokenizer):
    token_ids = tokenizer.encode(TEXT)
    steps = [1, 5, len(token_ids) - 6]
    events, _, output = events_of(tokenizer, token_ids, steps, 1, with_ids=True)
    deltas = [e["choices"][0] for e in events if e["choices"]]
    sizes = [len(d["token_ids"]) for d in deltas if "token_ids" in d]
    assert sizes == steps
    assert "".join(d["text"] for d in deltas) == output["text"]


@pytest.mark.parametrize("kind", ["text_completion", "chat.completion"])
@pytest.mark.parametrize("text, token_ids", [(TEXT, [1, 22, 333]), ("", None), ("\x00\u2028😀", []),
                                             ("a", None)])
def test_template_chunk_is_the_json_of_its_body(kind, text, token_ids):
    reply = Reply(kind, "id-1", "tiny")
    is_chat = kind == "chat.completion"
    choice = {"index": 0, **({"delta": {"content": text}} if is_chat else {"text": text}), "logprobs": None,
              "finish_reason": None, **({} if token_ids is None else {"token_ids": token_ids})}
    body = {"id": "id-1", "object": "chat.completion.chunk" if is_chat else "text_completion",
            "created": reply.created, "model": "tiny", "choices": [choice]}
    assert reply.chunk(text, token_ids) == f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
