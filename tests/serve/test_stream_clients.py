"""scripts/stream_clients.py, the benchmarks' load generator: its reader decodes chunked transfer
and SSE however the bytes are cut into reads, and against the real server it counts every token."""

import asyncio
import json
import os
import sys

import pytest
from server_process import Server

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
from stream_clients import _StreamReader, run_level  # noqa: E402


def chunked_response(events: list[str]) -> bytes:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    body = b"".join(b"%x\r\n%s\r\n" % (len(e.encode()), e.encode()) for e in events)
    return head + body + b"0\r\n\r\n"


def event(token_ids: list[int] | None) -> str:
    choice = {"index": 0, "text": "x", "finish_reason": None}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return f"data: {json.dumps({'choices': [choice]})}\n\n"


@pytest.mark.parametrize("read_size", [1, 7, 64, 10**6])
def test_reader_counts_tokens_however_reads_split_the_bytes(read_size):
    events = [event([1]), event([2, 3]), event(None), event([4]), "data: [DONE]\n\n"]
    raw = chunked_response(events)

    async def main():
        reader = _StreamReader()
        for i in range(0, len(raw), read_size):
            reader.data_received(raw[i:i + read_size])
        await asyncio.wait_for(reader.done, 1)
        return reader
    reader = asyncio.run(main())
    assert reader.status == 200
    assert [n for _, n in reader.arrivals] == [1, 2, 1]


@pytest.mark.slow
def test_run_level_against_the_server(qwen3_dir):
    server = Server(qwen3_dir, "--kvcache-block-size", "16", "--max-model-len", "512",
                    "--num-kvcache-blocks", "256", "--stream-interval", "2", api_key=None)
    try:
        jobs = [([1, 2, 3 + i], 5 + i) for i in range(6)]
        level = run_level(server.url, jobs, concurrency=4, num_processes=2)
    finally:
        assert server.terminate() == 0, server.output()
    assert level["tokens"] == sum(n for _, n in jobs)
    assert (level["requests"], level["clients"], level["client_processes"]) == (6, 4, 2)
