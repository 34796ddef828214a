"""Throughput on the classic workload: random prompt token ids (min-len..max-input-len long), random
output lengths (min-len..max-output-len), temperature 0.6, ignore_eos; one warm-up generate, then
the timed one. Prints one line: "Total: ...tok, Time: ...s, Throughput: ...tok/s".

    python bench.py [--model PATH] [--num-seqs 256] [--max-input-len 1024] [--max-output-len 1024]
    python bench.py --model configs/Qwen3-0.6B --load-format dummy   # random weights from config.json
    python bench.py --model model.gguf --num-seqs 8 --max-input-len 64 --max-output-len 64   # on a CPU
    python bench.py ... --quantization fp8 --kv-cache-dtype fp8       # fp8 weights and KV cache
    python bench.py ... -dp 2                                        # two replicas (nanovllm.dp)

The lengths are checked before the model loads: --min-len (default 100) is lowered to the maximum
lengths when they are shorter, and an explicit --min-len above them is an error.
"""

import argparse
import json
import os
import time
from random import randint, seed

from nanovllm import LLM, SamplingParams
from nanovllm.config import VALID_ATTENTION_BACKENDS, VALID_LOAD_FORMATS

# The classic workload's shortest prompt and output, unless --min-len says otherwise.
DEFAULT_MIN_LEN = 100
# Prompt token ids are drawn from the first this-many ids of the vocabulary (as nano-vllm's bench).
MAX_TOKEN_ID = 10000


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written, and each option's default (where it has one)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, with lengths that make sense; a bad combination exits with a usage error
    (status 2) before anything is loaded."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--model", default="~/huggingface/Qwen3-0.6B/",
                        help="a Hugging Face model folder, or a .gguf file")
    parser.add_argument("--num-seqs", type=int, default=256, help="requests in the timed generate")
    parser.add_argument("--max-input-len", type=int, default=1024, help="longest prompt, in tokens")
    parser.add_argument("--max-output-len", type=int, default=1024, help="longest output, in tokens")
    parser.add_argument("--min-len", type=int, default=None,
                        help=f"shortest prompt and output (default {DEFAULT_MIN_LEN}, or the maximum "
                             "lengths when shorter)")
    parser.add_argument("--load-format", default="auto", choices=VALID_LOAD_FORMATS,
                        help="dummy: random weights, needs only config.json; auto: gguf for a .gguf file")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--data-parallel-size", "-dp", type=int, default=1, help="engine replicas")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--attention-backend", default="auto", choices=VALID_ATTENTION_BACKENDS)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--max-num-seqs", type=int, default=None, help="default: the engine's (by the GPU)")
    parser.add_argument("--kvcache-block-size", type=int, default=256)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "int8"],
                        help="fp8: an e4m3 KV cache, twice the tokens of bf16 (Triton backend); int8: int8 "
                             "values with a scale per token and KV head, 3%% more bytes, closer to bf16")
    parser.add_argument("--quantization", default=None, choices=["fp8"],
                        help="fp8: quantize a bf16 checkpoint's linear weights to fp8 at load (per-channel "
                             "scales); an fp8 checkpoint is read as fp8 without it")
    parser.add_argument("--speculative-config", type=json.loads, default=None,
                        help='speculative decoding, as vLLM\'s option: JSON such as \'{"method": "ngram", '
                             '"num_speculative_tokens": 3}\' (README, "Speculative decoding")')
    parser.add_argument("--mixed-batches", action=argparse.BooleanOptionalAction, default=True,
                        help="decode and new prompts in one forward pass (--no-mixed-batches: nano-vllm's "
                             "prefill-first steps)")
    args = parser.parse_args(argv)

    for name in ("num_seqs", "max_input_len", "max_output_len", "min_len"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if args.min_len is None:
        args.min_input_len = min(DEFAULT_MIN_LEN, args.max_input_len)
        args.min_output_len = min(DEFAULT_MIN_LEN, args.max_output_len)
    else:
        shortest_max = min(args.max_input_len, args.max_output_len)
        if args.min_len > shortest_max:
            parser.error(f"--min-len {args.min_len} is above --max-input-len {args.max_input_len} or "
                         f"--max-output-len {args.max_output_len}; lower it or raise them")
        args.min_input_len = args.min_output_len = args.min_len
    if args.max_input_len + args.max_output_len > args.max_model_len:
        parser.error(f"--max-input-len {args.max_input_len} plus --max-output-len {args.max_output_len} "
                     f"exceeds --max-model-len {args.max_model_len}; lower them or raise --max-model-len")
    return args


def make_workload(num_seqs: int, vocab_size: int, min_input_len: int = DEFAULT_MIN_LEN,
                  max_input_len: int = 1024, min_output_len: int = DEFAULT_MIN_LEN,
                  max_output_len: int = 1024) -> tuple[list[list[int]], list[SamplingParams]]:
    """The benchmark's prompts and sampling params; the same for the same arguments (seeded), and for
    the classic arguments the same as nano-vllm's bench.py draws."""
    seed(0)
    # randint is inclusive: the largest id drawn is `vocab`, which must lie inside the vocabulary.
    vocab = min(vocab_size - 1, MAX_TOKEN_ID)
    prompt_token_ids = [[randint(0, vocab) for _ in range(randint(min_input_len, max_input_len))]
                        for _ in range(num_seqs)]
    sampling_params = [SamplingParams(temperature=0.6, ignore_eos=True,
                                      max_tokens=randint(min_output_len, max_output_len))
                       for _ in range(num_seqs)]
    return prompt_token_ids, sampling_params


def main() -> None:
    args = parse_args()
    llm = LLM(os.path.expanduser(args.model), load_format=args.load_format, enforce_eager=args.enforce_eager,
              tensor_parallel_size=args.tensor_parallel_size, data_parallel_size=args.data_parallel_size,
              attention_backend=args.attention_backend,
              max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
              max_num_seqs=args.max_num_seqs, kvcache_block_size=args.kvcache_block_size,
              kv_cache_dtype=args.kv_cache_dtype, mixed_batches=args.mixed_batches,
              quantization=args.quantization, speculative_config=args.speculative_config,
              skip_tokenizer_init=args.load_format == "dummy")
    prompt_token_ids, sampling_params = make_workload(
        args.num_seqs, llm.config.hf_config.vocab_size, args.min_input_len, args.max_input_len,
        args.min_output_len, args.max_output_len)
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
