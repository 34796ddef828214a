"""Data-parallel figures for a 2-GPU host: bench.py's workload at twice its requests (512), run as
one engine (DP=1), two replicas (DP=2) and one engine over both GPUs (TP=2), on random ("dummy")
weights built from configs/*/config.json. Prints a table; target: DP=2 >= 1.8x DP=1's tok/s.

    python scripts/dp_check.py                                   # 0.6B: DP=1, DP=2, TP=2; 8B: DP=2, TP=2
    python scripts/dp_check.py --models configs/Qwen3-0.6B       # one model
    python scripts/dp_check.py --num-seqs 128                    # a quicker look
    CUDA_VISIBLE_DEVICES= python scripts/dp_check.py --models PATH --num-seqs 8 --min-len 10 \
        --max-input-len 50 --max-output-len 50                   # a smoke test on the CPU

Each row runs in a fresh process, so that no engine inherits another's GPU memory or CUDA state.
Timed: the generate of the whole workload, after one warm-up request per replica (as bench.py)."""

import argparse
import json
import os
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run from a checkout: this tree's nanovllm and bench.py

# (data_parallel_size, tensor_parallel_size) per model; DP=1 on one GPU is the 0.6B baseline.
LAYOUTS = {"Qwen3-0.6B": [(1, 1), (2, 1), (1, 2)], "Qwen3-8B": [(2, 1), (1, 2)]}
DEFAULT_LAYOUTS = [(2, 1), (1, 2)]
# A row that takes longer than this is reported as timed out (the whole script targets < 8 minutes).
ROW_TIMEOUT_S = 300
RESULT_PREFIX = "DP_CHECK_RESULT "


def run_row(model: str, dp: int, tp: int, workload: list[int]) -> dict:
    """In this process: build the engine, warm it up, time the workload; returns the figures."""
    from bench import make_workload
    from nanovllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model, load_format="dummy", skip_tokenizer_init=True, data_parallel_size=dp,
              tensor_parallel_size=tp)
    vocab = min(llm.config.hf_config.vocab_size, 10000)
    prompts, params = make_workload(workload[0], vocab, *workload[1:])
    llm.generate([[1, 2, 3]] * dp, SamplingParams(), use_tqdm=False)  # one warm-up request per replica
    ready = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - ready
    llm.shutdown()
    num_tokens = sum(p.max_tokens for p in params)
    return {"startup_s": ready - start, "generate_s": elapsed, "tok_s": num_tokens / elapsed,
            "num_tokens": num_tokens, "shutdown_s": time.perf_counter() - ready - elapsed}


def spawn_row(model: str, dp: int, tp: int, workload: list[int]) -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--row", json.dumps([model, dp, tp, workload])]
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=ROW_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {ROW_TIMEOUT_S}s"}
    for line in done.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    return {"error": f"exit code {done.returncode}: {done.stderr.strip().splitlines()[-1:]}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["configs/Qwen3-0.6B", "configs/Qwen3-8B"])
    parser.add_argument("--num-seqs", type=int, default=512, help="bench.py's 256 requests, twice")
    parser.add_argument("--min-len", type=int, default=100, help="as bench.py")
    parser.add_argument("--max-input-len", type=int, default=1024, help="as bench.py")
    parser.add_argument("--max-output-len", type=int, default=1024, help="as bench.py")
    parser.add_argument("--row", help=argparse.SUPPRESS)  # internal: one row, in a fresh process
    args = parser.parse_args()
    if torch.cuda.device_count() < 2:
        parser.error(f"DP=2 and TP=2 need 2 CUDA GPUs; {torch.cuda.device_count()} visible here")
    if args.row:
        print(RESULT_PREFIX + json.dumps(run_row(*json.loads(args.row))), flush=True)
        return
    workload = [args.num_seqs, args.min_len, args.max_input_len, args.max_output_len]

    columns = f"{'model':<12} {'layout':<11} {'GPUs':>4} {'startup s':>9} {'generate s':>10} {'tok/s':>9}"
    print(f"{columns} {'vs DP=1':>7}", flush=True)
    print("-" * (len(columns) + 8), flush=True)
    began = time.perf_counter()
    for model in args.models:
        name = os.path.basename(os.path.normpath(model))
        tok_s: dict[tuple[int, int], float] = {}
        for dp, tp in LAYOUTS.get(name, DEFAULT_LAYOUTS):
            row = spawn_row(os.path.join(ROOT, model), dp, tp, workload)
            layout = f"DP={dp} TP={tp}"
            if "error" in row:
                print(f"{name:<12} {layout:<11} {dp * tp:>4}  {row['error']}", flush=True)
                continue
            tok_s[dp, tp] = row["tok_s"]
            ratio = f"{row['tok_s'] / tok_s[1, 1]:.2f}x" if (1, 1) in tok_s else "-"
            print(f"{name:<12} {layout:<11} {dp * tp:>4} {row['startup_s']:>9.1f} {row['generate_s']:>10.2f} "
                  f"{row['tok_s']:>9.0f} {ratio:>7}", flush=True)
        if (2, 1) in tok_s and (1, 2) in tok_s:
            print(f"{name:<12} DP=2 / TP=2 throughput: {tok_s[2, 1] / tok_s[1, 2]:.2f}x", flush=True)
    print(f"\n{args.num_seqs} requests of bench.py's workload, random weights, dtype auto; "
          f"total {time.perf_counter() - began:.0f}s", flush=True)

if __name__ == "__main__":
    main()
