"""Throughput on the classic workload: random prompt token ids (100..max-input long), random output
lengths (100..max-output), temperature 0.6, ignore_eos; one warm-up generate, then the timed one.

    python bench.py [--model PATH] [--num-seqs 256] [--max-input-len 1024] [--max-output-len 1024]
    python bench.py --model configs/Qwen3-0.6B --load-format dummy   # random weights from config.json
    python bench.py ... -dp 2                                        # two replicas (nanovllm.dp)

`make_workload` is the workload, for other scripts (scripts/dp_check.py) to reuse.
"""

import argparse
import os
import time
from random import randint, seed

from nanovllm import LLM, SamplingParams


def make_workload(num_seqs: int, vocab: int, min_len: int = 100, max_input_len: int = 1024,
                  max_output_len: int = 1024) -> tuple[list[list[int]], list[SamplingParams]]:
    """The benchmark's prompts and sampling params; the same for the same arguments (seeded)."""
    seed(0)
    prompt_token_ids = [[randint(0, vocab - 1) for _ in range(randint(min_len, max_input_len))]
                        for _ in range(num_seqs)]
    sampling_params = [SamplingParams(temperature=0.6, ignore_eos=True,
                                      max_tokens=randint(min_len, max_output_len))
                       for _ in range(num_seqs)]
    return prompt_token_ids, sampling_params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="~/huggingface/Qwen3-0.6B/")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--max-input-len", type=int, default=1024)
    parser.add_argument("--max-output-len", type=int, default=1024)
    parser.add_argument("--min-len", type=int, default=100, help="shortest prompt and output")
    parser.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"],
                        help="dummy: random weights, needs only config.json")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--data-parallel-size", "-dp", type=int, default=1)
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--max-num-seqs", type=int, default=512)
    parser.add_argument("--kvcache-block-size", type=int, default=256)
    args = parser.parse_args()

    llm = LLM(os.path.expanduser(args.model), load_format=args.load_format, enforce_eager=args.enforce_eager,
              tensor_parallel_size=args.tensor_parallel_size, data_parallel_size=args.data_parallel_size,
              attention_backend=args.attention_backend,
              max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
              max_num_seqs=args.max_num_seqs, kvcache_block_size=args.kvcache_block_size,
              skip_tokenizer_init=args.load_format == "dummy")
    vocab = min(llm.config.hf_config.vocab_size, 10000)
    prompt_token_ids, sampling_params = make_workload(args.num_seqs, vocab, args.min_len, args.max_input_len,
                                                      args.max_output_len)

    # One warm-up request per replica (the split gives each one of them).
    warm_up = ["Benchmark: "] if llm.tokenizer else [[1, 2, 3]]
    llm.generate(warm_up * args.data_parallel_size, SamplingParams(), use_tqdm=False)
    start = time.perf_counter()
    llm.generate(prompt_token_ids, sampling_params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    total = sum(sp.max_tokens for sp in sampling_params)
    print(f"Total: {total}tok, Time: {elapsed:.2f}s, Throughput: {total / elapsed:.2f}tok/s")


if __name__ == "__main__":
    main()
