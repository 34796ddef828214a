"""A load generator for the server benchmarks: N concurrent streaming /v1/completions clients,
spread over several client processes, each reading its streams with a lean asyncio Protocol (a
chunked-transfer decoder and an SSE splitter, one timestamp per socket read) instead of an HTTP
library's line iterator. One Python process with httpx tops out at a few thousand SSE events/s, below
what the server sends at N = 256, so it would measure itself; this reader costs a few microseconds
per event, and the processes share the load.

`run_level(url, jobs, concurrency)` returns TTFT and inter-token-latency percentiles, output tok/s
and the clients' own CPU seconds (so a caller can tell whether the clients kept up)."""

import asyncio
import json
import os
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from urllib.parse import urlsplit

# Streams per client process: a process reads ~50k events/s, so 32 streams at a few hundred
# events/s each leave it mostly idle.
STREAMS_PER_PROCESS = 32


class _StreamReader(asyncio.Protocol):
    """One streamed completion over one connection: decodes HTTP/1.1 chunked transfer, splits the
    body into SSE events and records (arrival time, number of token ids) of each token-bearing one."""

    def __init__(self) -> None:
        self.head = b""  # the status line and headers, until they are complete
        self.status: int | None = None
        self.raw = bytearray()  # chunked-encoded body bytes not decoded yet
        self.body = bytearray()  # decoded body bytes not split into events yet
        self.arrivals: list[tuple[float, int]] = []
        self.done = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        if self.status is None:
            self.head += data
            if b"\r\n\r\n" not in self.head:
                return
            head, _, data = self.head.partition(b"\r\n\r\n")
            self.status = int(head.split(b" ", 2)[1])
        self.raw += data
        ended = False
        while True:  # chunked transfer: "<hex size>\r\n<bytes>\r\n"; size 0 ends the body
            eol = self.raw.find(b"\r\n")
            if eol < 0:
                break
            size = int(self.raw[:eol].split(b";")[0], 16)
            if len(self.raw) < eol + 2 + size + 2:
                break
            if size == 0:
                ended = True
                break
            self.body += self.raw[eol + 2:eol + 2 + size]
            del self.raw[:eol + 2 + size + 2]
        while (end := self.body.find(b"\n\n")) >= 0:
            event = bytes(self.body[:end])
            del self.body[:end + 2]
            if event.startswith(b"data: {"):
                choices = json.loads(event[6:])["choices"]
                if choices and (ids := choices[0].get("token_ids")):
                    self.arrivals.append((now, len(ids)))
        if ended:
            self._finish()

    def _finish(self) -> None:
        if not self.done.done():
            self.done.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_exception(exc or ConnectionError("the server closed the stream early"))


async def one_request(host: str, port: int, prompt: list[int], max_tokens: int) -> dict:
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.6, "ignore_eos": True,
                       "stream": True, "return_token_ids": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    loop = asyncio.get_running_loop()
    start = time.perf_counter()
    transport, reader = await loop.create_connection(_StreamReader, host, port)
    try:
        transport.write(head + body)
        await reader.done
    finally:
        transport.close()
    assert reader.status == 200, f"HTTP {reader.status}"
    arrivals = reader.arrivals
    num_tokens = sum(n for _, n in arrivals)
    assert num_tokens == max_tokens, f"got {num_tokens} tokens, asked for {max_tokens}"
    gaps = [(b[0] - a[0]) / b[1] for a, b in zip(arrivals, arrivals[1:])]  # per token
    return {"ttft": arrivals[0][0] - start, "itl": gaps, "tokens": num_tokens, "events": len(arrivals),
            "start": start, "end": arrivals[-1][0]}


async def _run_share(url: str, jobs: list[tuple[list[int], int]], concurrency: int) -> list[dict]:
    parts = urlsplit(url)
    semaphore = asyncio.Semaphore(concurrency)

    async def limited(job):
        async with semaphore:
            return await one_request(parts.hostname, parts.port, *job)
    return await asyncio.gather(*(limited(job) for job in jobs))


def _process_main(url: str, jobs: list[tuple[list[int], int]], concurrency: int) -> tuple[list[dict], float]:
    cpu = time.process_time()
    results = asyncio.run(_run_share(url, jobs, concurrency))
    return results, time.process_time() - cpu


def run_level(url: str, jobs: list[tuple[list[int], int]], concurrency: int,
              num_processes: int | None = None) -> dict:
    """Run `jobs` (prompt token ids, max_tokens) with `concurrency` streams in flight at a time."""
    if num_processes is None:
        num_processes = max(1, min(os.cpu_count() or 1, -(-concurrency // STREAMS_PER_PROCESS)))
    num_processes = min(num_processes, concurrency)
    # Process p takes every num_processes-th job and its share of the concurrency.
    shares = [(jobs[p::num_processes], concurrency // num_processes + (p < concurrency % num_processes))
              for p in range(num_processes)]
    with ProcessPoolExecutor(num_processes) as pool:
        list(pool.map(int, range(num_processes)))  # start every process before the clock starts
        futures = [pool.submit(_process_main, url, share, c) for share, c in shares]
        outs = [f.result() for f in futures]
    results = [r for rs, _ in outs for r in rs]
    elapsed = max(r["end"] for r in results) - min(r["start"] for r in results)
    itl = sorted(g for r in results for g in r["itl"])
    ttft = sorted(r["ttft"] for r in results)
    pct = lambda xs, q: xs[min(len(xs) - 1, int(q * len(xs)))] * 1000 if xs else 0.0  # noqa: E731
    num_tokens = sum(r["tokens"] for r in results)
    return {"clients": concurrency, "requests": len(jobs), "ttft_p50_ms": pct(ttft, 0.5),
            "ttft_p99_ms": pct(ttft, 0.99), "itl_p50_ms": pct(itl, 0.5), "itl_p99_ms": pct(itl, 0.99),
            "itl_mean_ms": statistics.fmean(itl) * 1000 if itl else 0.0, "tokens": num_tokens,
            "output_tok_s": num_tokens / elapsed, "seconds": elapsed,
            # Above 1 when the server merged steps into one event (its handlers were behind).
            "tokens_per_event": num_tokens / sum(r["events"] for r in results),
            "client_processes": num_processes, "client_cpu_s": sum(cpu for _, cpu in outs)}
