"""The few-row GEMV (kernels/gemv_rows.py) against float32 PyTorch on CPU tensors through the Triton
interpreter (or on CUDA with TRITON_INTERPRET=0): 1-4 rows (3 padded to 4), ragged N and K, bias, strided
rows, split-K, preloaded tiles, the SiLU-mul prologue, and the argument checks."""

import pytest
import torch
from conftest import triton_test_device

pytest.importorskip("triton")

from nanovllm.kernels.gemv_rows import (  # noqa: E402
    MAX_ROWS,
    gemv_rows_config,
    gemv_rows_linear,
    gemv_rows_silu_linear,
    launch_gemv_rows,
)
from nanovllm.kernels.skinny_gemm import SILU_MUL, SkinnyConfig  # noqa: E402

DEVICE = triton_test_device()
TOLERANCES = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
SHAPES = [(64, 32), (96, 80)]  # (96, 80): a multiple of neither the column nor the K tile


def make(m: int, n: int, k: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) / k**0.5
    weight, bias = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    return x.to(DEVICE, dtype), weight.to(DEVICE, dtype), bias.to(DEVICE, dtype)


def reference(x, weight, bias=None):
    out = x.float() @ weight.float().T
    return out if bias is None else out + bias.float()


def assert_close(out, ref, dtype):
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=TOLERANCES[dtype], rtol=TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_matches_reference(m, n, k, dtype):
    x, weight, bias = make(m, n, k, dtype)
    assert_close(gemv_rows_linear(x, weight), reference(x, weight), dtype)
    assert_close(gemv_rows_linear(x, weight, bias), reference(x, weight, bias), dtype)


def test_strided_rows_and_out():
    """x rows further apart than K (a column slice of a wider activation), out a slice of a wider buffer."""
    m, n, k, dtype = 3, 96, 80, torch.float32
    _, weight, bias = make(m, n, k, dtype)
    wide = torch.randn(m, k + 48, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    x = wide[:, 16 : 16 + k]
    buffer = torch.full((m, n + 32), float("nan"), device=DEVICE, dtype=dtype)
    out = buffer[:, 8 : 8 + n]
    launch_gemv_rows(x, weight, bias, out)
    assert_close(out, reference(x, weight, bias), dtype)
    assert buffer[:, :8].isnan().all() and buffer[:, 8 + n :].isnan().all()


# Split K over 2-5 programs (a ragged last split), preloaded tiles (as a PDL launch loads them), wide
# column tiles mostly past N; the SiLU-mul prologue across splits too.
FORCED = [
    SkinnyConfig(block_n=16, block_k=16, split_k=3, num_warps=2, num_stages=3),
    SkinnyConfig(block_n=8, block_k=16, split_k=5, num_warps=4, num_stages=3, preload=1),
    SkinnyConfig(block_n=64, block_k=32, split_k=1, num_warps=4, num_stages=2, preload=2),
]


@pytest.mark.parametrize("config", FORCED)
@pytest.mark.parametrize("m", [2, 4])
def test_forced_configs(config, m):
    x, weight, bias = make(m, 96, 80, torch.float32)
    out = torch.empty(m, 96, device=DEVICE)
    assert_close(launch_gemv_rows(x, weight, bias, out, config=config), reference(x, weight, bias),
                 torch.float32)
    gate_up = torch.randn(m, 160, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    gate, up = gate_up.chunk(2, dim=-1)
    launch_gemv_rows(gate_up, weight, None, out, prologue=SILU_MUL, config=config)
    assert_close(out, reference(torch.nn.functional.silu(gate) * up, weight), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [2, 4])
def test_silu_prologue_matches_silu_mul_then_linear(m, dtype):
    n, k = 96, 80
    _, weight, bias = make(m, n, k, dtype)
    gate_up = torch.randn(m, 2 * k, generator=torch.Generator().manual_seed(3)).to(DEVICE, dtype)
    gate, up = gate_up.float().chunk(2, dim=-1)
    activated = (torch.nn.functional.silu(gate) * up).to(dtype)
    assert_close(gemv_rows_silu_linear(gate_up, weight, bias), reference(activated, weight, bias), dtype)


def test_configs_keep_the_one_row_registers():
    """The K tile shrinks with the rows: [rows, block_n, block_k] stays one row's tile."""
    one = gemv_rows_config(6144, 1024, 1, 2, 132)
    for m, rows in ((2, 2), (3, 4), (4, 4)):
        config = gemv_rows_config(6144, 1024, m, 2, 132)
        assert (config.block_n, config.block_k * rows) == (one.block_n, one.block_k)


def test_rejects_bad_arguments():
    x, weight, bias = make(2, 64, 32, torch.float32)
    with pytest.raises(ValueError, match=f"1 to {MAX_ROWS} rows"):
        gemv_rows_linear(torch.zeros(MAX_ROWS + 1, 32, device=DEVICE), weight)
    with pytest.raises(ValueError, match="rows of 32"):
        gemv_rows_linear(x[:, :16], weight)
    with pytest.raises(ValueError, match="must be x's dtype"):
        gemv_rows_linear(x, weight.half())
    with pytest.raises(ValueError, match="rows of 64"):
        gemv_rows_silu_linear(x, weight)  # x must be [gate | up]: 2K wide
