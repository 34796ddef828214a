"""Single-stream decode speed on the CPU under each thread setting, for choosing `cpu_threads`.

    python scripts/cpu_threads_bench.py [--model PATH] [--settings default 1 auto] [--repeats 3]
    python scripts/cpu_threads_bench.py --busy 1      # with one competing busy process

Builds one LLM, then for each setting (torch's default thread count, a fixed count, or "auto")
decodes --tokens greedy tokens from a short prompt, --repeats times, interleaved; prints the median
decode tok/s per setting and the load average. --busy N starts N busy-looping processes for the run
(and stops them at the end)."""

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.utils.cpu_threads import CpuThreadPolicy, num_cores  # noqa: E402
from nanovllm.utils.embedded_model import embedded_model_path  # noqa: E402


def decode_tok_s(llm: LLM, num_tokens: int) -> float:
    """Decode tokens per second of one greedy request (prefill excluded)."""
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    llm.add_request("The history of the printing press", params)
    decode_s, decoded = 0.0, 0
    while not llm.is_finished():
        start = time.perf_counter()
        _, num = llm.step()
        if num < 0:
            decode_s += time.perf_counter() - start
            decoded += -num
    return decoded / decode_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=embedded_model_path())
    parser.add_argument("--settings", nargs="+", default=["default", "1", "auto"])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--busy", type=int, default=0, help="busy-looping processes to run beside")
    args = parser.parse_args()

    llm = LLM(args.model, max_num_seqs=1, max_model_len=256, kvcache_block_size=16)
    runner = llm.engine.executor
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        time.sleep(3 if busy else 0)  # let "auto" see them (it looks every REEVALUATE_S)
        results: dict[str, list[float]] = {s: [] for s in args.settings}
        policies = {s: None if s == "default" else CpuThreadPolicy(int(s) if s.isdigit() else s)
                    for s in args.settings}
        for _ in range(args.repeats):
            for setting in args.settings:
                runner.cpu_threads = policies[setting]
                if setting == "default":
                    torch.set_num_threads(num_cores())
                results[setting].append(decode_tok_s(llm, args.tokens))
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
    print(f"cores {num_cores()}, busy processes {args.busy}, load average {os.getloadavg()[0]:.2f}")
    for setting, values in results.items():
        extra = f" (threads now {policies[setting].num_threads})" if policies[setting] else ""
        print(f"{setting:>8}: median {statistics.median(values):6.1f} tok/s  "
              f"runs {' '.join(f'{v:.1f}' for v in values)}{extra}")


if __name__ == "__main__":
    main()
