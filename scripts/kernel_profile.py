"""Which GPU kernels a decode step spends its time in (torch.profiler), at a given decode batch size:
per kernel name its calls per step and microseconds per step, the step's kernel count and total GPU
time, and its wall time per step. Random weights (Qwen3-0.6B's shape, or --model's config folder), CUDA
graphs as in a real run.

    python scripts/kernel_profile.py --batch 1 --batch 256 [--context 512] [--steps 32] [--option=value ...]
    python scripts/kernel_profile.py --mixed [--steps 32]      # mid-run steps of the 1024-request run
    python scripts/kernel_profile.py --model configs/Qwen3-30B-A3B --quantization=fp8 --batch 256 [--host]
    python scripts/kernel_profile.py --prefill 32 [--context 512]   # the prefill of 32 prompts

Each batch size adds `batch` prompts of `context` random tokens, steps the engine past their prefill,
and profiles the next `steps` decode steps (twice: the first pass compiles and captures what it needs).
--prefill N profiles the steps that prefill N prompts of `context` tokens (one generated token each;
chunked under max_num_batched_tokens as a run chunks them), per prefill step.
--mixed runs step_profile.py's 1024-request workload through llm.step() and profiles `steps` steps
from step MIXED_WARM_STEPS on, when running requests finish and waiting ones join (mixed steps); before
the profile, as many steps again are timed by phase on the host (host_phases), mixed and decode apart.
Requests wait only where they outnumber max_num_seqs or the KV cache: on a GPU of 70 GiB or more
max_num_seqs defaults to 1024, all of them run from the start, and these steps are all decode steps
(an H200, 2026-12-02); `--mixed --max-num-seqs=512` profiles admissions mid-run. --host with --batch:
then `steps` more decode steps timed by phase on the host, each step synchronized (is a step's wall time
beyond its device time the host's?)."""

import argparse
import collections
import json
import os
import sys
import time
from random import randint, seed

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nanovllm import LLM, SamplingParams  # noqa: E402

CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "Qwen3-0.6B")
TOP_KERNELS = 15
# By this step of the 1024-request run the first requests finish, and mixed steps admit waiting ones.
MIXED_WARM_STEPS = 300
# The host range each profiled engine step runs in (busy_by_kind files kernels by it).
STEP_RANGE = "engine_step"


def kernel_table(prof, steps: int) -> tuple[list[dict], float, float]:
    """(top kernels, kernels per step, GPU microseconds per step) from a finished profile."""
    calls, micros = collections.Counter(), collections.Counter()
    for event in prof.events():
        # record_function ranges get a device-side twin (STEP_RANGE's spans a whole step): not a kernel.
        if event.device_type == torch.autograd.DeviceType.CUDA and event.name != STEP_RANGE:
            name = event.name[:90]
            calls[name] += 1
            micros[name] += event.device_time
    rows = [dict(kernel=name, calls_per_step=round(calls[name] / steps, 1),
                 us_per_step=round(micros[name] / steps, 1)) for name, _ in micros.most_common(TOP_KERNELS)]
    return rows, sum(calls.values()) / steps, sum(micros.values()) / steps


def host_phases(llm: LLM, steps: int) -> None:
    """Host milliseconds per step in each phase of the synchronous step (schedule, build_batch, the
    forward's input building and launches, sampling launches, the wait for the sampled ids, postprocess),
    for mixed and decode steps apart: whether a slow step waits on the GPU or on the host. With overlap
    scheduling (on by default on a GPU) the step has no run, wait or postprocess phase:
    NANOVLLM_ASYNC_SCHEDULING=0 times the synchronous one."""
    # The step loops call build_batch by the name each imported: wrapped in both.
    import nanovllm.engine.llm_engine as sync_module
    import nanovllm.engine.overlap as overlap_module
    engine, runner = llm.engine, llm.engine.executor
    acc = collections.Counter()

    def timed(owner, name, label):
        fn = getattr(owner, name)

        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                acc[label] += time.perf_counter() - t
        setattr(owner, name, wrapper)

    timed(engine.scheduler, "schedule", "schedule")
    timed(engine.scheduler, "postprocess", "postprocess")
    for module in (overlap_module, sync_module):
        timed(module, "build_batch", "build_batch")
    timed(runner, "_forward", "forward_launch")
    timed(runner.sampler, "sample", "sample_launch")
    timed(runner, "run", "run")
    totals = {"mixed": collections.Counter(), "decode": collections.Counter()}
    counts = collections.Counter()
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(steps):
        acc.clear()
        sync()
        t = time.perf_counter()
        result = engine.step()
        sync()
        acc["step"] = time.perf_counter() - t
        kind = "mixed" if result.num_prefill_tokens else "decode"
        counts[kind] += 1
        totals[kind].update(acc)
    # What every step passes (the sampler's launch not where a decode graph samples itself); a wrapper
    # never reached would make its phase read as free.
    expected = {"schedule", "build_batch", "forward_launch"}
    expected |= {"postprocess", "run"} if engine._overlap is None else set()
    if unseen := expected.difference(*totals.values()):
        raise RuntimeError(f"phases never timed: {sorted(unseen)} (the step calls them by another name now)")
    for kind, total in totals.items():
        if counts[kind]:
            per_step = {k: round(v * 1e3 / counts[kind], 3) for k, v in total.items()}
            if "run" in per_step:
                per_step["wait"] = round(per_step["run"] - per_step.get("forward_launch", 0)
                                         - per_step.get("sample_launch", 0), 3)
            print(json.dumps(dict(host_ms_per_step=kind, steps=counts[kind], **per_step)), flush=True)


def profile_mixed(llm: LLM, steps: int, cprofile: bool = False) -> None:
    seed(0)
    for _ in range(1024):
        prompt = [randint(0, 10000) for _ in range(randint(100, 1024))]
        llm.add_request(prompt, SamplingParams(temperature=0.6, ignore_eos=True,
                                               max_tokens=randint(100, 1024)))
    for _ in range(MIXED_WARM_STEPS):
        llm.step()
    if cprofile:  # where the host time of the phases goes, by Python function
        import cProfile
        import pstats
        with cProfile.Profile() as prof:
            host_phases(llm, steps)
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
    else:
        host_phases(llm, steps)
    kinds, order = collections.Counter(), []
    torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            with record_function(STEP_RANGE):
                _, num_tokens = llm.step()
            order.append("mixed" if num_tokens > 0 else "decode")
            kinds[order[-1]] += 1
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    rows, kernels, gpu_us = kernel_table(prof, steps)
    print(json.dumps(dict(mixed_run=dict(kinds), wall_ms_per_step=round(wall * 1e3 / steps, 3),
                          kernels_per_step=round(kernels, 1), gpu_us_per_step=round(gpu_us, 1), top=rows)))
    print(json.dumps(dict(busy_by_kind=busy_by_kind(prof, order))))


def busy_by_kind(prof, order: list[str]) -> dict:
    """Per step kind: wall and GPU-busy milliseconds per step. A synchronous engine (overlap scheduling
    off) runs each step's kernels inside that step's host range, so kernels are filed by start time."""
    ranges = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                    if e.name == STEP_RANGE and e.device_type == torch.autograd.DeviceType.CPU)
    kernels = sorted((e.time_range.start, e.device_time) for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA and e.name != STEP_RANGE)
    wall, busy, i = collections.Counter(), collections.Counter(), 0
    for (lo, hi), kind in zip(ranges, order):
        wall[kind] += hi - lo
        while i < len(kernels) and kernels[i][0] < hi:
            busy[kind] += kernels[i][1] if kernels[i][0] >= lo else 0
            i += 1
    count = collections.Counter(order)
    return {kind: dict(steps=count[kind], wall_ms=round(wall[kind] / count[kind] / 1e3, 3),
                       gpu_busy_ms=round(busy[kind] / count[kind] / 1e3, 3)) for kind in count}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, action="append", default=[])
    parser.add_argument("--mixed", action="store_true")
    parser.add_argument("--prefill", type=int, default=0, help="profile the prefill of this many prompts")
    parser.add_argument("--cprofile", action="store_true",
                        help="with --mixed: the host phases under cProfile")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--model", default=CONFIG, help="a folder with the model's config.json")
    parser.add_argument("--host", action="store_true", help="with --batch: the host phases too")
    args, extra = parser.parse_known_args()
    if not torch.cuda.is_available():
        parser.error("it profiles GPU kernels: run it on a CUDA GPU")
    if args.mixed + bool(args.batch) + bool(args.prefill) != 1:
        parser.error("give --mixed, --prefill N, or one or more --batch sizes")
    if bad := [kv for kv in extra if not kv.startswith("--") or "=" not in kv]:
        parser.error(f"LLM options are given as --name=value; got {bad}")
    options = dict(kv.split("=", 1) for kv in extra)
    options = {k.lstrip("-").replace("-", "_"): (int(v) if v.isdigit() else v) for k, v in options.items()}
    llm = LLM(args.model, load_format="dummy", skip_tokenizer_init=True, **options)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)
    if args.mixed:  # leaves the run's other requests queued: nothing else may follow in this engine
        profile_mixed(llm, args.steps, args.cprofile)
        return
    seed(0)
    if args.prefill:
        profile_prefill(llm, args.prefill, args.context)  # compiles what it needs
        steps, wall, prof = profile_prefill(llm, args.prefill, args.context)
        rows, kernels, gpu_us = kernel_table(prof, steps)
        print(json.dumps(dict(prefill=args.prefill, context=args.context, steps=steps,
                              wall_ms_per_step=round(wall * 1e3 / steps, 3),
                              kernels_per_step=round(kernels, 1), gpu_us_per_step=round(gpu_us, 1),
                              top=rows)))
    for batch in args.batch:
        profile_decode(llm, batch, args.context, args.steps)  # compiles and captures what it needs
        wall, prof = profile_decode(llm, batch, args.context, args.steps, args.host)
        rows, kernels, gpu_us = kernel_table(prof, args.steps)
        if not rows:  # no device events (a CPU run, or a profiler that files kernels elsewhere)
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25))
        per_step_ms = round(wall * 1e3 / args.steps, 3)
        print(json.dumps(dict(batch=batch, context=args.context, wall_ms_per_step=per_step_ms,
                              kernels_per_step=round(kernels, 1), gpu_us_per_step=round(gpu_us, 1),
                              top=rows)))


def profile_prefill(llm: LLM, prompts: int, context: int):
    """(prefill steps, wall seconds, profile) of the steps that prefill `prompts` requests of `context`
    random tokens, each sampling its one token in its last prefill step. Only steps that scheduled prompt
    tokens count: the overlap loop ends on a step that launches nothing, which would halve the figures."""
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=1)
    for _ in range(prompts):
        llm.add_request([randint(0, 10000) for _ in range(context)], params)
    steps = 0
    torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        while not llm.is_finished():
            _, num_tokens = llm.step()  # nano-vllm's loop: +prefill / -decode tokens
            steps += num_tokens > 0
        torch.cuda.synchronize()
    return steps, time.perf_counter() - start, prof


def profile_decode(llm: LLM, batch: int, context: int, steps: int, host: bool = False):
    """(wall seconds, profile) of `steps` decode steps of `batch` requests with `context`-token prompts,
    after every prompt is prefilled (host: then as many more timed by phase, host_phases); the requests
    are then aborted."""
    engine = llm  # nano-vllm's loop on the LLM: step() returns (outputs, +prefill / -decode tokens)
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=2 * steps + 64)
    ids = [engine.add_request([randint(0, 10000) for _ in range(context)], params) for _ in range(batch)]
    decode_steps = 0
    while decode_steps < 2:  # past the prefill and the first decode (overlap may still hold a step)
        _, num_tokens = engine.step()
        decode_steps = decode_steps + 1 if num_tokens < 0 else 0
    torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    if host:
        host_phases(engine, steps)
    for request_id in ids:
        engine.abort_request(request_id)
    while not engine.is_finished():
        engine.step()
    return wall, prof

if __name__ == "__main__":
    main()
