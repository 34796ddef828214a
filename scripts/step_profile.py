"""Where the time of an offline run goes, step by step (GPU): for each engine step its kind (prefill,
decode or mixed), rows and tokens, the host's scheduling and bookkeeping time, and the model runner's
wall and GPU time; printed as totals per kind and decode step time by batch size.

    python scripts/step_profile.py [--num-seqs 1024] [--attention-backend triton] [extra LLM options]
    python scripts/step_profile.py --model configs/Qwen3-8B --num-seqs 256 --quantization=fp8

The workload is peer_variants.py's larger batch (seed 0, 100..1024 tokens in and out, temperature 0.6,
ignore_eos; with --num-seqs 256, bench.py's requests) on random weights of --model's config (default
Qwen3-0.6B's). It runs the synchronous engine loop (async_scheduling=False): the overlap loop launches
a step before the previous one's tokens are read, so a step's phases do not separate there; tok_s is
that loop's."""

import argparse
import collections
import json
import os
import sys
import time
from random import randint, seed

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nanovllm import LLM, SamplingParams  # noqa: E402

CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "Qwen3-0.6B")


def instrument(llm: LLM, steps: list[dict]) -> None:
    engine, runner = llm.engine, llm.engine.executor
    schedule, run, postprocess = engine.scheduler.schedule, runner.run, engine.scheduler.postprocess
    current: dict = {}

    def timed_schedule():
        start = time.perf_counter()
        seqs, is_prefill = schedule()
        current.clear()
        current.update(schedule_ms=(time.perf_counter() - start) * 1e3, rows=len(seqs),
                       tokens=sum(s.num_scheduled_tokens for s in seqs))
        return seqs, is_prefill

    def timed_run(batch):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start = time.perf_counter()
        begin.record()
        tokens = run(batch)
        end.record()
        end.synchronize()
        q_lens = [b - a for a, b in zip(batch.cu_seqlens_q, batch.cu_seqlens_q[1:])]
        kind = "decode" if not batch.is_prefill else "mixed" if 1 in q_lens else "prefill"
        current.update(run_ms=(time.perf_counter() - start) * 1e3, gpu_ms=begin.elapsed_time(end), kind=kind,
                       kv_tokens=sum(batch.seqlens_k))
        return tokens

    def timed_postprocess(seqs, token_ids):
        start = time.perf_counter()
        finished = postprocess(seqs, token_ids)
        current["postprocess_ms"] = (time.perf_counter() - start) * 1e3
        steps.append(dict(current))
        return finished

    engine.scheduler.schedule, runner.run, engine.scheduler.postprocess = (timed_schedule, timed_run,
                                                                           timed_postprocess)


def summarize(steps: list[dict], wall_s: float, kv_bytes_per_token: int) -> dict:
    by_kind = collections.defaultdict(lambda: collections.Counter())
    for s in steps:
        c = by_kind[s["kind"]]
        c["steps"] += 1
        c["tokens"] += s["tokens"]
        c["rows"] += s["rows"]
        for key in ("schedule_ms", "run_ms", "gpu_ms", "postprocess_ms"):
            c[key] += s[key]
    table = {}
    for kind, c in by_kind.items():
        n = c["steps"]
        table[kind] = dict(steps=n, mean_rows=round(c["rows"] / n, 1), tokens=c["tokens"],
                           total_s=round((c["schedule_ms"] + c["run_ms"] + c["postprocess_ms"]) / 1e3, 2),
                           gpu_s=round(c["gpu_ms"] / 1e3, 2),
                           host_ms_per_step=round((c["schedule_ms"] + c["postprocess_ms"] + c["run_ms"]
                                                   - c["gpu_ms"]) / n, 3),
                           gpu_ms_per_step=round(c["gpu_ms"] / n, 3))
    buckets = collections.defaultdict(list)
    for s in steps:
        if s["kind"] == "decode":
            buckets[min(512, 1 << (s["rows"] - 1).bit_length())].append((s["gpu_ms"], s["kv_tokens"]))
    # Per bucket: steps, mean GPU ms, and the KV cache read per GPU second (GB/s, every layer's K and V).
    decode = {f"<={b}": (len(v), round(sum(ms for ms, _ in v) / len(v), 3),
                         round(sum(kv for _, kv in v) * kv_bytes_per_token / sum(ms for ms, _ in v) / 1e6))
              for b, v in sorted(buckets.items())}
    return dict(wall_s=round(wall_s, 2), kinds=table, decode_gpu_ms_kv_gbps_by_batch=decode)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, default=1024)
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--label", default="")
    parser.add_argument("--model", default=CONFIG, help="a folder with the model's config.json")
    args, extra = parser.parse_known_args()
    if not torch.cuda.is_available():
        parser.error("the model runner's share of each step is timed with CUDA events: run it on a CUDA GPU")
    options = dict(kv.split("=", 1) for kv in extra)
    options = {k.lstrip("-").replace("-", "_"): (int(v) if v.isdigit() else v) for k, v in options.items()}
    llm = LLM(args.model, load_format="dummy", skip_tokenizer_init=True, async_scheduling=False,
              attention_backend=args.attention_backend, **options)
    llm.generate([[1, 2, 3]], SamplingParams(), use_tqdm=False)
    seed(0)
    prompts = [[randint(0, 10000) for _ in range(randint(100, 1024))] for _ in range(args.num_seqs)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=randint(100, 1024))
              for _ in range(args.num_seqs)]
    steps: list[dict] = []
    instrument(llm, steps)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    hf = llm.config.hf_config
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    element_size = torch.empty(0, dtype=llm.engine.executor.kv_dtype).element_size()
    kv_bytes = 2 * hf.num_hidden_layers * hf.num_key_value_heads * head_dim * element_size
    summary = summarize(steps, wall, kv_bytes)
    total = sum(p.max_tokens for p in params)
    summary.update(tok_s=round(total / wall, 1), backend=llm.engine.executor.backend.name,
                   preemptions=llm.engine.scheduler.num_preemptions,
                   kv_blocks=llm.engine.num_kvcache_blocks, label=args.label)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
