"""The project's bookkeeping per decode step, no model: Scheduler + BlockManager (schedule and
postprocess), then also building the step's StepBatch record; 256 running requests, prompts 100..600
tokens, block size 256, 400 output tokens each: the workload its counterpart for upstream nano-vllm runs,
so that the two print comparable figures. CPU only.

    python scripts/sched_overhead.py"""

import os
import random
import sys
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nanovllm.engine.requests import StopChecker  # noqa: E402
from nanovllm.engine.scheduler import Scheduler  # noqa: E402
from nanovllm.engine.sequence import Sequence  # noqa: E402
from nanovllm.engine.step import build_batch  # noqa: E402
from nanovllm.sampling_params import SamplingParams  # noqa: E402

NUM_REQUESTS, BLOCK_SIZE, MAX_DECODE_STEPS = 256, 256, 300


def main() -> None:
    config = SimpleNamespace(max_num_seqs=512, max_num_batched_tokens=16384, kvcache_block_size=BLOCK_SIZE,
                             enable_prefix_caching=True, mixed_batches=True)
    scheduler = Scheduler(config, 4096, StopChecker((-1,), max_model_len=1024))
    random.seed(0)
    for _ in range(NUM_REQUESTS):
        scheduler.add(Sequence([random.randint(0, 300) for _ in range(random.randint(100, 600))],
                               SamplingParams(temperature=1.0, max_tokens=400, ignore_eos=True), BLOCK_SIZE))
    steps = bookkeeping = with_batch = 0.0
    while not scheduler.is_finished() and steps < MAX_DECODE_STEPS:
        start = time.perf_counter()
        seqs, is_prefill = scheduler.schedule()
        middle = time.perf_counter()
        batch = build_batch(seqs, is_prefill)
        built = time.perf_counter()
        token_ids = [None] * len(seqs)
        for row in batch.sample_rows:
            token_ids[row] = 1
        scheduler.postprocess(seqs, token_ids)
        end = time.perf_counter()
        if not is_prefill:
            steps += 1
            bookkeeping += (middle - start) + (end - built)
            with_batch += end - start
    print(f"project scheduler+block manager: {bookkeeping / steps * 1e3:.3f} ms per decode step at "
          f"{NUM_REQUESTS} requests ({int(steps)} steps); with the StepBatch record: "
          f"{with_batch / steps * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
