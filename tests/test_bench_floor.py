"""scripts/bench_floor.py: the floor of bench.py's workload, its bookkeeping on a case small enough to
work out by hand, and the command as typed."""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).parents[1]
spec = importlib.util.spec_from_file_location("bench_floor", ROOT / "scripts" / "bench_floor.py")
bench_floor = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_floor)

# One layer, one head of 4, an MLP of 8, 10 tokens: 64 attention weights (q, k, v, o), 96 in the MLP, an
# LM head of 40; a cached token is K and V of 4 bf16 values (16 bytes); a query attends at 16 FLOPs a token.
TINY = dict(hidden_size=4, num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1, head_dim=4,
            intermediate_size=8, vocab_size=10)


def test_decode_steps_read_the_weights_once_and_every_rows_context():
    shape = bench_floor.Shape(TINY, weight_bytes=2, kv_cache_dtype="auto")
    assert (shape.dense_params, shape.head_params, shape.kv_per_token) == (160, 40, 16)
    # Two requests: prompts of 2 and 3 tokens, 3 and 2 output tokens (the first of each from the prefill).
    # Step 0 computes both requests' second token against contexts of 3 and 4; step 1 the first's third
    # against 4.
    parts = bench_floor.floor(shape, np.array([2, 3]), np.array([3, 2]))
    step_bytes = [160 * 2 + 40 * 2 + 7 * 16, 160 * 2 + 40 * 2 + 4 * 16]
    assert parts["decode"] == pytest.approx(sum(step_bytes) / bench_floor.BANDWIDTH)
    assert parts["decode, memory-bound steps"] == parts["decode"]
    prefill_flops = 2 * 160 * 5 + 2 * 40 * 2 + 16 * (3 + 6)  # causal attention: 1 + 2 and 1 + 2 + 3
    prefill_bytes = 160 * 2 + 5 * 16
    assert parts["prefill"] == pytest.approx(max(prefill_flops / bench_floor.PEAK_FLOPS[2],
                                                 prefill_bytes / bench_floor.BANDWIDTH))


def test_fp8_halves_the_weights_and_an_moe_step_reads_the_experts_its_rows_route_to():
    fp8 = bench_floor.Shape(TINY, weight_bytes=1, kv_cache_dtype="fp8")
    assert fp8.kv_per_token == 8 and fp8.peak == bench_floor.PEAK_FLOPS[1]
    int8 = bench_floor.Shape(TINY, weight_bytes=2, kv_cache_dtype="int8")
    assert int8.kv_per_token == 8 + 2 * bench_floor.INT8_SCALE_BYTES
    moe = bench_floor.Shape({**TINY, "num_experts": 16, "num_experts_per_tok": 2, "moe_intermediate_size": 2},
                            weight_bytes=2, kv_cache_dtype="auto")
    assert moe.dense_params == 64 + 4 * 16 and moe.active_params == 64 + 4 * 16 + 2 * 24
    read = moe.experts_read(np.array([1, 1000]))
    assert read[0] == pytest.approx(2) and read[1] == pytest.approx(16)


def test_bytes_move_at_the_bandwidth_given():
    shape = bench_floor.Shape(TINY, weight_bytes=2, kv_cache_dtype="auto")
    prompts, outputs = np.array([2, 3]), np.array([3, 2])
    h200 = bench_floor.floor(shape, prompts, outputs)
    half = bench_floor.floor(shape, prompts, outputs, bench_floor.BANDWIDTH / 2)
    assert half["decode, memory-bound steps"] == pytest.approx(2 * h200["decode, memory-bound steps"])


def test_runs_as_typed():
    """`python scripts/bench_floor.py --model configs/Qwen3-8B`, and fp8 weights and cache raise it; an H100's
    bandwidth (--bandwidth 3.35) lowers it."""
    def tok_s(*extra):
        command = [sys.executable, "scripts/bench_floor.py", "--model", "configs/Qwen3-8B", *extra]
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        figure = re.search(r"for 133,966 output tokens -> ([\d,]+) tok/s", done.stdout)[1]
        return float(figure.replace(",", ""))

    bf16 = tok_s()
    assert 5_000 < bf16 < tok_s("--quantization", "fp8", "--kv-cache-dtype", "fp8") < 4 * bf16
    assert tok_s("--bandwidth", "3.35") < bf16
