"""skinny_linear against float32 PyTorch on CPU tensors through the Triton interpreter (or on CUDA when
TRITON_INTERPRET=0): the one-row GEMV, ragged N and K, split-K, bias, strided x and out, and the argument
checks."""

import pytest
import torch
from conftest import triton_test_device

pytest.importorskip("triton")

from nanovllm.kernels.skinny_gemm import SkinnyConfig, skinny_config, skinny_linear  # noqa: E402

DEVICE = triton_test_device()

# (N, K): one tile or a few; (96, 80) is a multiple of neither the column nor the K tile.
SHAPES = [(64, 32), (96, 80), (256, 128)]
# The interpreter computes in float32 numpy, so float32 matches to rounding; float16 rounds the output.
TOLERANCES = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def make_inputs(
    m: int, n: int, k: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # Scaled so that outputs are O(1) and one tolerance fits every K.
    x = torch.randn(m, k, generator=gen) / k**0.5
    weight = torch.randn(n, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    return x.to(DEVICE, dtype), weight.to(DEVICE, dtype), bias.to(DEVICE, dtype)


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.float() @ weight.float().T
    return out + bias.float() if bias is not None else out


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", SHAPES)
def test_matches_reference(n: int, k: int, dtype: torch.dtype):
    x, weight, bias = make_inputs(1, n, k, dtype)
    assert_close(skinny_linear(x, weight), reference(x, weight, None), dtype)
    assert_close(skinny_linear(x, weight, bias), reference(x, weight, bias), dtype)


def test_strided_x_and_out():
    m = 1
    # x is a column slice of a wider activation (as q of a fused qkv), out a slice of a wider buffer.
    n, k, dtype = 96, 80, torch.float32
    _, weight, bias = make_inputs(m, n, k, dtype)
    wide = torch.randn(m, k + 48, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    x = wide[:, 16 : 16 + k]
    out_buffer = torch.full((m, n + 32), float("nan"), device=DEVICE, dtype=dtype)
    out = out_buffer[:, 8 : 8 + n]
    result = skinny_linear(x, weight, bias, out=out)
    assert result.data_ptr() == out.data_ptr()
    assert_close(out, reference(x, weight, bias), dtype)
    # Columns outside the slice are untouched.
    assert out_buffer[:, :8].isnan().all() and out_buffer[:, 8 + n :].isnan().all()


# Configs the shape heuristic does not pick for test-sized shapes: K split over 2-5 programs (a ragged
# last split included), several K tiles per program, and wide column tiles mostly past N.
FORCED_CONFIGS = [
    SkinnyConfig(block_n=16, block_k=16, split_k=3, num_warps=2, num_stages=3),
    SkinnyConfig(block_n=64, block_k=32, split_k=2, num_warps=4, num_stages=2),
    SkinnyConfig(block_n=8, block_k=16, split_k=5, num_warps=4, num_stages=3),
    SkinnyConfig(block_n=4, block_k=32, split_k=1, num_warps=4, num_stages=3),
]


@pytest.mark.parametrize("config", FORCED_CONFIGS)
def test_forced_configs(config: SkinnyConfig):
    n, k, dtype = 96, 80, torch.float32
    x, weight, bias = make_inputs(1, n, k, dtype)
    assert_close(skinny_linear(x, weight, bias, config=config), reference(x, weight, bias), dtype)


def test_split_k_is_deterministic():
    config = SkinnyConfig(block_n=16, block_k=16, split_k=4, num_warps=2, num_stages=3)
    x, weight, bias = make_inputs(1, 64, 128, torch.float32)
    first = skinny_linear(x, weight, bias, config=config)
    assert torch.equal(first, skinny_linear(x, weight, bias, config=config))


def test_default_configs_for_qwen3_shapes():
    # The heuristic's choices for real shapes, as skinny_config documents them (retuning updates both):
    # two programs per SM where N allows, no split-K.
    assert skinny_config(6144, 1024, 2, 132) == SkinnyConfig(16, 256, 1, 4, 3)
    assert skinny_config(1024, 3072, 2, 132) == SkinnyConfig(4, 1024, 1, 4, 3)


def test_empty_batch_and_empty_k():
    _, weight, bias = make_inputs(1, 64, 32, torch.float32)
    assert skinny_linear(torch.empty(0, 32, device=DEVICE), weight).shape == (0, 64)
    x = torch.empty(1, 0, device=DEVICE)
    torch.testing.assert_close(skinny_linear(x, torch.empty(64, 0, device=DEVICE), bias), bias.expand(1, 64))


def test_rejects_bad_arguments():
    x, weight, bias = make_inputs(1, 64, 32, torch.float32)
    with pytest.raises(ValueError, match="at most one row"):
        skinny_linear(torch.zeros(2, 32, device=DEVICE), weight)
    with pytest.raises(ValueError, match="must be"):
        skinny_linear(x, weight[:, :16].contiguous())  # K mismatch
    with pytest.raises(ValueError, match="must be"):
        skinny_linear(x[0], weight)  # 1-D x
    with pytest.raises(ValueError, match="must match"):
        skinny_linear(x, weight.half())
    with pytest.raises(ValueError, match="must match"):
        skinny_linear(x, weight, bias.half())
    with pytest.raises(ValueError, match="bias has shape"):
        skinny_linear(x, weight, bias[:10])
    with pytest.raises(ValueError, match="contiguous last"):
        skinny_linear(torch.zeros(32, 2, device=DEVICE)[:, 0][None], weight)  # x strided along K
    with pytest.raises(ValueError, match="out must be"):
        skinny_linear(x, weight, out=torch.empty(1, 63, device=DEVICE))
    with pytest.raises(ValueError, match="not float16"):
        skinny_linear(x.double(), weight.double())
