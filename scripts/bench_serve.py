"""Serving benchmark: N concurrent streaming clients (N = 1, 16, 64, 256) against a real
`nanovllm serve` on bench.py's workload (random token-id prompts of 100..1024 tokens, 100..1024
output tokens, temperature 0.6, ignore_eos), over the OpenAI completions API with token-id prompts.
Reports time to first token, inter-token latency (p50/p99) and output tok/s per N, next to
bench.py's offline figure on the same model. The N = 256 run is bench.py's exact workload.

    python scripts/bench_serve.py                              # configs/Qwen3-0.6B, dummy weights
    python scripts/bench_serve.py --model ~/huggingface/Qwen3-0.6B/ --load-format auto

Starts the server itself (then bench.py, one process on the GPU at a time); ~3 minutes on an H200."""

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import time
from random import randint, seed

import httpx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests", "serve"))
from server_process import Server  # noqa: E402

# Requests per concurrency level: enough for a steady state, few enough to stay within minutes.
NUM_REQUESTS = {1: 4, 16: 32, 64: 128, 256: 256}


def workload(num_seqs: int, vocab: int, min_len: int, max_input_len: int,
             max_output_len: int) -> list[tuple[list[int], int]]:
    """bench.py's workload, drawn the same way from the same seed."""
    seed(0)
    prompts = [[randint(0, vocab) for _ in range(randint(min_len, max_input_len))] for _ in range(num_seqs)]
    return [(p, randint(min_len, max_output_len)) for p in prompts]


async def one_request(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.6, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    start = time.perf_counter()
    arrivals: list[tuple[float, int]] = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            choices = json.loads(line[6:])["choices"]
            if choices and choices[0].get("token_ids"):
                arrivals.append((time.perf_counter(), len(choices[0]["token_ids"])))
    num_tokens = sum(n for _, n in arrivals)
    assert num_tokens == max_tokens, f"got {num_tokens} tokens, asked for {max_tokens}"
    gaps = [(b[0] - a[0]) / b[1] for a, b in zip(arrivals, arrivals[1:])]  # per token
    return {"ttft": arrivals[0][0] - start, "itl": gaps, "tokens": num_tokens}


async def run_level(url: str, jobs: list[tuple[list[int], int]], concurrency: int) -> dict:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    semaphore = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=None) as client:
        async def limited(job):
            async with semaphore:
                return await one_request(client, url, *job)
        start = time.perf_counter()
        results = await asyncio.gather(*(limited(job) for job in jobs))
        elapsed = time.perf_counter() - start
    itl = sorted(g for r in results for g in r["itl"])
    ttft = sorted(r["ttft"] for r in results)
    pct = lambda xs, q: xs[min(len(xs) - 1, int(q * len(xs)))] * 1000  # noqa: E731
    return {"clients": concurrency, "requests": len(jobs), "ttft_p50_ms": pct(ttft, 0.5),
            "ttft_p99_ms": pct(ttft, 0.99), "itl_p50_ms": pct(itl, 0.5), "itl_p99_ms": pct(itl, 0.99),
            "itl_mean_ms": statistics.fmean(itl) * 1000 if itl else 0.0,
            "output_tok_s": sum(r["tokens"] for r in results) / elapsed, "seconds": elapsed}


def offline_figure(args) -> float | None:
    cmd = [sys.executable, os.path.join(REPO, "bench.py"), "--model", args.model,
           "--load-format", args.load_format, "--min-len", str(args.min_len),
           "--max-input-len", str(args.max_input_len), "--max-output-len", str(args.max_output_len)]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    match = re.search(r"Throughput: ([\d.]+)tok/s", result.stdout)
    if match is None:
        print(f"bench.py failed:\n{result.stdout}\n{result.stderr}", file=sys.stderr)
        return None
    return float(match.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="configs/Qwen3-0.6B")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--clients", type=int, nargs="+", default=list(NUM_REQUESTS))
    parser.add_argument("--skip-offline", action="store_true")
    parser.add_argument("--max-input-len", type=int, default=1024)
    parser.add_argument("--max-output-len", type=int, default=1024)
    parser.add_argument("--min-len", type=int, default=100, help="shortest prompt and output")
    args = parser.parse_args()

    offline = None if args.skip_offline else offline_figure(args)
    options = ["--load-format", args.load_format]
    if args.load_format == "dummy":
        options.append("--skip-tokenizer-init")  # as bench.py: dummy weights come without a tokenizer
    server = Server(args.model, *options, api_key=None, startup_timeout=600, log_level="warning",
                    cpu=False)
    try:
        from transformers import AutoConfig
        vocab = min(AutoConfig.from_pretrained(args.model).vocab_size, 10000)
        jobs = workload(max(NUM_REQUESTS.get(n, n) for n in args.clients), vocab, args.min_len,
                        args.max_input_len, args.max_output_len)
        asyncio.run(run_level(server.url, [([1, 2, 3], 8)], 1))  # warm-up
        rows = [asyncio.run(run_level(server.url, jobs[:NUM_REQUESTS.get(n, n)], n)) for n in args.clients]
    finally:
        server.terminate()
    print(json.dumps({"offline_tok_s": offline, "levels": rows}, indent=1))
    print(f"\n{'clients':>7} {'reqs':>5} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} "
          f"{'out tok/s':>10}")
    for r in rows:
        print(f"{r['clients']:>7} {r['requests']:>5} {r['ttft_p50_ms']:>7.0f}ms {r['ttft_p99_ms']:>7.0f}ms "
              f"{r['itl_p50_ms']:>6.1f}ms {r['itl_p99_ms']:>6.1f}ms {r['output_tok_s']:>10.0f}")
    if offline:
        last = rows[-1]
        print(f"offline bench.py: {offline:.0f} tok/s; server at N={last['clients']}: "
              f"{last['output_tok_s'] / offline:.1%} of it")


if __name__ == "__main__":
    main()
