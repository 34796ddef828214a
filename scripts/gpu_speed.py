"""The speed sections of scripts/gpu_check.py (run them through it: `python scripts/gpu_check.py bench
stream profile`): bench.py's classic workload per GPU backend, the single-stream decode latency, and where
a one-row decode step's GPU time goes. Each adds its figures to the `results` dict it is given."""

import subprocess
import sys
import time

import torch

from nanovllm import LLM, SamplingParams

CONFIG = "configs/Qwen3-0.6B"
GPU_BACKENDS = ("triton", "triton-fa3", "fa3")


def run_bench(results: dict, modes=(False, True)) -> None:
    for backend in GPU_BACKENDS:
        for eager in modes:
            cmd = [
                sys.executable,
                "bench.py",
                "--model",
                CONFIG,
                "--load-format",
                "dummy",
                "--attention-backend",
                backend,
            ] + (["--enforce-eager"] if eager else [])
            start = time.perf_counter()
            out = subprocess.run(cmd, capture_output=True, text=True)
            line = next((x for x in out.stdout.splitlines() if x.startswith("Total:")), out.stderr[-2000:])
            label = f"{backend}/{'eager' if eager else 'graphs'}"
            results.setdefault("bench", {})[label] = dict(
                line=line, wall_s=round(time.perf_counter() - start, 1)
            )
            print(f"bench {label:14s} {line}", flush=True)


def timed(obj, name: str, totals: dict) -> None:
    """Accumulate wall time spent in obj.name (all steps, prefill included: a rough host profile)."""
    inner = getattr(obj, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            totals[name] = totals.get(name, 0.0) + time.perf_counter() - start

    setattr(obj, name, wrapper)


def dummy_llm(backend: str) -> LLM:
    """Random Qwen3-0.6B weights on one backend, leaving the GPU half free for the next engine."""
    return LLM(CONFIG, load_format="dummy", skip_tokenizer_init=True, attention_backend=backend,
               gpu_memory_utilization=0.5)


def run_stream(results: dict) -> None:
    prompt = torch.randint(0, 10000, (512,), generator=torch.Generator().manual_seed(2)).tolist()
    for backend in GPU_BACKENDS:
        for temperature in (0.0, 0.6):
            llm = dummy_llm(backend)
            llm.generate([prompt[:16]], SamplingParams(max_tokens=32), use_tqdm=False)  # warm-up
            llm.add_request(prompt, SamplingParams(temperature=temperature, max_tokens=1024, ignore_eos=True))
            decode_times, parts = [], {}
            timed(llm.engine.scheduler, "schedule", parts)
            timed(llm.engine.executor, "run", parts)
            timed(llm.engine.scheduler, "postprocess", parts)
            while not llm.is_finished():
                start = time.perf_counter()
                _, num_tokens = llm.step()
                if num_tokens < 0:
                    decode_times.append(time.perf_counter() - start)
            ms = 1000 * sum(decode_times) / len(decode_times)
            label = f"{backend}/T={temperature}"
            share = {k: round(1000 * v / len(decode_times), 3) for k, v in parts.items()}
            results.setdefault("stream", {})[label] = dict(
                ms_per_token=round(ms, 3), steps=len(decode_times), ms_per_step_in=share
            )
            print(
                f"stream {label:12s} {ms:.3f} ms/token over {len(decode_times)} decode steps; {share}",
                flush=True,
            )
            llm.shutdown()


def run_profile(results: dict) -> None:
    """Where a single-stream decode step goes, per backend: graph replay time alone, and the kernels of
    one eager decode forward (count and time)."""
    from torch.profiler import ProfilerActivity, profile

    for backend in GPU_BACKENDS:
        llm = dummy_llm(backend)
        llm.generate([list(range(512))], SamplingParams(max_tokens=64, ignore_eos=True), use_tqdm=False)
        graphs = llm.engine.executor.decode_graphs
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(10):
            graphs.graphs[1].replay()
        start.record()
        for _ in range(200):
            graphs.graphs[1].replay()
        end.record()
        torch.cuda.synchronize()
        replay_ms = start.elapsed_time(end) / 200
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            with torch.inference_mode():
                graphs._run_model(1)
            torch.cuda.synchronize()
        events = [e for e in prof.key_averages()]
        num_kernels = sum(e.count for e in events if e.device_type.name == "CUDA")
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
        results.setdefault("profile", {})[backend] = dict(
            graph_replay_ms=round(replay_ms, 3), eager_kernels_per_step=num_kernels
        )
        print(table)
        print(
            f"profile {backend}: graph replay {replay_ms:.3f} ms, {num_kernels} kernels per eager decode "
            "forward",
            flush=True,
        )
        del graphs, prof
        llm.shutdown()
