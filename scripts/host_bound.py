"""Is a decode loop waiting on the host? (GPU) Under overlap scheduling the host builds and launches step
n+1 while the device runs step n, then waits for step n's sampled ids: the one sync of a step
(runner/step_output.py). When the host's own work takes longer than the device's step, that wait is ~0
and the device idles instead. This script times each wait and prints, per run: ms per token of a stream
(prefill included), the host's time per step (wall time less the waits), and the share of steps whose
wait was under 20 us (host-bound). docs/performance-notes.md, "Host overhead", has what it found.

    python scripts/host_bound.py [--streams 1] [--prompt-len 512] [--max-tokens 1024] [--runs 3]
                                 [--model configs/Qwen3-0.6B --load-format dummy] [--max-model-len 4096]

The workload is peer_variants.py's single stream (random prompts, temperature 0.6, ignore_eos), with
--streams prompts at once; random Qwen3-0.6B weights unless --model names a checkpoint and
--load-format auto."""

import argparse
import os
import sys
import time
from random import randint, seed

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.runner.transfers import PendingOutput  # noqa: E402

CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "Qwen3-0.6B")
HOST_BOUND_WAIT_S = 20e-6


def time_waits(waits: list[float]) -> None:
    """Record how long each step's wait blocks on its event (this process's engines)."""
    plain_wait = PendingOutput.wait

    def wait(self):
        start = time.perf_counter()
        if self._event is not None:
            self._event.synchronize()
        waits.append(time.perf_counter() - start)
        return plain_wait(self)

    PendingOutput.wait = wait


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=CONFIG)
    parser.add_argument("--load-format", default="dummy", help="dummy: random weights from config.json (as "
                        "bench.py's --load-format); auto: the checkpoint's")
    parser.add_argument("--streams", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=1024)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("it times the host against the device's steps: run it on a CUDA GPU")
    llm = LLM(args.model, max_model_len=args.max_model_len, load_format=args.load_format,
              skip_tokenizer_init=True)  # the prompts are token ids
    waits: list[float] = []
    time_waits(waits)
    seed(1)
    prompts = [[randint(0, 10000) for _ in range(args.prompt_len)] for _ in range(args.streams)]
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=args.max_tokens)
    llm.generate(prompts, params, use_tqdm=False)  # warm: the timed runs meet nothing new
    for run in range(args.runs):
        waits.clear()
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        steps = len(waits)
        host_bound = sum(w < HOST_BOUND_WAIT_S for w in waits) / steps
        print(f"run {run}: {wall / args.max_tokens * 1e3:.3f} ms per token of a stream, {steps} steps; host "
              f"{(wall - sum(waits)) / steps * 1e6:.0f} us a step, waits {sum(waits) / steps * 1e6:.0f} us a "
              f"step; {host_bound:.0%} of steps host-bound (wait under {HOST_BOUND_WAIT_S * 1e6:.0f} us)")


if __name__ == "__main__":
    main()
