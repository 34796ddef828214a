"""kernels/fp8_skinny.py against layers/fp8.py's W8A16 reference (the dequantized weight, x unrounded), on
CPU tensors through the Triton interpreter (or on CUDA when TRITON_INTERPRET=0): one scale a row, ragged
N and K, split-K, a bias, preloaded tiles, 2 to 4 rows on CUDA cores (kernels/gemv_rows.py), 2 to 16 on
tensor cores (kernels/skinny_rows.py), one row of a block-scaled weight, and the argument checks."""

import dataclasses

import pytest
import torch
from conftest import triton_test_device

pytest.importorskip("triton")

from nanovllm.kernels import gemv_rows, skinny_gemm  # noqa: E402
from nanovllm.kernels.fp8_block_gemv import launch_block_gemv  # noqa: E402
from nanovllm.kernels.fp8_skinny import (  # noqa: E402
    fp8_block_gemv_linear,
    fp8_gemv_rows_linear,
    fp8_rows_block_linear,
    fp8_rows_config,
    fp8_rows_linear,
    fp8_skinny_linear,
)
from nanovllm.layers.fp8 import fp8_weight_only_linear, quantize_groups  # noqa: E402

DEVICE = triton_test_device()
TOLERANCES = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
# (N, K): ragged N and K (no multiple of the column or K tile); one tile; 16 rows of a long K, so few
# column blocks that the shapes ask for split-K (where the norm fold runs the norm's kernel first).
SHAPES = [(200, 300), (96, 256), (16, 4096)]


def make(n: int, k: int, dtype: torch.dtype, width: int | None = None, seed: int = 0, rows: int = 1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width or k, generator=gen)
    # Scaled so that outputs are O(1) (as a normed row's are), and one tolerance fits every K.
    weight, scale = quantize_groups(torch.randn(n, k, generator=gen) / k**0.5, k)
    bias = torch.randn(n, generator=gen)
    return x.to(DEVICE, dtype), weight.to(DEVICE), scale.to(DEVICE), bias.to(DEVICE, dtype)


def reference(x, weight, scale, bias):
    k = weight.shape[1]
    return fp8_weight_only_linear(x.float(), weight, scale, k, None if bias is None else bias.float())


def assert_close(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_the_weight_only_reference(n, k, dtype, with_bias):
    x, weight, scale, bias = make(n, k, dtype)
    bias = bias if with_bias else None
    assert_close(fp8_skinny_linear(x, weight, scale, k, bias), reference(x, weight, scale, bias), dtype)


# (N, K, block): Qwen's 128 x 128 blocks with K = 384 (3 groups, scale rows padded to 4 as the linear
# method keeps them) and with a long K (split-K); small blocks, 3 groups of 32 inputs; K ending inside a
# group (80 = 2.5 groups of 32).
BLOCK_SHAPES = [(256, 384, (128, 128)), (128, 4096, (128, 128)), (64, 96, (16, 32)), (64, 80, (16, 32))]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k,block", BLOCK_SHAPES + [(64, 512, (16, 256)), (64, 64, (16, 128))])
def test_block_gemv_in_one_kernel_matches_the_weight_only_reference(n, k, block, dtype):
    """fp8_block_gemv_linear: each tile's runs inside one block times their scale; also blocks as wide as
    a tile (256 inputs) or wider (128 inputs, K = 64: one run a tile), and a long K split in K."""
    x, weight, scales, bias, expected = block_case(n, k, block, 1, dtype)
    assert_close(fp8_block_gemv_linear(x, weight, scales, block, bias), expected, dtype)


@pytest.mark.parametrize("preload", [1, 2])
def test_block_gemv_preloaded_tiles_give_the_same_bits(preload):
    """Tiles loaded ahead of the loop (as under PDL) give what the loop alone gives."""
    x, weight, scales, _, _ = block_case(128, 1024, (128, 128), 1, torch.float32)
    config = skinny_gemm.skinny_config(128, 1024, 1, 132)
    outs = [launch_block_gemv(x, weight, scales, (128, 128), None, torch.empty(1, 128, device=DEVICE),
                              dataclasses.replace(config, block_k=256, split_k=1, preload=p), False)
            for p in (0, preload)]
    assert torch.equal(outs[0], outs[1])


def test_block_gemv_refuses_runs_no_tile_takes():
    x = torch.randn(1, 96).to(DEVICE)
    weight = torch.zeros(64, 96, dtype=torch.float8_e4m3fn, device=DEVICE)
    with pytest.raises(ValueError, match="blocks of 48 inputs"):
        fp8_block_gemv_linear(x, weight, torch.ones(4, 2, device=DEVICE), (16, 48))


def block_case(n: int, k: int, block: tuple[int, int], rows: int, dtype: torch.dtype) -> tuple:
    """(x [rows, K], a block-scaled e4m3 weight [N, K], its scales as the linear method keeps them (rows
    padded to a multiple of 4), bias, the weight-only reference's output), on DEVICE."""
    block_rows, inputs = block
    gen = torch.Generator().manual_seed(n + k + rows)
    x = torch.randn(rows, k, generator=gen).to(DEVICE, dtype)
    weight = (torch.randn(n, k, generator=gen) * 8).to(torch.float8_e4m3fn).to(DEVICE)
    compact = torch.rand(n // block_rows, -(-k // inputs), generator=gen) / k**0.5 / 4 + 1e-3
    padded = torch.nn.functional.pad(compact, (0, -compact.shape[1] % 4)).to(DEVICE)
    bias = torch.randn(n, generator=gen).to(DEVICE, dtype)
    per_row = compact.repeat_interleave(block_rows, dim=0).to(DEVICE)  # the reference's layout
    expected = fp8_weight_only_linear(x.float(), weight, per_row, inputs, bias.float())
    return x, weight, padded, bias, expected


def test_block_scaled_row_refuses_blocks_it_cannot_tile():
    x = torch.randn(1, 96).to(DEVICE)
    weight = torch.zeros(48, 96, dtype=torch.float8_e4m3fn, device=DEVICE)
    with pytest.raises(ValueError, match="6-row blocks do not tile 48 outputs"):  # programs of 4-16 columns
        fp8_block_gemv_linear(x, weight, torch.ones(8, 3, device=DEVICE), (6, 32))
    with pytest.raises(ValueError, match=r"block_scale \(2, 2\) torch.float32 must be float32 \(3, 3\)"):
        fp8_block_gemv_linear(x, weight, torch.ones(2, 2, device=DEVICE), (16, 32))


def test_the_shapes_exercise_split_k_and_a_single_launch():
    assert skinny_gemm.skinny_config(16, 4096, 1, 132).split_k > 1
    assert skinny_gemm.skinny_config(200, 300, 1, 132).split_k == 1


# 2 to 4 rows on CUDA cores (kernels/gemv_rows.py over the e4m3 weight): float32 x too, split-K at the
# long K.
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", [2, 3, 4])
def test_gemv_rows_match_the_weight_only_reference(n, k, dtype, rows):
    x, weight, scale, bias = make(n, k, dtype, rows=rows)
    assert_close(fp8_gemv_rows_linear(x, weight, scale, k, bias), reference(x, weight, scale, bias), dtype)


def test_gemv_rows_plan_for_one_byte_an_element_and_split_the_long_k():
    one_byte, two_bytes = (gemv_rows.gemv_rows_config(16, 4096, 4, size, 132) for size in (1, 2))
    assert one_byte.block_k * one_byte.num_stages >= two_bytes.block_k * two_bytes.num_stages
    assert one_byte.split_k > 1


def test_gemv_rows_reject_what_they_cannot_read():
    x, weight, scale, _ = make(64, 256, torch.float16, rows=5)
    with pytest.raises(ValueError, match="1 to 4 rows"):
        fp8_gemv_rows_linear(x, weight, scale, 256)
    with pytest.raises(ValueError, match="one scale a row"):
        fp8_gemv_rows_linear(x[:4], weight, quantize_groups(weight.float().cpu(), 128)[1].to(DEVICE), 128)


# 2 to 16 rows (kernels/skinny_rows.py over the e4m3 weight): ragged N and K in 16-row column blocks;
# 64-row blocks; a long K, split in four.
ROWS_SHAPES = [(200, 300), (4096, 256), (64, 4096)]


@pytest.mark.parametrize("dtype", [torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else []))
@pytest.mark.parametrize("n,k", ROWS_SHAPES)
@pytest.mark.parametrize("rows", [2, 7, 16])
def test_rows_match_the_weight_only_reference(n, k, dtype, rows):
    x, weight, scale, bias = make(n, k, dtype, rows=rows)
    assert_close(fp8_rows_linear(x, weight, scale, k, bias), reference(x, weight, scale, bias), dtype)


def test_the_rows_shapes_exercise_both_column_blocks_and_split_k():
    configs = [fp8_rows_config(n, k) for n, k in ROWS_SHAPES]
    assert [c.block_n for c in configs] == [16, 64, 16] and [c.split_k for c in configs] == [1, 1, 4]


def test_the_rows_plan_over_e4m3_splits_only_where_column_blocks_leave_sms_idle():
    """fp8_rows_config at Qwen3-8B's shapes: tiles of 128 inputs; q/k/v, o and down (96, 64, 64 column
    blocks) split in four, gate/up (384) not, as the H200 sweep ran them fastest."""
    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
    configs = {name: fp8_rows_config(n, k) for name, (n, k) in shapes.items()}
    assert {c.block_k for c in configs.values()} == {128} and {c.block_n for c in configs.values()} == {64}
    assert {name: c.split_k for name, c in configs.items()} == {"qkv": 4, "o": 4, "gate_up": 1, "down": 4}
    assert fp8_rows_config(64, 48).block_k == 64  # a short K: one power-of-two tile


def test_rows_reject_what_they_cannot_read():
    x, weight, scale, _ = make(64, 256, torch.float16, rows=4)
    with pytest.raises(ValueError, match="not float16 or bfloat16"):  # the dot would round it to TF32
        fp8_rows_linear(x.float(), weight, scale, 256)
    with pytest.raises(ValueError, match="1 to 128 rows"):
        fp8_rows_linear(torch.cat([x] * 33), weight, scale, 256)
    with pytest.raises(ValueError, match="must be torch.float8_e4m3fn"):
        fp8_rows_linear(x, weight.half(), scale, 256)
    with pytest.raises(ValueError, match="one scale a row"):
        fp8_rows_linear(x, weight, quantize_groups(weight.float().cpu(), 128)[1].to(DEVICE), 128)


# (N, K, block) for the rows kernel's block scales: 128 x 128 blocks in 16-row column blocks (K = 384: the
# scales' rows padded to 4), in 64-row ones, and with a long K split in four; 32-input blocks (tiles of 32).
ROWS_BLOCK_SHAPES = [(256, 384, (128, 128)), (4096, 256, (128, 128)), (128, 4096, (128, 128)),
                     (64, 96, (16, 32))]


@pytest.mark.parametrize("dtype", [torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else []))
@pytest.mark.parametrize("n,k,block", ROWS_BLOCK_SHAPES)
@pytest.mark.parametrize("rows", [2, 7, 16])
def test_block_scaled_rows_match_the_weight_only_reference(n, k, block, dtype, rows):
    """fp8_rows_block_linear: each tile's product times its block's scale, against the dequantized
    weight."""
    x, weight, scales, bias, expected = block_case(n, k, block, rows, dtype)
    assert_close(fp8_rows_block_linear(x, weight, scales, block, bias), expected, dtype)


def test_block_scaled_rows_refuse_blocks_no_tile_fits():
    x = torch.randn(4, 96, dtype=torch.float16).to(DEVICE)
    weight = torch.zeros(64, 96, dtype=torch.float8_e4m3fn, device=DEVICE)
    with pytest.raises(ValueError, match="blocks of 48 inputs"):
        fp8_rows_block_linear(x, weight, torch.ones(4, 2, device=DEVICE), (16, 48))
    with pytest.raises(ValueError, match="8-row blocks do not tile 64 outputs in programs of 16"):
        fp8_rows_block_linear(x, weight, torch.ones(8, 3, device=DEVICE), (8, 32))
    with pytest.raises(ValueError, match="not float16 or bfloat16"):
        fp8_rows_block_linear(x.float(), weight, torch.ones(4, 3, device=DEVICE), (16, 32))


@pytest.mark.parametrize("preload", [1, 2])
def test_preloaded_tiles_give_the_same_bits(preload):
    """Tiles loaded ahead of the loop (as under PDL) give what the loop alone gives."""
    x, weight, scale, _ = make(64, 512, torch.float32)
    config = skinny_gemm.skinny_config(64, 512, 1, 132)
    config = dataclasses.replace(config, block_k=128, split_k=1)  # four tiles
    outs = [skinny_gemm.launch_gemv(x, weight, None, torch.empty(1, 64, device=DEVICE),
                                    dataclasses.replace(config, preload=p), False, weight_scale=scale)
            for p in (0, preload)]
    assert torch.equal(outs[0], outs[1])
    assert_close(outs[0], reference(x, weight, scale, None), torch.float32)


def test_rejects_what_it_cannot_read():
    x, weight, scale, bias = make(64, 256, torch.float32)
    with pytest.raises(ValueError, match="must be torch.float8_e4m3fn"):
        fp8_skinny_linear(x, weight.float(), scale, 256)
    with pytest.raises(ValueError, match="one scale a row; groups of 128"):
        fp8_skinny_linear(x, weight, quantize_groups(weight.float().cpu(), 128)[1].to(DEVICE), 128)
    with pytest.raises(ValueError, match=r"weight_scale \(64,\) torch.float32 must be contiguous"):
        fp8_skinny_linear(x, weight, scale.view(64), 256)
    with pytest.raises(ValueError, match="one contiguous row"):
        fp8_skinny_linear(torch.cat([x, x]), weight, scale, 256)
    with pytest.raises(ValueError, match="bias must be"):
        fp8_skinny_linear(x, weight, scale, 256, bias[:10])
