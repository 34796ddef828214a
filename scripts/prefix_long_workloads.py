"""Two workloads beside bench.py's, for any engine with nano-vllm's API, so that upstream runs them too
(put the engine's package first on PYTHONPATH; LABEL names it in the output, MODEL is the weights folder,
SCALE < 1 shrinks every size for a quick check on CPU):

  shared prefix: 512 requests = one 2,048-token system prompt + 64..256 tokens of their own, 64..256 out;
  long prompts:  32 requests of 6,000..8,000 tokens, 128 out.

Temperature 0.6 and ignore_eos, as peer_variants.py. Extra LLM options as KEY=VALUE arguments:

    LABEL=project PYTHONPATH=. python3 scripts/prefix_long_workloads.py [attention_backend=fa3]"""

import os
import sys
import time
from random import randint, seed

from nanovllm import LLM, SamplingParams

LABEL = os.environ.get("LABEL", "upstream")
MODEL = os.environ.get("MODEL", "/tmp/qwen3-0.6b")
SCALE = float(os.environ.get("SCALE", "1"))


def scaled(size: int) -> int:
    return max(1, int(size * SCALE))


def timed(llm, prompts, params) -> float:
    start = time.time()
    llm.generate(prompts, params, use_tqdm=False)
    return time.time() - start


def shared_prefix_workload() -> tuple[list[list[int]], list[SamplingParams]]:
    """512 requests: one 2,048-token system prompt + 64..256 tokens of their own, 64..256 out."""
    seed(2)
    system = [randint(0, 10000) for _ in range(scaled(2048))]
    prompts = [system + [randint(0, 10000) for _ in range(randint(scaled(64), scaled(256)))]
               for _ in range(scaled(512))]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=randint(scaled(64), scaled(256)))
              for _ in prompts]
    return prompts, params


def long_prompts_workload() -> tuple[list[list[int]], list[SamplingParams]]:
    """32 requests of 6,000..8,000 tokens, 128 out."""
    seed(3)
    prompts = [[randint(0, 10000) for _ in range(randint(scaled(6000), scaled(8000)))]
               for _ in range(scaled(32))]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=scaled(128)) for _ in prompts]
    return prompts, params


def make_llm(**options) -> LLM:
    """The engine both workloads run on (max_model_len fits the long prompts), warmed up."""
    llm = LLM(MODEL, enforce_eager=False, max_model_len=scaled(8192) + scaled(256), **options)
    llm.generate([[1, 2, 3]], SamplingParams(temperature=0.6, max_tokens=8), use_tqdm=False)
    return llm


def main() -> None:
    if any(arg in ("-h", "--help") for arg in sys.argv[1:]):
        print(__doc__)
        return
    if bad := [arg for arg in sys.argv[1:] if "=" not in arg]:
        sys.exit(f"extra LLM options are KEY=VALUE arguments; got {bad}")
    llm = make_llm(**dict(arg.split("=", 1) for arg in sys.argv[1:]))
    prompts, params = shared_prefix_workload()
    seconds = timed(llm, prompts, params)
    tokens_in, tokens_out = sum(map(len, prompts)), sum(p.max_tokens for p in params)
    print(f"{LABEL} shared prefix: {len(prompts)} reqs, {tokens_in} in + {tokens_out} out tok in "
          f"{seconds:.2f}s -> {tokens_out / seconds:.1f} out tok/s, "
          f"{(tokens_in + tokens_out) / seconds:.1f} total tok/s")

    prompts, params = long_prompts_workload()
    seconds = timed(llm, prompts, params)
    tokens_in, tokens_out = sum(map(len, prompts)), sum(p.max_tokens for p in params)
    print(f"{LABEL} long prompts: {len(prompts)} reqs, {tokens_in} in + {tokens_out} out tok in "
          f"{seconds:.2f}s -> {(tokens_in + tokens_out) / seconds:.1f} total tok/s")


if __name__ == "__main__":
    main()
