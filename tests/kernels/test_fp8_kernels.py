"""The fp8 linear kernels against layers/fp8.py's references, on CPU tensors through the Triton interpreter
(or on CUDA when TRITON_INTERPRET=0): the activation quantizer bit for bit, the W8A8 GEMM
(kernels/fp8_gemm.py) against the dequantizing reference and the W8A16 GEMV (kernels/fp8_gemv.py) against
the unrounded one, at 128x128 blocks and per channel, partial blocks, 1-64 rows and a bias; and the fp8
methods' buckets on a layer."""

import pytest
import torch
from conftest import triton_test_device

pytest.importorskip("triton")

from nanovllm.kernels.fp8_gemm import GemmConfig, quantize_rows, w8a8_linear  # noqa: E402
from nanovllm.kernels.fp8_gemv import MAX_ROWS, fp8_gemv_linear, gemv_block_n  # noqa: E402
from nanovllm.kernels.fp8_scaled_mm import scaled_mm_linear  # noqa: E402
from nanovllm.layers.fp8 import fp8_dequant_linear, fp8_weight_only_linear, quantize_groups  # noqa: E402
from nanovllm.layers.fp8_methods import Fp8ScaledMmLinearMethod, Fp8TritonLinearMethod  # noqa: E402
from nanovllm.layers.linear import ReplicatedLinear  # noqa: E402
from nanovllm.utils.config_checks import Fp8Scheme  # noqa: E402

DEVICE = triton_test_device()
# float32: the kernels and the references round alike (the same e4m3 values, exact products of them), only
# the order of the float32 sums differs, on outputs of magnitude ~1. 16-bit: the references multiply the
# dequantized weight rounded to the model's dtype, the kernels the exact one in float32.
TOLERANCES = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
# The GEMM on a GPU: its fp8 tensor cores keep ~14 bits while they sum a K tile's 128 products (sm_90;
# kernels/fp8_gemm.py), so against the exact float32 reference it is off by up to ~1.5e-2 on O(1) outputs.
GEMM_TOLERANCE = {"cuda": 3e-2, "cpu": 1e-4}[DEVICE]
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])
# (N, K, group): 128x128 blocks with partial blocks along N and K; per channel (group = K) with a K that is
# no multiple of the 128 K tile; two whole blocks; groups of 64 (a checkpoint's 64-wide
# blocks: the GEMM's K tile narrowed to them).
LAYOUTS = [(200, 300, 128), (96, 200, 200), (128, 256, 128), (64, 384, 64)]


def make(m: int, n: int, k: int, group: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    # x scaled so that outputs are O(1); its rows' magnitudes spread so that the per-token scales differ.
    x = torch.randn(m, k, generator=gen) / k**0.5 * torch.logspace(-1, 1, m)[:, None]
    weight, scale = quantize_groups(torch.randn(n, k, generator=gen), group)
    bias = torch.randn(n, generator=gen)
    return x.to(DEVICE, dtype), weight.to(DEVICE), scale.to(DEVICE), bias.to(DEVICE, dtype)


@pytest.mark.parametrize("group", [128, 300])
def test_quantize_rows_is_the_reference_bit_for_bit(group):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 300, generator=gen) * torch.logspace(-6, 3, 300)  # e4m3 subnormals included
    x[2] = 0.0  # an all-zero row: the MIN_AMAX floor
    x[3, :4] = torch.tensor([127.0, -126.5, 0.0625, 1e-9]) * 1e-3
    x = x.to(DEVICE)
    q, scale = quantize_rows(x, group)
    ref_q, ref_scale = quantize_groups(x, group)
    assert torch.equal(scale, ref_scale)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))


def test_quantize_rows_rounds_every_bfloat16_value_as_dividing_does():
    """Every bfloat16 value of magnitude up to 1 (both zeros among them), a row each of largest magnitudes
    spread over [1, 2): bit for bit the reference's x / scale rounded to e4m3. On the GPU the kernel
    multiplies by 1 / scale and corrects the product instead of dividing; more rows (scales) there."""
    bits = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    values = bits[bits.float().abs() <= 1.0]
    rows = 512 if DEVICE == "cuda" else 3
    anchors = 1.0 + torch.rand(rows, generator=torch.Generator().manual_seed(5))
    x = torch.cat([values.expand(rows, -1), anchors.to(torch.bfloat16)[:, None]], dim=1).to(DEVICE)
    q, scale = quantize_rows(x, x.shape[1])
    ref_q, ref_scale = quantize_groups(x, x.shape[1])
    assert torch.equal(scale, ref_scale)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, k, group", LAYOUTS)
@pytest.mark.parametrize("m", [1, 3, 17, 64])
def test_w8a8_gemm_matches_the_dequantizing_reference(m, n, k, group, dtype):
    x, weight, scale, bias = make(m, n, k, group, dtype)
    out = w8a8_linear(x, weight, scale, group, bias if m % 2 else None)
    expected = fp8_dequant_linear(x.float(), weight, scale, group, bias.float() if m % 2 else None)
    assert out.dtype == dtype and out.shape == (m, n)
    tol = max(TOLERANCES[dtype], GEMM_TOLERANCE)
    torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("n, k, group", [(200, 300, 128), (96, 640, 640)], ids=["blocks", "per-channel"])
@pytest.mark.parametrize("split_k", [2, 3])
def test_w8a8_gemm_split_over_k_sums_what_one_program_sums(n, k, group, split_k):
    """Split K (each split's partials scaled, summed in order by the reduce, the bias added once) against
    the dequantizing reference and against the unsplit launch; 3 splits of 3 or 5 K tiles leave a ragged
    last split."""
    x, weight, scale, bias = make(5, n, k, group, torch.float32)
    split = w8a8_linear(x, weight, scale, group, bias, GemmConfig(16, 32, 4, 2, split_k=split_k))
    whole = w8a8_linear(x, weight, scale, group, bias, GemmConfig(16, 32, 4, 2))
    torch.testing.assert_close(split, fp8_dequant_linear(x, weight, scale, group, bias), rtol=GEMM_TOLERANCE,
                               atol=GEMM_TOLERANCE)
    torch.testing.assert_close(split, whole, rtol=1e-5, atol=1e-5)


def test_w8a8_gemm_takes_a_strided_x():
    x, weight, scale, bias = make(5, 96, 256, 128, torch.float32)
    wide = torch.cat([x, x], dim=1)[:, 256:]  # rows 512 apart
    torch.testing.assert_close(w8a8_linear(wide, weight, scale, 128, bias),
                               fp8_dequant_linear(x, weight, scale, 128, bias), rtol=GEMM_TOLERANCE,
                               atol=GEMM_TOLERANCE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, k, group", LAYOUTS)
@pytest.mark.parametrize("m", [1, 3, 16])
def test_gemv_matches_the_dequantized_weight_on_unrounded_activations(m, n, k, group, dtype):
    x, weight, scale, bias = make(m, n, k, group, dtype)
    out = fp8_gemv_linear(x, weight, scale, group, bias if m % 2 else None)
    expected = fp8_weight_only_linear(x.float(), weight, scale, group, bias.float() if m % 2 else None)
    assert out.dtype == dtype and out.shape == (m, n)
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol)
    # and it is not the W8A8 rounding: the test can tell the two apart (where its tolerance is fine enough:
    # in bf16 one row of small activations rounds to within 10 tolerances)
    if dtype == torch.float32:
        rounded = fp8_dequant_linear(x.float(), weight, scale, group, bias.float() if m % 2 else None)
        assert (rounded - expected).abs().max() > 10 * tol


@pytest.mark.parametrize("n, group, block_n", [(6144, 256, 64), (4096, 128, 32)])
def test_the_gemv_takes_wide_column_blocks_where_the_sweep_found_them_faster(n, group, block_n):
    """Qwen3-8B's q/k/v (N = 6144) and o / down (N = 4096) widths launch 64- and 32-column blocks
    (kernels/fp8_gemv.py's sweep); the wide tiles compute what the narrow ones do."""
    assert gemv_block_n(n, 132) == block_n
    x, weight, scale, bias = make(3, n, 256, group, torch.float32)
    expected = fp8_weight_only_linear(x.float(), weight, scale, group, bias.float())
    torch.testing.assert_close(fp8_gemv_linear(x, weight, scale, group, bias), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 17, 64])
def test_scaled_mm_matches_the_dequantizing_reference_per_channel(m, dtype):
    """torch._scaled_mm with row-wise scales (one a weight row, one a token): the W8A8 GEMM's one-group
    rounding; K 208 and N 96 are multiples of 16 as it needs."""
    x, weight, scale, bias = make(m, 96, 208, 208, dtype)
    out = scaled_mm_linear(x, weight, scale, 208, bias)
    expected = fp8_dequant_linear(x.float(), weight, scale, 208, bias.float())
    assert out.dtype == dtype and out.shape == (m, 96)
    tol = max(TOLERANCES[dtype], GEMM_TOLERANCE)
    torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol)


def test_scaled_mm_leaves_what_row_wise_scaling_cannot_take_to_the_triton_gemm(monkeypatch):
    def refused(*args, **kwargs):
        raise AssertionError("torch._scaled_mm was called")

    monkeypatch.setattr(torch, "_scaled_mm", refused)
    x, weight, scale, bias = make(5, 200, 300, 300, torch.float32)  # N, K not multiples of 16
    torch.testing.assert_close(scaled_mm_linear(x, weight, scale, 300, bias),
                               w8a8_linear(x, weight, scale, 300, bias))
    x, weight, scale, _ = make(5, 96, 256, 128, torch.float32)  # two scale groups a row
    torch.testing.assert_close(scaled_mm_linear(x, weight, scale, 128),
                               w8a8_linear(x, weight, scale, 128, None))
    x, weight, scale, _ = make(5, 96, 256, 256, torch.bfloat16)  # and one it takes (bf16 out, as on a GPU)
    with pytest.raises(AssertionError, match="was called"):
        scaled_mm_linear(x, weight, scale, 256)


def test_the_kernels_refuse_what_they_cannot_tile():
    x, weight, scale, _ = make(MAX_ROWS + 1, 64, 384, 192, torch.float32)
    with pytest.raises(ValueError, match="at most 16 rows"):
        fp8_gemv_linear(x, weight, scale, 192)
    from nanovllm.layers import fp8_methods
    assert fp8_methods.FP8_GEMV_MAX_ROWS == MAX_ROWS  # the methods' copy (they import no Triton)
    with pytest.raises(ValueError, match=r"weight_scale \(64, 2\)"):
        w8a8_linear(x, weight, scale[:, :2], 128)
    x, weight, scale, _ = make(MAX_ROWS + 1, 64, 384, 48, torch.float32)
    with pytest.raises(ValueError, match="scale groups of 48 inputs do not tile by 32"):
        w8a8_linear(x, weight, scale, 48)


def test_groups_no_fp8_dot_tiles_take_the_reference_in_the_engines_gemm():
    """16-wide blocks (no e4m3 dot is that narrow on sm_90): the linear methods' GEMM entry computes them
    with the dequantizing reference, the W8A8 GEMM's rounding, rather than failing at the first forward."""
    from nanovllm.layers.fp8_methods import fp8_gemm

    x, weight, scale, bias = make(MAX_ROWS + 1, 64, 96, 16, torch.float32)
    torch.testing.assert_close(fp8_gemm(x, weight, scale, 16, bias),
                               fp8_dequant_linear(x, weight, scale, 16, bias), rtol=0, atol=0)


def test_the_triton_method_takes_the_gemv_to_16_rows_then_the_gemm():
    method = Fp8TritonLinearMethod(Fp8Scheme((128, 128), True))
    layer = ReplicatedLinear(300, 200, bias=True, quant_method=method)
    _, weight, scale, bias = make(1, 200, 300, 128, torch.float32)
    layer.weight = torch.nn.Parameter(weight.cpu(), requires_grad=False)
    layer.weight_scale = torch.nn.Parameter(scale.cpu(), requires_grad=False)
    layer.bias.data.copy_(bias.cpu())
    layer.to(DEVICE)
    assert [method.bucket(r).plain.__name__ for r in (1, 16, 17)] == ["fp8_gemv", "fp8_gemv", "fp8_gemm"]
    for rows, reference, tol in ((1, fp8_weight_only_linear, 1e-4), (16, fp8_weight_only_linear, 1e-4),
                                 (17, fp8_dequant_linear, GEMM_TOLERANCE)):
        x = make(rows, 200, 300, 128, torch.float32, seed=rows)[0]
        torch.testing.assert_close(layer(x), reference(x, layer.weight, layer.weight_scale, 128, layer.bias),
                                   rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_the_per_channel_method_takes_one_row_then_two_then_the_rows_kernel_to_16(dtype, monkeypatch):
    """Fp8ScaledMmLinearMethod (one scale a row, sm_90): one row through kernels/fp8_skinny's GEMV, two
    through its few-row GEMV, each giving the W8A16 reference's result; 3-16 through its rows kernel over
    e4m3 rows, giving the W8A8 reference's (float32 rows through fp8_gemv, W8A16: the rows kernel's dot
    would be TF32)."""
    from nanovllm.kernels import fp8_gemv, fp8_skinny

    method = Fp8ScaledMmLinearMethod(Fp8Scheme(None, True))
    layer = ReplicatedLinear(300, 200, bias=True, quant_method=method)
    _, weight, scale, bias = make(1, 200, 300, 300, torch.float32)
    for name, value in (("weight", weight), ("weight_scale", scale), ("bias", bias.to(dtype))):
        setattr(layer, name, torch.nn.Parameter(value.to(DEVICE), requires_grad=False))
    called = []
    for module, name in ((fp8_skinny, "fp8_skinny_linear"), (fp8_skinny, "fp8_gemv_rows_linear"),
                         (fp8_skinny, "fp8_rows_linear"), (fp8_gemv, "fp8_gemv_linear")):
        kernel = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, kernel=kernel, name=name, **kw:
                            called.append(name) or kernel(*a, **kw))
    tol = 1e-4 if dtype == torch.float32 else 2e-3
    for rows in (1, 2, 3, 16):
        x = make(rows, 200, 300, 300, torch.float32, seed=rows)[0].to(dtype) * 4
        w8a8 = rows > 2 and dtype != torch.float32
        reference = fp8_dequant_linear if w8a8 else fp8_weight_only_linear
        expected = reference(x.float(), weight, scale, 300, layer.bias.float())
        torch.testing.assert_close(layer(x).float(), expected, rtol=tol, atol=tol)
    few = "fp8_gemv_linear" if dtype == torch.float32 else "fp8_rows_linear"
    assert called == ["fp8_skinny_linear", "fp8_gemv_rows_linear", few, few]


def test_the_w8a8_rows_bucket_takes_the_rows_kernel_to_its_last_row_then_scaled_mm(monkeypatch):
    """Past 16 rows, to fp8_methods.W8A8_ROWS_MAX, rows run the rows kernel over e4m3 rows, x padded to a
    power of two, and give the W8A8 reference's result; one row more goes to torch._scaled_mm, as do float32
    rows past 16 in that bucket."""
    from nanovllm.kernels import fp8_scaled_mm, fp8_skinny
    from nanovllm.layers.fp8_methods import W8A8_ROWS_MAX

    assert W8A8_ROWS_MAX > 16  # the bucket reaches past the float16 rows' 16
    last = W8A8_ROWS_MAX
    method = Fp8ScaledMmLinearMethod(Fp8Scheme(None, True))
    kernels = [method.bucket(rows).plain.__name__ for rows in (16, 17, last, last + 1)]
    assert kernels == ["fp8_rows_e4m3"] * 3 + ["fp8_scaled_mm"]
    layer = ReplicatedLinear(256, 96, bias=True, quant_method=method)
    _, weight, scale, bias = make(1, 96, 256, 256, torch.float32)
    for name, value in (("weight", weight), ("weight_scale", scale), ("bias", bias.to(torch.float16))):
        setattr(layer, name, torch.nn.Parameter(value.to(DEVICE), requires_grad=False))
    called = []
    for module, name in ((fp8_skinny, "fp8_rows_linear"), (fp8_scaled_mm, "scaled_mm_linear")):
        kernel = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, kernel=kernel, name=name, **kw:
                            called.append(name) or kernel(*a, **kw))
    for rows in (17, last, last + 1):
        x = make(rows, 96, 256, 256, torch.float32, seed=rows)[0].to(torch.float16) * 4
        expected = fp8_dequant_linear(x.float(), weight, scale, 256, layer.bias.float())
        tol = 2e-3 if DEVICE == "cpu" else GEMM_TOLERANCE  # the GPU's fp8 dots sum with fewer bits
        torch.testing.assert_close(layer(x).float(), expected, rtol=tol, atol=tol)
    layer(make(24, 96, 256, 256, torch.float32)[0])
    assert called == ["fp8_rows_linear", "fp8_rows_linear", "scaled_mm_linear", "scaled_mm_linear"]


def test_one_row_runs_the_norm_and_the_silu_mul_first_then_the_fp8_gemv_all_as_dependents(monkeypatch):
    """A one-row call handed its RMSNorm (q/k/v, gate/up) or its SiLU-mul (down) runs that kernel, then the
    one-row fp8 GEMV (kernels/fp8_skinny.py: folded in, they cost more than their own kernels), every
    launch a programmatic dependent where the method's are, and gives what the norm or SiLU-mul then the
    layer give. (The interpreter runs no PDL: the spies record the flag and launch plainly.)"""
    from nanovllm.kernels import fp8_skinny, norm_act
    from nanovllm.layers.norm_act import RMSNorm, silu_and_mul

    method = Fp8ScaledMmLinearMethod(Fp8Scheme(None, True), pdl=True)  # one scale a row
    assert method.bucket(1).plain.__name__ == "fp8_skinny"
    assert method.bucket(1).normed.__name__ == "fp8_skinny_norm"
    assert method.bucket(1).silu.__name__ == "fp8_skinny_silu"
    layer = ReplicatedLinear(256, 200, bias=False, quant_method=method)
    _, weight, scale, _ = make(1, 200, 256, 256, torch.float32)
    layer.weight = torch.nn.Parameter(weight.cpu(), requires_grad=False)
    layer.weight_scale = torch.nn.Parameter(scale.cpu(), requires_grad=False)
    norm = RMSNorm(256)
    norm.weight.data.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(2))
    layer.to(DEVICE), norm.to(DEVICE)
    x, residual = (make(1, 8, 256, 128, torch.float32, seed=s)[0] for s in (3, 4))
    normed, expected_sum = norm_act.add_rms_norm(x, residual, norm.weight, norm.eps)
    gate_up = make(1, 8, 512, 128, torch.float32, seed=5)[0]
    expected_down = fp8_weight_only_linear(silu_and_mul(gate_up), layer.weight, layer.weight_scale, 256, None)
    called = []
    for module, name, label in ((norm_act, "add_rms_norm", "norm"), (norm_act, "silu_and_mul", "silu"),
                                (fp8_skinny, "fp8_skinny_linear", "gemv")):
        kernel = getattr(module, name)

        def spy(*args, kernel=kernel, label=label):
            called.append((label, args[-1]))
            return kernel(*args[:-1], False)

        monkeypatch.setattr(module, name, spy)
    out, summed = method.apply_normed(layer, x, norm, residual)
    torch.testing.assert_close(summed, expected_sum)
    expected = fp8_weight_only_linear(normed, layer.weight, layer.weight_scale, 256, None)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    down = ReplicatedLinear(256, 200, bias=False, quant_method=method)
    down.weight, down.weight_scale = layer.weight, layer.weight_scale
    torch.testing.assert_close(method.apply_silu(down, gate_up, None), expected_down, rtol=1e-4, atol=1e-4)
    assert called == [("norm", True), ("gemv", True), ("silu", True), ("gemv", True)]


@pytest.mark.parametrize("m", [17, 61, 256])
def test_torchs_block_scaled_gemm_matches_the_dequantizing_reference(m):
    """kernels/fp8_scaled_mm.block_scaled_mm_linear (torch's block-scaled GEMM, cuBLASLt on sm_90; a GPU only)
    against the reference with the same rounding, bf16, rows not a multiple of 4 included."""
    if DEVICE != "cuda" or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("torch's block-scaled GEMM runs on sm_90 GPUs")
    from nanovllm.kernels.fp8_scaled_mm import block_scaled_mm_linear
    from nanovllm.layers.fp8 import block_scales
    from nanovllm.layers.fp8_methods import block_scaled_mm_available

    if not block_scaled_mm_available():
        pytest.skip("this torch has no block-scaled scaled_mm")
    x, weight, scale, bias = make(m, 256, 384, 128, torch.bfloat16, seed=m)
    per_row = scale[::128].repeat_interleave(128, dim=0)  # one scale a 128 x 128 block, in the layout
    out = block_scaled_mm_linear(x, weight, block_scales(per_row, weight, (128, 128)), bias)
    expected = fp8_dequant_linear(x.float(), weight, per_row, 128, bias.float())
    torch.testing.assert_close(out.float(), expected, rtol=GEMM_TOLERANCE, atol=GEMM_TOLERANCE)
