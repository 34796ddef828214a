"""The runner compiles the sampler's variants at start-up (StepSampler.warm_up), so that a run never stops
mid-way to compile one. On CUDA the sampler goes through torch.compile; here Dynamo traces the same
function with its eager backend: the same frames and guards, no code generation."""

import pytest
import torch

from nanovllm.engine.step import SamplingBatch
from nanovllm.layers import sampler as sampler_module
from nanovllm.runner.sampling import WARM_ROWS, StepSampler
from nanovllm.utils.compile import GPUCompiled

VOCAB = 1000


@pytest.fixture
def dynamo_on_cpu(monkeypatch):
    """GPUCompiled compiles for CPU tensors too, with Dynamo's eager backend; yields a frame counter."""
    torch._dynamo.reset()

    def call(self, compiled, x, *args):
        if self._compiled is None:
            self._compiled = torch.compile(self.fn, dynamic=True, backend="eager")
        return self._compiled(x, *args)

    monkeypatch.setattr(GPUCompiled, "__call__", call)
    monkeypatch.setattr(sampler_module._race, "_compiled", None)
    yield lambda: torch._dynamo.utils.counters["frames"]["ok"]
    torch._dynamo.reset()


def temperature_rows(rows: int, greedy_rows: int = 0) -> SamplingBatch:
    temps = [0.0] * greedy_rows + [0.6] * (rows - greedy_rows)
    return SamplingBatch(temps, [-1] * rows, [1.0] * rows, [0.0] * rows, [None] * rows, [None] * rows)


def test_after_warm_up_no_batch_size_compiles_the_sampler_again(dynamo_on_cpu):
    sampler = StepSampler(VOCAB, torch.device("cpu"), compiled=True)
    logits = torch.randn(512, VOCAB)
    sampler.warm_up(logits[:max(WARM_ROWS)].contiguous())
    frames = dynamo_on_cpu()
    assert frames >= len(WARM_ROWS)  # each row count is its own variant
    for rows in (1, 3, 15, 16, 17, 255, 256, 512):
        for greedy_rows in (0, rows // 2):
            tokens = sampler.sample(logits[:rows].contiguous(), temperature_rows(rows, greedy_rows))[0]
            assert tokens.shape == (rows,)
    assert dynamo_on_cpu() == frames, "a batch size compiled a sampler variant the warm-up missed"


def test_warm_up_runs_every_variant_of_the_fused_race():
    # On CUDA the race is the Triton kernel: a variant per logits dtype (top-k/top-p scale them to
    # float32) and with or without min-p's floor, and the all-greedy one, each compiled once (no row
    # count specializes them); warm_up must meet them all. Both are stubs here: on a GPU host Triton
    # would launch for these CPU tensors.
    pytest.importorskip("triton")
    sampler = StepSampler(VOCAB, torch.device("cpu"), compiled=False)
    sampler.sampler = sampler_module.Sampler(fused_race=True)
    calls, greedy_calls = [], []

    def fused(logits, temps, seeds, min_ps=None):
        calls.append((logits.shape[0], logits.dtype, min_ps is not None))
        return torch.zeros(logits.shape[0], dtype=torch.int64)

    def fused_greedy(logits):
        greedy_calls.append((logits.shape[0], logits.dtype))
        return torch.zeros(logits.shape[0], dtype=torch.int64)
    sampler.sampler._fused, sampler.sampler._fused_greedy = fused, fused_greedy
    sampler.warm_up(torch.randn(max(WARM_ROWS), VOCAB, dtype=torch.bfloat16))
    assert {rows for rows, _, _ in calls} == set(WARM_ROWS)
    assert {variant[1:] for variant in calls} == {(dtype, floor) for dtype in (torch.bfloat16, torch.float32)
                                                  for floor in (False, True)}
    assert greedy_calls == [(1, torch.bfloat16)]
