"""Tensor-parallel check for a multi-GPU host: greedy tokens of TP=N against TP=1 on the same random
("dummy") weights, built from a config.json alone.

    python scripts/tp_check.py                                      # configs/Qwen3-0.6B, TP=2, bf16
    python scripts/tp_check.py --model configs/Qwen3-8B
    python scripts/tp_check.py --dtype float32                      # near-exact agreement expected

Both runs draw the same weights: each full tensor is seeded by its name and sharded by the weight
loaders, so TP=1 and TP=N are one model. In bf16 the all-reduce sums partial products in another
order than one GPU does, which can flip a near-tie between the top two tokens; from there the two
continuations differ. So expect the first tokens to agree and long prefixes to match, not every
token; a sharding bug shows up as disagreement from the very first token. Prints one row per prompt.
"""

import argparse
import faulthandler
import json
import logging
import os
import random
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from nanovllm import LLM, SamplingParams  # noqa: E402

# Print every thread's stack this often (seconds) while the check runs, to show where a stall sits.
STALL_DUMP_S = 90


def model_dir(path: str, init_range: float | None, tmp: str) -> str:
    """The config folder, or a copy whose initializer_range (the dummy weights' std) is overridden."""
    if init_range is None:
        return path
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["initializer_range"] = init_range
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(config, f)
    return tmp


def run(path: str, tp: int, args: argparse.Namespace,
        prompts: list[list[int]]) -> tuple[list[list[int]], float]:
    start = time.perf_counter()
    with LLM(path, tensor_parallel_size=tp, load_format="dummy", skip_tokenizer_init=True, dtype=args.dtype,
             max_model_len=args.max_model_len, enforce_eager=args.enforce_eager, seed=args.seed) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        llm.generate([prompts[0][:8]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up, untimed
        loaded = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        done = time.perf_counter()
    closed = time.perf_counter()  # shutdown must be prompt: NCCL teardown once hung here
    print(f"TP={tp}: start {loaded - start:.1f}s, generate {done - loaded:.2f}s, "
          f"shutdown {closed - done:.1f}s", flush=True)
    return [o["token_ids"] for o in outputs], done - loaded


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def main() -> None:
    # Startup phases of every rank, with timestamps, and all stacks if a run stalls (a TP=2 engine once
    # hung in shutdown on the H200-x2: its CUDA graphs outlived the NCCL communicator).
    logging.basicConfig(level=logging.INFO, format="%(asctime)s [rank 0] %(name)s: %(message)s")
    os.environ.setdefault("NANOVLLM_WORKER_LOG_LEVEL", "INFO")
    faulthandler.dump_traceback_later(STALL_DUMP_S, repeat=True)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="configs/Qwen3-0.6B", help="a folder with config.json")
    parser.add_argument("--tp", type=int, default=2, help="tensor_parallel_size to compare with 1")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--min-prompt-len", type=int, default=16)
    parser.add_argument("--max-prompt-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--init-range", type=float, default=None,
                        help="std of the dummy weights (default: the config's initializer_range); larger "
                             "values give peakier logits and fewer near-ties")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--seed", type=int, default=0, help="seeds the dummy weights and the prompts")
    args = parser.parse_args()
    if torch.cuda.device_count() < args.tp:
        parser.error(f"TP={args.tp} needs {args.tp} CUDA GPUs; {torch.cuda.device_count()} visible here")

    rng = random.Random(args.seed)
    lengths = [rng.randint(args.min_prompt_len, args.max_prompt_len) for _ in range(args.num_prompts)]
    prompts = [[rng.randrange(100, 10000) for _ in range(length)] for length in lengths]
    with tempfile.TemporaryDirectory() as tmp:
        path = model_dir(args.model, args.init_range, tmp)
        reference, ref_time = run(path, 1, args, prompts)
        sharded, tp_time = run(path, args.tp, args, prompts)

    print(f"\n{'prompt':>6} {'len':>5} {'first token':>11} {'same prefix':>11} {'same tokens':>11}")
    prefixes = []
    for i, (ref, out) in enumerate(zip(reference, sharded, strict=True)):
        prefix = common_prefix(ref, out)
        prefixes.append(prefix)
        same = sum(x == y for x, y in zip(ref, out, strict=True))
        print(f"{i:>6} {len(prompts[i]):>5} {'agrees' if prefix > 0 else 'DIFFERS':>11} "
              f"{prefix:>5}/{len(ref):<5} {same:>5}/{len(ref):<5}")
    n, total = len(prefixes), args.max_tokens
    print(f"\n{args.model} {args.dtype}, TP={args.tp} vs TP=1: first token agrees on "
          f"{sum(p > 0 for p in prefixes)}/{n} prompts, identical continuations {prefixes.count(total)}/{n}, "
          f"mean agreeing prefix {sum(prefixes) / n:.1f}/{total} tokens; "
          f"generate {ref_time:.2f}s (TP=1) vs {tp_time:.2f}s (TP={args.tp})")


if __name__ == "__main__":  # required: the TP workers are spawned and re-import this file
    main()
