"""Which fused decode kernel TritonBackend takes: the CUDA one (kernels/cuda_decode_rope.py) for one row
of Qwen3-0.6B's shapes where the backend has it, the Triton one for anything else, and the Triton one for
good, with a warning, when the CUDA one cannot be built. No kernel runs: both are stand-ins here (the
kernels themselves: tests/kernels/test_decode_rope_one_row.py)."""

import logging
import types

import pytest
import torch

pytest.importorskip("triton")

from nanovllm.attention import triton_backend  # noqa: E402
from nanovllm.attention.backend import QKNorm  # noqa: E402
from nanovllm.kernels import cuda_decode_rope  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 16, 8, 128, 256  # Qwen3-0.6B, the engine's block size


def layer(cache_dtype=torch.bfloat16, qk_norm=True, k_scale=1.0):
    cache = torch.zeros(2, BLOCK, KV_HEADS, HEAD_DIM, dtype=cache_dtype)
    norm = QKNorm(torch.ones(HEAD_DIM), torch.ones(HEAD_DIM), 1e-6) if qk_norm else None
    rotary = types.SimpleNamespace(cos=torch.zeros(8, HEAD_DIM), sin=torch.zeros(8, HEAD_DIM))
    return types.SimpleNamespace(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, scale=0.1,
                                 rotary=rotary, qk_norm=norm, k_cache=cache, v_cache=cache.clone(),
                                 k_scale=k_scale, v_scale=1.0)


def qkv(rows, heads=HEADS):
    return (torch.zeros(rows, heads, HEAD_DIM, dtype=torch.bfloat16),
            torch.zeros(rows, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16),
            torch.zeros(rows, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16))


class OneRow:
    """Stands in for OneRowDecodeRope: records what it was asked to build, then launches nothing."""

    def __init__(self, error=None):
        self.error, self.built = error, []

    def prepared(self, q, k, positions, slot_mapping, pdl):
        if self.error is not None:
            raise self.error
        self.built.append((q.shape[0], pdl))
        return lambda *args, **kwargs: "cuda"


@pytest.fixture
def backend(monkeypatch):
    monkeypatch.setattr(triton_backend, "paged_decode_rope_attention", lambda *args, **kwargs: "triton")
    b = triton_backend.TritonBackend(4, KV_HEADS, torch.device("cpu"))
    assert b.one_row is None  # off sm_90+ (here: the CPU) the backend has no CUDA kernel
    b.one_row, b.pdl = OneRow(), True
    return b


def fused(backend, lay, rows=1, heads=HEADS):
    q, k, v = qkv(rows, heads)
    index = torch.zeros(rows, dtype=torch.int64)
    return backend._fused_decode(lay, q, k, v, index, index, index.int(), torch.zeros(rows, 1).int(),
                                 backend.decode_bucket(rows))


def test_one_qwen3_row_takes_the_cuda_kernel_as_a_programmatic_dependent(backend):
    assert fused(backend, layer()) == "cuda"
    assert backend.one_row.built == [(1, True)]


@pytest.mark.parametrize("case", ["two rows", "groups of 4", "fp8 cache", "no q/k norm", "cache scales"])
def test_everything_else_takes_the_triton_kernel(backend, case):
    lay = layer(cache_dtype=torch.float8_e4m3fn if case == "fp8 cache" else torch.bfloat16,
                qk_norm=case != "no q/k norm", k_scale=2.0 if case == "cache scales" else 1.0)
    rows, heads = (2 if case == "two rows" else 1), (32 if case == "groups of 4" else HEADS)
    assert fused(backend, lay, rows, heads) == "triton"
    assert backend.one_row.built == []


@pytest.mark.parametrize("error", [cuda_decode_rope.CompileError("rejected"), OSError("no libnvrtc")])
def test_a_kernel_that_cannot_be_built_leaves_the_triton_one_for_good(backend, caplog, error):
    backend.one_row = OneRow(error)
    with caplog.at_level(logging.WARNING, logger="nanovllm"):
        assert fused(backend, layer()) == "triton"
    assert backend.one_row is None and "using the Triton one" in caplog.text
    assert fused(backend, layer()) == "triton"
