"""What the vLLM sampling options cost on a GPU: bench.py's workload (random prompts, temperature 0.6,
ignore_eos) once plain and once per option, on one engine; prints a table of output tok/s and the
slowdown against plain. Each row is a separate timed generate after one shared warm-up.

    python scripts/sampling_bench.py --model configs/Qwen3-0.6B --load-format dummy   # ~4 min on an H200
"""

import argparse
import os
import time
from random import randint, seed

import torch

from nanovllm import LLM, SamplingParams

VARIANTS = {
    "plain": {},
    "logprobs=5": {"logprobs": 5},
    "top_p=0.9": {"top_p": 0.9},
    "min_p=0.05": {"min_p": 0.05},
    "penalties": {"repetition_penalty": 1.1, "frequency_penalty": 0.2, "presence_penalty": 0.2},
    "logit_bias+min_tokens": {"logit_bias": {0: -5.0, 1: 2.0}, "min_tokens": 16},
    "prompt_logprobs=1": {"prompt_logprobs": 1},
    "n=4 (1/4 the prompts)": {"n": 4},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="configs/Qwen3-0.6B")
    parser.add_argument("--load-format", default="dummy", choices=["auto", "safetensors", "dummy"])
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--max-input-len", type=int, default=1024)
    parser.add_argument("--max-output-len", type=int, default=512)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("it times bench.py's workload per sampling option: run it on a CUDA GPU")

    seed(0)
    llm = LLM(os.path.expanduser(args.model), load_format=args.load_format,
              skip_tokenizer_init=args.load_format == "dummy", max_model_len=4096)
    vocab = min(llm.config.hf_config.vocab_size, 10000)
    prompts = [[randint(0, vocab - 1) for _ in range(randint(100, args.max_input_len))]
               for _ in range(args.num_seqs)]
    max_tokens = [randint(100, args.max_output_len) for _ in range(args.num_seqs)]
    llm.generate([[1, 2, 3]], SamplingParams(), use_tqdm=False)

    print(f"{'variant':<26}{'out tok/s':>12}{'vs plain':>10}")
    plain_rate = None
    for name, options in VARIANTS.items():
        n = options.get("n", 1)
        batch = list(zip(prompts, max_tokens))[:args.num_seqs // n]
        params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m, **options) for _, m in batch]
        start = time.perf_counter()
        llm.generate([p for p, _ in batch], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        rate = sum(m for _, m in batch) * n / elapsed
        plain_rate = plain_rate or rate
        print(f"{name:<26}{rate:>12.0f}{rate / plain_rate:>10.2f}")


if __name__ == "__main__":
    main()
