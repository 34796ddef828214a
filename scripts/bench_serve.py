"""Serving benchmark: N concurrent streaming clients (N = 1, 16, 64, 256) against a real
`nanovllm serve` on bench.py's workload (random token-id prompts of 100..1024 tokens, 100..1024
output tokens, temperature 0.6, ignore_eos), over the OpenAI completions API with token-id prompts.
Reports time to first token, inter-token latency (p50/p99) and output tok/s per N, next to
bench.py's offline figure on the same model. The N = 256 run is bench.py's exact workload.

    python scripts/bench_serve.py                              # configs/Qwen3-0.6B, dummy weights
    python scripts/bench_serve.py --model ~/huggingface/Qwen3-0.6B/ --load-format auto

Starts the server itself (then bench.py, one process on the GPU at a time); ~3 minutes on an H200.
The clients run in several processes with a lean SSE reader (scripts/stream_clients.py): one
Python process with httpx could not read the ~15k events/s of N = 256 and measured itself."""

import argparse
import json
import os
import re
import subprocess
import sys
from random import randint, seed

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests", "serve"))
from server_process import Server  # noqa: E402
from stream_clients import run_level  # noqa: E402

# Requests per concurrency level: enough for a steady state, few enough to stay within minutes.
NUM_REQUESTS = {1: 4, 16: 32, 64: 128, 256: 256}


def workload(num_seqs: int, vocab: int, min_len: int, max_input_len: int,
             max_output_len: int) -> list[tuple[list[int], int]]:
    """bench.py's workload, drawn the same way from the same seed."""
    seed(0)
    prompts = [[randint(0, vocab) for _ in range(randint(min_len, max_input_len))] for _ in range(num_seqs)]
    return [(p, randint(min_len, max_output_len)) for p in prompts]


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
    parser.add_argument("--server-option", action="append", default=[],
                        help="passed to `nanovllm serve`, e.g. --server-option=--stream-interval=4")
    parser.add_argument("--max-input-len", type=int, default=1024)
    parser.add_argument("--max-output-len", type=int, default=1024)
    parser.add_argument("--min-len", type=int, default=100, help="shortest prompt and output")
    args = parser.parse_args()

    offline = None if args.skip_offline else offline_figure(args)
    options = ["--load-format", args.load_format]
    if args.load_format == "dummy":
        options.append("--skip-tokenizer-init")  # as bench.py: dummy weights come without a tokenizer
    options += args.server_option
    server = Server(args.model, *options, api_key=None, startup_timeout=600, log_level="warning",
                    cpu=False)
    try:
        from transformers import AutoConfig
        vocab = min(AutoConfig.from_pretrained(args.model).vocab_size, 10000)
        jobs = workload(max(NUM_REQUESTS.get(n, n) for n in args.clients), vocab, args.min_len,
                        args.max_input_len, args.max_output_len)
        run_level(server.url, [([1, 2, 3], 8)], 1)  # warm-up
        rows = [run_level(server.url, jobs[:NUM_REQUESTS.get(n, n)], n) for n in args.clients]
    finally:
        server.terminate()
    print(json.dumps({"offline_tok_s": offline, "levels": rows}, indent=1))
    print(f"\n{'clients':>7} {'reqs':>5} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} "
          f"{'out tok/s':>10} {'client CPU':>10}")
    for r in rows:
        print(f"{r['clients']:>7} {r['requests']:>5} {r['ttft_p50_ms']:>7.0f}ms {r['ttft_p99_ms']:>7.0f}ms "
              f"{r['itl_p50_ms']:>6.1f}ms {r['itl_p99_ms']:>6.1f}ms {r['output_tok_s']:>10.0f} "
              f"{r['client_cpu_s'] / r['seconds']:>4.1f} cores")
    if offline:
        last = rows[-1]
        print(f"offline bench.py: {offline:.0f} tok/s; server at N={last['clients']}: "
              f"{last['output_tok_s'] / offline:.1%} of it")


if __name__ == "__main__":
    main()
