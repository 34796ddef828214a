"""The tensor-core few-rows kernel (kernels/skinny_rows.py) against PyTorch, on CPU tensors through the
Triton interpreter or on CUDA when TRITON_INTERPRET=0, float16 and bfloat16: plain and RMSNorm-folded
launches at 1-16 rows (plain ones to 128), ragged N and K, split-K (summed by a second launch or by each
column block's last split), bias, the residual stream it writes, the launch settings (on CUDA also the
Qwen3-0.6B shapes at them, and Qwen3-8B's splits summed by their last split under graph replays), and the
argument checks."""

import pytest
import torch
import torch.nn.functional as F
from conftest import triton_test_device

pytest.importorskip("triton")

from nanovllm.attention.layer import rms_norm  # noqa: E402
from nanovllm.kernels import rows_settings, skinny_rows  # noqa: E402
from nanovllm.kernels.rows_settings import RowsConfig  # noqa: E402
from nanovllm.kernels.skinny_rows import (  # noqa: E402
    launch_rows,
    rows_linear,
    rows_norm_linear,
)

DEVICE = triton_test_device()
DTYPES = [torch.float16, torch.bfloat16]
# The operands enter the dot rounded to the dtype (the normed row after its weight): one rounding more
# than the float32 reference.
TOLERANCES = {torch.float16: 3e-3, torch.bfloat16: 3e-2}
ROW_COUNTS = [1, 2, 3, 8, 16]
# Plain launches also take 17-128 rows, x padded to the next power of two (rows_tile).
PLAIN_ROW_COUNTS = [*ROW_COUNTS, 17, 40, 128]
# A small config so that the interpreter's shapes span several column blocks and K tiles.
SMALL = RowsConfig(block_n=16, block_k=32, num_stages=2)


def make(m: int, n: int, k: int, dtype: torch.dtype, seed: int = 0, x_width: int | None = None):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, x_width or k, generator=gen)
    weight = torch.randn(n, k, generator=gen) / k**0.5
    bias = torch.randn(n, generator=gen)
    return x.to(DEVICE, dtype), weight.to(DEVICE, dtype), bias.to(DEVICE, dtype)


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    tol = TOLERANCES[out.dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", PLAIN_ROW_COUNTS)
@pytest.mark.parametrize("split_k", [1, 3])
def test_plain_rows_match_matmul_for_ragged_shapes_and_splits(m: int, split_k: int, dtype: torch.dtype):
    x, weight, bias = make(m, 40, 100, dtype)
    for b in (None, bias):
        out = torch.empty(m, 40, dtype=dtype, device=DEVICE)
        launch_rows(x, weight, b, out, RowsConfig(16, 32, split_k=split_k, num_stages=2))
        assert_close(out, F.linear(x.float(), weight.float(), None if b is None else b.float()))


@pytest.mark.parametrize("m", [1, 3, 16, 40])
@pytest.mark.parametrize("split_k", [2, 3])
def test_last_split_sums_give_the_reduce_launchs_bits_and_reset_the_counters(m: int, split_k: int,
                                                                              monkeypatch):
    x, weight, bias = make(m, 40, 100, torch.bfloat16)
    config = RowsConfig(16, 32, split_k=split_k, num_stages=2)
    counters = torch.zeros(40, dtype=torch.int32, device=DEVICE)  # a layer's (add_split_counters)
    for b in (None, bias, None):  # one set of counters serves a layer's calls one after another
        reduced = torch.empty(m, 40, dtype=torch.bfloat16, device=DEVICE)
        launch_rows(x, weight, b, reduced, config)
        summed = torch.full_like(reduced, float("nan"))
        with monkeypatch.context() as patch:  # no second launch
            patch.setattr(skinny_rows, "reduce_split_k", lambda *args: pytest.fail("reduce launched"))
            launch_rows(x, weight, b, summed, config, counters=counters)
        assert torch.equal(summed, reduced)
        assert not counters.any()


def test_last_split_sums_refuse_counters_of_another_width():
    x, weight, _ = make(2, 40, 100, torch.bfloat16)
    out = torch.empty(2, 40, dtype=torch.bfloat16, device=DEVICE)
    for counters in (torch.zeros(16, dtype=torch.int32), torch.zeros(40, dtype=torch.int64)):
        with pytest.raises(ValueError, match="one for each of the 40 outputs"):
            launch_rows(x, weight, None, out, RowsConfig(16, 32, split_k=2), counters=counters.to(DEVICE))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", ROW_COUNTS)
def test_add_norm_prologue_stores_the_residual_stream_and_norms_each_row(m: int, dtype: torch.dtype):
    x, weight, _ = make(m, 48, 96, dtype)
    residual = make(m, 1, 96, dtype, seed=1)[0]
    norm_weight = (torch.rand(96) + 0.5).to(DEVICE, dtype)
    out = torch.empty(m, 48, dtype=dtype, device=DEVICE)
    summed = torch.empty(m, 96, dtype=dtype, device=DEVICE)
    launch_rows(x, weight, None, out, SMALL, False, skinny_rows.ADD_RMS_NORM, residual, summed, norm_weight,
                1e-6)
    expected_sum = (x.float() + residual.float()).to(dtype)
    assert torch.equal(summed, expected_sum)  # the stream is stored exactly as the add kernel rounds it
    normed = rms_norm(expected_sum.float(), norm_weight.float(), 1e-6)
    assert_close(out, normed @ weight.float().T)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [2, 5, 16])
def test_norm_prologue_without_residual(m: int, dtype: torch.dtype):
    x, weight, _ = make(m, 48, 96, dtype)
    norm_weight = (torch.rand(96) + 0.5).to(DEVICE, dtype)
    out = torch.empty(m, 48, dtype=dtype, device=DEVICE)
    launch_rows(x, weight, None, out, SMALL, False, skinny_rows.RMS_NORM, norm_weight=norm_weight, eps=1e-6)
    assert_close(out, rms_norm(x.float(), norm_weight.float(), 1e-6) @ weight.float().T)


def test_norm_launches_never_split_k():
    """A split would cut each row's sum of squares: the norm prologues run unsplit whatever the config."""
    x, weight, _ = make(3, 32, 128, torch.float16)
    norm_weight = torch.ones(128, dtype=torch.float16, device=DEVICE)
    out = torch.empty(3, 32, dtype=torch.float16, device=DEVICE)
    split = RowsConfig(16, 32, split_k=4, num_stages=2)
    launch_rows(x, weight, None, out, split, False, skinny_rows.RMS_NORM, norm_weight=norm_weight, eps=1e-6)
    assert_close(out, rms_norm(x.float(), norm_weight.float(), 1e-6) @ weight.float().T)


@pytest.mark.parametrize("dtype", DTYPES)
def test_public_functions_agree_with_norm_then_linear(dtype: torch.dtype):
    m, n, k = 4, 64, 128
    x, weight, bias = make(m, n, k, dtype)
    residual = make(m, 1, k, dtype, seed=3)[0]
    norm_weight = (torch.rand(k) + 0.5).to(DEVICE, dtype)
    assert_close(rows_linear(x, weight, bias), F.linear(x.float(), weight.float(), bias.float()))
    out, summed = rows_norm_linear(x, norm_weight, 1e-6, weight, residual=residual)
    assert torch.equal(summed, (x.float() + residual.float()).to(dtype))
    assert_close(out, rms_norm(summed.float(), norm_weight.float(), 1e-6) @ weight.float().T)
    out, same = rows_norm_linear(x, norm_weight, 1e-6, weight, bias)
    assert same is x
    assert_close(out, rms_norm(x.float(), norm_weight.float(), 1e-6) @ weight.float().T + bias.float())


def test_bad_arguments_raise_value_errors():
    x, weight, _ = make(2, 32, 64, torch.float16)
    with pytest.raises(ValueError, match="1 to 128 rows"):
        rows_linear(torch.zeros(129, 64, dtype=torch.float16, device=DEVICE), weight)
    rows17 = torch.zeros(17, 64, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match="1 to 16 rows"):  # a norm's sums of squares: 16 rows at most
        rows_norm_linear(rows17, torch.ones(64, dtype=torch.float16, device=DEVICE), 1e-6, weight)
    with pytest.raises(ValueError, match=r"\(16 with a norm\), not 17"):
        launch_rows(rows17, weight, None, torch.empty(17, 32, dtype=torch.float16, device=DEVICE), SMALL,
                    False, skinny_rows.RMS_NORM, norm_weight=torch.ones(64, dtype=torch.float16,
                                                                        device=DEVICE), eps=1e-6)
    with pytest.raises(ValueError, match="rows of 64"):
        rows_linear(x[:, :32], weight)
    with pytest.raises(ValueError, match="dtype"):
        rows_linear(x, weight.float())
    with pytest.raises(ValueError, match="residual"):
        rows_norm_linear(x, torch.ones(64, dtype=torch.float16, device=DEVICE), 1e-6, weight, residual=x[:1])
    with pytest.raises(ValueError, match="norm_weight"):
        rows_norm_linear(x, torch.ones(32, dtype=torch.float16, device=DEVICE), 1e-6, weight)


def test_launch_settings_follow_the_measured_shapes():
    """Qwen3-0.6B's and 8B's linears get the settings that measured fastest (rows_settings.MIN_COLUMN_BLOCKS,
    SPLIT_BELOW_N)."""
    config = rows_settings.rows_config
    assert config(4096, 1024, skinny_rows.ADD_RMS_NORM) == RowsConfig(64, 256, 1, 4, 4, preload=0)  # q/k/v
    assert config(6144, 1024, skinny_rows.ADD_RMS_NORM) == RowsConfig(64, 256, 1, 4, 4, preload=0)  # gate/up
    assert config(1024, 2048) == RowsConfig(16, 256, 1, 2, 5)  # o_proj: 8 tiles, unsplit
    assert config(1024, 3072) == RowsConfig(16, 256, 4, 2, 5)  # down_proj: 12 tiles, split in four
    assert config(1024, 3072, skinny_rows.RMS_NORM).split_k == 1  # a norm is never split
    assert config(151936, 1024).block_n == 64  # the LM head
    # Qwen3-8B's o_proj and down_proj: outputs of 4096 run unsplit (rows_settings.SPLIT_BELOW_N)
    assert config(4096, 4096) == RowsConfig(64, 256, 1, 4, 4)
    assert config(4096, 12288) == RowsConfig(64, 256, 1, 4, 4)
    assert config(64, 40) == RowsConfig(16, 64, 1, 2, 5)  # K tiles no wider than K


def test_launch_settings_past_16_rows_fit_the_shared_memory():
    """Up to 16 rows the measured settings launch as they are; past them, where x's tile grows, the stages
    (Triton keeps one buffer more) and then the tiles shrink to fit SHARED_BUDGET (an H100 refused 32 rows
    of bf16 at four 256-input stages: 256 KB asked of 227)."""
    from nanovllm.kernels.fp8_skinny import fp8_rows_config

    bf16, e4m3 = torch.empty(1, dtype=torch.bfloat16), torch.empty(1, dtype=torch.float8_e4m3fn)
    shapes = [(4096, 1024), (6144, 1024), (1024, 2048), (1024, 3072), (6144, 4096), (4096, 4096),
              (24576, 4096), (4096, 12288)]
    for n, k in shapes:
        for prologue in (skinny_rows.PLAIN, skinny_rows.ADD_RMS_NORM):
            config = rows_settings.rows_config(n, k, prologue)
            assert rows_settings.fit_shared(config, 16, bf16, bf16) == config
        config = fp8_rows_config(n, k)
        for x in (bf16, e4m3):
            for rows in (16, 128 if x is e4m3 else 16):
                assert rows_settings.fit_shared(config, rows, x, e4m3) == config
    qkv = rows_settings.rows_config(6144, 4096)
    assert rows_settings.fit_shared(qkv, 32, bf16, bf16) == RowsConfig(64, 256, 1, 4, 3)
    assert rows_settings.fit_shared(qkv, 128, bf16, bf16) == RowsConfig(64, 128, 1, 4, 3)
    for rows in (16, 32, 64, 128):
        fitted = rows_settings.fit_shared(qkv, rows, bf16, bf16)
        stage = (rows + fitted.block_n) * 2 * fitted.block_k
        assert (fitted.num_stages + 1) * stage <= rows_settings.SHARED_BUDGET


@pytest.mark.skipif(DEVICE != "cuda", reason="full-size tiles: too slow for the interpreter")
@pytest.mark.parametrize("m", [2, 16])
def test_qwen3_shapes_at_their_launch_settings(m: int):
    """Each Qwen3-0.6B linear at rows_config's settings (the 64-row weight tiles and pipeline depths the
    engine launches, which must fit the shared memory) gives the matmul."""
    for n, k, prologue in ((4096, 1024, skinny_rows.ADD_RMS_NORM), (6144, 1024, skinny_rows.ADD_RMS_NORM),
                           (1024, 2048, skinny_rows.PLAIN), (1024, 3072, skinny_rows.PLAIN)):
        x, weight, _ = make(m, n, k, torch.bfloat16)
        if prologue == skinny_rows.PLAIN:
            assert_close(rows_linear(x, weight), F.linear(x.float(), weight.float()))
            continue
        residual = make(m, 1, k, torch.bfloat16, seed=1)[0]
        norm_weight = (torch.rand(k) + 0.5).to(DEVICE, torch.bfloat16)
        out, summed = rows_norm_linear(x, norm_weight, 1e-6, weight, residual=residual)
        assert_close(out, rms_norm(summed.float(), norm_weight.float(), 1e-6) @ weight.float().T)


@pytest.mark.skipif(DEVICE != "cuda", reason="many programs racing to count: what only a GPU shows")
def test_last_split_sums_hold_under_graph_replays_at_qwen3_8b_splits():
    """Qwen3-8B's split launches (64 column blocks of 64 outputs, split in four; 132 SMs racing), as a decode
    graph replays them: ten calls a replay on one set of counters, each the reduce launch's bits."""
    x, weight, bias = make(8, 4096, 4096, torch.bfloat16)
    config = RowsConfig(64, 128, split_k=4, num_warps=4, num_stages=4)
    pdl = torch.cuda.get_device_capability()[0] >= 9
    reduced = torch.empty(8, 4096, dtype=torch.bfloat16, device=DEVICE)
    launch_rows(x, weight, bias, reduced, config)
    counters = torch.zeros(4096, dtype=torch.int32, device=DEVICE)
    outs = [torch.empty_like(reduced) for _ in range(10)]
    for out in outs:  # compiled and run once outside the graph
        launch_rows(x, weight, bias, out, config, pdl, counters=counters)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for out in outs:
            launch_rows(x, weight, bias, out, config, pdl, counters=counters)
    for _ in range(20):
        for out in outs:
            out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(out, reduced) for out in outs)
    assert not counters.any()
