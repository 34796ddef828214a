"""skinny_linear against float32 PyTorch on CPU tensors through the Triton interpreter (or on CUDA when
TRITON_INTERPRET=0): the one-row GEMV, ragged N and K, split-K, bias, strided x and out, and the argument
checks."""

import pytest
import torch
from conftest import triton_test_device

pytest.importorskip("triton")

from nanovllm.kernels import skinny_gemm  # noqa: E402
from nanovllm.kernels.gemv_folds import skinny_norm_linear, skinny_silu_linear  # noqa: E402
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
    # The first tiles loaded ahead of the loop (as a programmatic dependent launch loads them before its
    # wait): one or two, a ragged last tile among them, per split.
    SkinnyConfig(block_n=16, block_k=32, split_k=1, num_warps=4, num_stages=3, preload=2),
    SkinnyConfig(block_n=8, block_k=16, split_k=2, num_warps=4, num_stages=3, preload=1),
    SkinnyConfig(block_n=16, block_k=16, split_k=3, num_warps=2, num_stages=3, preload=2),
    SkinnyConfig(block_n=16, block_k=64, split_k=1, num_warps=4, num_stages=3, preload=2),  # one tile
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


# (N, K) for the prologues: 256 x 128 runs them in the GEMV kernel; 16 x 256 leaves so few column
# blocks that the shapes ask for split-K, where the norm runs on its own first.
PROLOGUE_SHAPES = [(256, 128), (16, 256)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,k", PROLOGUE_SHAPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_norm_prologue_matches_norm_then_linear(n: int, k: int, dtype: torch.dtype, with_residual: bool):
    from nanovllm.attention.layer import rms_norm

    x, weight, bias = make_inputs(1, n, k, dtype)
    gen = torch.Generator().manual_seed(3)
    residual = torch.randn(1, k, generator=gen).to(DEVICE, dtype) if with_residual else None
    norm_weight = (1 + torch.rand(k, generator=gen)).to(DEVICE, dtype)
    out, summed = skinny_norm_linear(x, norm_weight, 1e-6, weight, bias, residual)
    expected_sum = (x.float() + residual.float()).to(dtype) if with_residual else x
    assert torch.equal(summed, expected_sum)  # the residual stream, rounded as stored
    normed = rms_norm(expected_sum.cpu().float(), norm_weight.cpu().float(), 1e-6).to(DEVICE)
    assert_close(out, reference(normed, weight, bias), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,k", PROLOGUE_SHAPES)
def test_silu_prologue_matches_silu_mul_then_linear(n: int, k: int, dtype: torch.dtype):
    gate_up = torch.randn(1, 2 * k, generator=torch.Generator().manual_seed(4)).to(DEVICE, dtype)
    _, weight, bias = make_inputs(1, n, k, dtype)
    gate, up = gate_up.float().chunk(2, dim=-1)
    activated = (torch.nn.functional.silu(gate) * up).to(dtype)
    assert_close(skinny_silu_linear(gate_up, weight, bias), reference(activated, weight, bias), dtype)


@pytest.mark.parametrize("preload", [1, 2])
def test_prologues_with_preloaded_tiles(preload: int):
    """Both prologues over tiles loaded ahead of the loop: the same bits as without."""
    n, k, dtype = 64, 96, torch.float32
    x, weight, bias = make_inputs(1, n, k, dtype)
    gen = torch.Generator().manual_seed(5)
    residual, gate_up = torch.randn(1, k, generator=gen), torch.randn(1, 2 * k, generator=gen)
    residual, gate_up = residual.to(DEVICE, dtype), gate_up.to(DEVICE, dtype)
    norm_weight = (1 + torch.rand(k, generator=gen)).to(DEVICE, dtype)
    plain = SkinnyConfig(block_n=16, block_k=32, num_stages=3, preload=0)
    ahead = SkinnyConfig(block_n=16, block_k=32, num_stages=3, preload=preload)
    for prologue, args in ((skinny_gemm.ADD_RMS_NORM, (residual, torch.empty_like(x), norm_weight, 1e-6)),
                           (skinny_gemm.SILU_MUL, ())):
        source = gate_up if prologue == skinny_gemm.SILU_MUL else x
        outs = [skinny_gemm.launch_gemv(source, weight, bias, torch.empty(1, n, device=DEVICE, dtype=dtype),
                                    config, False, prologue, *args) for config in (plain, ahead)]
        assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("gated", [False, True])
def test_pdl_launches_give_the_same_bits_in_a_cuda_graph(gated: bool):
    """On a GPU that supports programmatic dependent launch, a chain of the three kernels (each waiting on
    the one before) gives bit-identical results with and without it, eagerly and replayed from a graph;
    gated: the SiLU-mul as gate/up's epilogue (kernels/gemv_folds.py), down_proj plain."""
    from nanovllm.kernels.common import supports_pdl

    if DEVICE != "cuda" or not supports_pdl(torch.device(DEVICE)):
        assert not supports_pdl(torch.device("cpu"))
        pytest.skip("programmatic dependent launch needs an sm_90+ GPU")
    k, inner, dtype = 1024, 3072, torch.bfloat16
    gen = torch.Generator().manual_seed(6)
    x, residual = (torch.randn(1, k, generator=gen).to(DEVICE, dtype) for _ in range(2))
    norm_weight = (1 + torch.rand(k, generator=gen)).to(DEVICE, dtype)
    gate_up_w = (torch.randn(2 * inner, k, generator=gen) / k**0.5).to(DEVICE, dtype)
    down_w = (torch.randn(k, inner, generator=gen) / inner**0.5).to(DEVICE, dtype)
    o_w = (torch.randn(k, k, generator=gen) / k**0.5).to(DEVICE, dtype)

    def chain(pdl: bool):
        h = x
        for _ in range(3):
            gate_up, summed = skinny_norm_linear(h, norm_weight, 1e-6, gate_up_w, None, residual, pdl, gated)
            fold = skinny_linear if gated else skinny_silu_linear  # SiLU-mul after gate/up, or before down
            h = skinny_linear(fold(gate_up, down_w, pdl=pdl), o_w, pdl=pdl)
        return h, summed

    expected = chain(False)
    assert all(torch.equal(a, b) for a, b in zip(chain(True), expected))
    graph = torch.cuda.CUDAGraph()
    chain(True)  # compiled outside the capture
    with torch.cuda.graph(graph):
        captured = chain(True)
    for _ in range(2):
        graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(captured, expected))


def test_prologues_reject_bad_arguments():
    x, weight, _ = make_inputs(1, 64, 32, torch.float32)
    with pytest.raises(ValueError, match="one contiguous row of 32"):
        skinny_norm_linear(torch.zeros(2, 32, device=DEVICE), torch.ones(32, device=DEVICE), 1e-6, weight)
    with pytest.raises(ValueError, match="residual must be one contiguous row"):
        skinny_norm_linear(x, torch.ones(32, device=DEVICE), 1e-6, weight, residual=x[:, :16])
    with pytest.raises(ValueError, match="norm_weight"):
        skinny_norm_linear(x, torch.ones(16, device=DEVICE), 1e-6, weight)
    with pytest.raises(ValueError, match="one contiguous row of 64"):
        skinny_silu_linear(x, weight)  # [gate | up] is twice K wide


def test_layers_fold_the_norm_and_activation_into_one_row_on_gpu():
    """On a GPU, the linear layers' one-row paths (a ColumnParallelLinear handed its norm, a
    RowParallelLinear its SiLU-mul) give what the norm or SiLU-mul then the layer give, and two
    rows take the plain path."""
    if DEVICE != "cuda":
        pytest.skip("the layers fold only CUDA rows into the skinny kernel")
    from nanovllm.layers.linear import ColumnParallelLinear, RowParallelLinear
    from nanovllm.layers.linear_methods import SkinnyLinearMethod
    from nanovllm.layers.norm_act import RMSNorm, SiluAndMul

    torch.manual_seed(0)
    method = SkinnyLinearMethod()
    with torch.device(DEVICE):
        up = ColumnParallelLinear(128, 512, quant_method=method).half()
        down = RowParallelLinear(256, 128, quant_method=method).half()
        norm = RMSNorm(128).half()
    for layer in (up, down, norm):
        for p in layer.parameters():
            p.data.normal_(std=0.1)
    for rows in (1, 2):
        x, residual = torch.randn(2, rows, 128, device=DEVICE, dtype=torch.float16).unbind(0)
        out, summed = up(x, norm=norm, residual=residual)
        normed, expected_sum = norm(x, residual)
        assert torch.equal(summed, expected_sum)
        torch.testing.assert_close(out, up(normed), atol=2e-2, rtol=2e-2)
        gate_up = torch.randn(rows, 512, device=DEVICE, dtype=torch.float16)
        torch.testing.assert_close(down(gate_up, act=SiluAndMul()), down(SiluAndMul()(gate_up)),
                                   atol=2e-3, rtol=2e-3)
