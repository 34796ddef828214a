"""The physical floor of bench.py's workload on one GPU: the fewest seconds any engine could take, from
the model's shape (config.json) and the GPU's bandwidth and tensor-core peak alone. No model runs.

    python scripts/bench_floor.py --model configs/Qwen3-8B [--quantization fp8] [--kv-cache-dtype fp8]
    python scripts/bench_floor.py --model configs/Qwen3-8B --bandwidth 3.35   # an H100 SXM (same peaks)

The model of the run (the same requests as bench.py draws them, all of them resident at once, as the
KV cache holds them on an H200):
- prefill: every prompt token through every layer, the LM head once a request; its time is its
  FLOPs at the tensor cores' dense peak, or its bytes (the weights once, the K/V written), the larger;
- decode, one step per output token after the first, every unfinished request a row: a step reads the
  attention and dense weights and the LM head once, each expert some row routes to (an MoE routes
  uniformly at random weights: E * (1 - (1 - k/E)^rows) experts), and the K/V of every row's context;
  its time is the larger of its bytes at the bandwidth and its FLOPs at the peak.
The floor is their sum; tokens per second are bench.py's output tokens over it. It ignores everything
an engine adds on top (kernel launches, sampling, norms, activations, the host), so a real run reaches
a fraction of it. fp8 weights (--quantization fp8) read one byte a weight and compute at fp8's peak;
the LM head stays bf16, as in the engine."""

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import make_workload  # noqa: E402  (the repository's bench.py: the same requests)

# One H200 (SXM): HBM3e at the copy bandwidth the benchmarks' other floors use, and the spec sheet's dense
# tensor-core peaks. scripts/fp8_gemm_bench.py's lower 790 / 1,580 would raise the prefill's part (Qwen3-8B:
# 2.0 -> 2.5 s); decode here is bound by bytes either way.
BANDWIDTH = 4.3e12
PEAK_FLOPS = {2: 989e12, 1: 1979e12}  # by weight bytes: bf16, fp8
KV_BYTES = {"auto": 2, "fp8": 1, "int8": 1}
INT8_SCALE_BYTES = 4  # the int8 cache's float32 scale per (token, KV head, K or V)


class Shape:
    """What a decode row or a prompt token costs, from config.json."""

    def __init__(self, config: dict, weight_bytes: int, kv_cache_dtype: str) -> None:
        hidden, layers = config["hidden_size"], config["num_hidden_layers"]
        heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
        head_dim = config.get("head_dim") or hidden // heads
        attention = hidden * head_dim * (2 * heads + 2 * kv_heads)  # q, k, v, o
        self.experts = config.get("num_experts") or 0
        self.top_k = self.expert = 0
        if self.experts:
            self.top_k = config["num_experts_per_tok"]
            self.expert = 3 * hidden * config["moe_intermediate_size"]  # gate, up, down
            dense = hidden * self.experts  # the router
            active = dense + self.top_k * self.expert
        else:
            dense = active = 3 * hidden * config["intermediate_size"]
        self.layers = layers
        self.dense_params = layers * (attention + dense)  # read every step
        self.active_params = layers * (attention + active)  # a token's share of the FLOPs
        self.head_params = hidden * config["vocab_size"]
        self.weight_bytes = weight_bytes
        self.kv_per_token = layers * 2 * kv_heads * (head_dim * KV_BYTES[kv_cache_dtype]
                                                     + (INT8_SCALE_BYTES if kv_cache_dtype == "int8" else 0))
        self.attention_flops = 4 * layers * heads * head_dim  # a query against one context token
        self.peak = PEAK_FLOPS[weight_bytes]

    def experts_read(self, rows: np.ndarray) -> np.ndarray:
        if not self.experts:
            return np.zeros_like(rows, dtype=float)
        return self.experts * (1 - (1 - self.top_k / self.experts) ** rows)

    def step_bytes(self, rows: np.ndarray, context: np.ndarray) -> np.ndarray:
        params = self.dense_params + self.layers * self.experts_read(rows) * self.expert
        return params * self.weight_bytes + 2 * self.head_params + context * self.kv_per_token

    def step_flops(self, rows: np.ndarray, context: np.ndarray) -> np.ndarray:
        return 2 * rows * (self.active_params + self.head_params) + self.attention_flops * context


def floor(shape: Shape, prompt_lens: np.ndarray, output_lens: np.ndarray, bandwidth: float = BANDWIDTH
          ) -> dict[str, float]:
    """Seconds of the prefill and of the decode steps (their memory- and compute-bound parts), the bytes
    moved at `bandwidth` (bytes/s)."""
    prefill_flops = (2 * shape.active_params * prompt_lens.sum() + 2 * shape.head_params * len(prompt_lens)
                     + shape.attention_flops * (prompt_lens * (prompt_lens + 1) / 2).sum())
    all_weights = shape.dense_params + shape.layers * shape.experts * shape.expert
    prefill_bytes = all_weights * shape.weight_bytes + prompt_lens.sum() * shape.kv_per_token
    prefill = max(prefill_flops / shape.peak, prefill_bytes / bandwidth)
    # Decode step s (from 0) computes token s + 2 of every request with more than s + 1 output tokens,
    # against a context of its prompt and its s + 1 tokens so far.
    steps = np.arange(output_lens.max() - 1)
    live = output_lens[None, :] - 1 > steps[:, None]  # [steps, requests]
    rows = live.sum(axis=1)
    context = (live * (prompt_lens[None, :] + steps[:, None] + 1)).sum(axis=1)
    memory = shape.step_bytes(rows, context) / bandwidth
    compute = shape.step_flops(rows, context) / shape.peak
    return {"prefill": prefill, "decode": float(np.maximum(memory, compute).sum()),
            "decode, memory-bound steps": float(memory[memory >= compute].sum()),
            "decode, compute-bound steps": float(compute[compute > memory].sum())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a folder with config.json")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--quantization", choices=["fp8"], default=None, help="fp8 weights")
    parser.add_argument("--kv-cache-dtype", choices=sorted(KV_BYTES), default="auto")
    parser.add_argument("--bandwidth", type=float, default=BANDWIDTH / 1e12,
                        help="TB/s (the H200's copy bandwidth; an H100 SXM: 3.35)")
    args = parser.parse_args()
    with open(os.path.join(os.path.expanduser(args.model), "config.json")) as f:
        config = json.load(f)
    shape = Shape(config, 1 if args.quantization == "fp8" else 2, args.kv_cache_dtype)
    prompts, params = make_workload(args.num_seqs, config["vocab_size"])
    prompt_lens = np.array([len(p) for p in prompts])
    output_lens = np.array([p.max_tokens for p in params])
    parts = floor(shape, prompt_lens, output_lens, args.bandwidth * 1e12)
    total = parts["prefill"] + parts["decode"]
    for name, seconds in parts.items():
        print(f"{name}: {seconds:.3f} s")
    tokens = output_lens.sum()
    print(f"floor: {total:.3f} s for {tokens:,} output tokens -> {tokens / total:,.0f} tok/s")


if __name__ == "__main__":
    main()
