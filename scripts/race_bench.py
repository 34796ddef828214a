"""The sampler's race on a GPU: the fused Triton race (kernels/sample_race.py) under several launch
settings against the PyTorch race it replaces (exponential noise, then the compiled scaled argmax), at
Qwen3's vocabulary and bench.py's temperature. Microseconds per call from CUDA-graph replays.

    python scripts/race_bench.py [--rows 1 --rows 256]"""

import argparse
import functools
import itertools
import json

import torch
import triton.testing

from nanovllm.kernels import sample_race
from nanovllm.layers.sampler import Sampler, SamplingTensors

VOCAB = 151936
SETTINGS = dict(PROGRAMS_PER_SM=(2, 8, 16), SUB_BLOCK=(256, 512, 1024), NUM_WARPS=(4, 8))


def graph_us(fn) -> float:
    fn()  # compile outside the capture
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn) * 1e3


def bench_rows(rows: int) -> dict:
    device = torch.device("cuda")
    logits = torch.randn(rows, VOCAB, device=device).to(torch.bfloat16)
    temps = torch.full((rows,), 0.6, device=device)
    seeds = torch.randint(0, 2**62, (rows,), device=device)
    params = SamplingTensors(temps, all_greedy=False)
    pytorch = functools.partial(Sampler(compiled=True), logits, params)
    result = dict(rows=rows, pytorch_us=round(graph_us(pytorch), 1))
    fused = functools.partial(sample_race.race, logits, temps, seeds)
    engine = {name: getattr(sample_race, name) for name in SETTINGS}
    timings = []
    for values in itertools.product(*SETTINGS.values()):
        setting = dict(zip(SETTINGS, values, strict=True))
        try:
            for name, value in setting.items():
                setattr(sample_race, name, value)
            sample_race.BLOCK = 4 * sample_race.SUB_BLOCK
            timings.append((graph_us(fused), setting))
        finally:
            for name, value in engine.items():
                setattr(sample_race, name, value)
            sample_race.BLOCK = 4 * sample_race.SUB_BLOCK
    default = next(us for us, s in timings if s == engine)
    timings.sort(key=lambda t: t[0])
    return dict(result, fused_default_us=round(default, 1), default=engine,
                best=[dict(us=round(us, 1), **s) for us, s in timings[:3]])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, action="append",
                        help="batch rows (repeatable); default 1, 64, 256")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("it times CUDA kernels: run it on a CUDA GPU")
    for rows in args.rows or [1, 64, 256]:
        print(json.dumps(bench_rows(rows)), flush=True)


if __name__ == "__main__":
    main()
