"""The linear layers' few-token kernels (layers/linear_methods.py, SkinnyLinearMethod): at 1 to 16 rows a
ColumnParallelLinear handed its RMSNorm folds it into the kernel (the one-row GEMV or the rows kernel) and
gives what the norm then the layer give; plain matmuls take them too, at two rows the GEMV for a few
rows, which RowParallelLinear's SiLU-mul also folds into; more rows take cuBLAS and the norm kernel.
On the CPU the kernels run in Triton's interpreter (in float16); on CUDA with TRITON_INTERPRET=0."""

import pytest
import torch
from conftest import triton_test_device

pytest.importorskip("triton")

from nanovllm.kernels import gemv_folds, gemv_rows, skinny_gemm, skinny_rows  # noqa: E402
from nanovllm.layers.embed_head import ParallelLMHead  # noqa: E402
from nanovllm.layers.linear import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from nanovllm.layers.linear_methods import (  # noqa: E402
    Bucket,
    SkinnyLinearMethod,
    SkinnyLMHeadMethod,
    mma_rows,
    mma_rows_norm,
    torch_linear,
)
from nanovllm.layers.norm_act import RMSNorm, SiluAndMul  # noqa: E402

DEVICE = triton_test_device()


@pytest.fixture
def kernel_calls(monkeypatch) -> list[str]:
    """The few-token kernels the layers call, by name, in order."""
    calls = []

    def spying(module, name: str):
        fn = getattr(module, name)

        def spy(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)
        return spy

    for module, name in ((skinny_gemm, "skinny_linear"), (gemv_folds, "skinny_norm_linear"),
                         (gemv_folds, "skinny_silu_linear"), (skinny_rows, "rows_linear"),
                         (skinny_rows, "rows_norm_linear"), (gemv_rows, "gemv_rows_linear"),
                         (gemv_rows, "gemv_rows_silu_linear")):
        monkeypatch.setattr(module, name, spying(module, name))
    return calls


def make_layers(method: SkinnyLinearMethod | None = None
                ) -> tuple[ColumnParallelLinear, RowParallelLinear, RMSNorm]:
    torch.manual_seed(0)
    method = method if method is not None else SkinnyLinearMethod()
    with torch.device(DEVICE):
        up = ColumnParallelLinear(128, 512, quant_method=method)
        down, norm = RowParallelLinear(256, 128, quant_method=method), RMSNorm(128)
    for layer in (up, down, norm):
        layer.half()
        for p in layer.parameters():
            p.data.normal_(std=0.1)
    return up, down, norm


def run_layers(up, down, norm, rows: int) -> None:
    """Each layer's few-token call against the norm or SiLU-mul, then the plain matmul."""
    x, residual = torch.randn(2, rows, 128, device=DEVICE, dtype=torch.float16).unbind(0)
    out, summed = up(x, norm=norm, residual=residual)
    normed, expected_sum = norm(x, residual)
    assert torch.equal(summed, expected_sum)
    torch.testing.assert_close(out, torch.nn.functional.linear(normed, up.weight), atol=2e-2, rtol=2e-2)
    gate_up = torch.randn(rows, 512, device=DEVICE, dtype=torch.float16)
    act = SiluAndMul()(gate_up)
    torch.testing.assert_close(down(gate_up, act=SiluAndMul()),
                               torch.nn.functional.linear(act, down.weight), atol=2e-3, rtol=2e-3)


def test_one_row_folds_the_norm_and_the_activation_into_the_gemv(kernel_calls):
    run_layers(*make_layers(), 1)
    assert kernel_calls == ["skinny_norm_linear", "skinny_silu_linear"]


def test_two_rows_take_the_few_row_gemv_for_plain_and_silu_folded_matmuls(kernel_calls):
    run_layers(*make_layers(), 2)
    # up: the RMSNorm folded into the rows kernel; down: the SiLU-mul folded into the few-row GEMV
    assert kernel_calls == ["rows_norm_linear", "gemv_rows_silu_linear"]
    kernel_calls.clear()
    x = torch.randn(2, 128, device=DEVICE, dtype=torch.float16)
    up = make_layers()[0]
    torch.testing.assert_close(up(x), torch.nn.functional.linear(x, up.weight), atol=2e-2, rtol=2e-2)
    assert kernel_calls == ["gemv_rows_linear"]


class RowsKernelAtTwoRows(SkinnyLinearMethod):
    """The few-row GEMV off: two rows take the rows kernel."""

    BUCKETS = (SkinnyLinearMethod.BUCKETS[0], Bucket(16, mma_rows, mma_rows_norm), Bucket(None, torch_linear))


class OneRowOnly(SkinnyLinearMethod):
    BUCKETS = (SkinnyLinearMethod.BUCKETS[0], Bucket(None, torch_linear))


@pytest.mark.parametrize("rows", [3, 16])
def test_more_rows_fold_the_norm_into_the_rows_kernel(kernel_calls, rows: int):
    run_layers(*make_layers(), rows)
    # down: the SiLU-mul kernel, then the rows kernel's plain matmul
    assert kernel_calls == ["rows_norm_linear", "rows_linear"]
    kernel_calls.clear()
    run_layers(*make_layers(RowsKernelAtTwoRows()), 2)
    assert kernel_calls == ["rows_norm_linear", "rows_linear"]


def test_more_rows_or_the_switch_take_the_plain_path(kernel_calls):
    layers = make_layers()
    run_layers(*layers, 17)
    assert kernel_calls == []
    run_layers(*make_layers(OneRowOnly()), 2)
    assert kernel_calls == []


def test_the_lm_head_takes_the_gemv_at_one_row_and_cublas_from_two(kernel_calls):
    with torch.device(DEVICE):
        head = ParallelLMHead(300, 64, quant_method=SkinnyLMHeadMethod())
    head.half()
    head.weight.data.normal_(std=0.1)
    for rows in (1, 3):
        hidden = torch.randn(rows, 64, device=DEVICE, dtype=torch.float16)
        expected = torch.nn.functional.linear(hidden, head.weight)
        torch.testing.assert_close(head.compute_logits(hidden), expected, atol=2e-3, rtol=2e-3)
    assert kernel_calls == ["skinny_linear"]


def test_the_bucket_table_decides_each_row_count():
    method = SkinnyLinearMethod()
    kernels = [method.bucket(rows).plain.__name__ for rows in (0, 1, 2, 3, 16, 17, 4096)]
    assert kernels == ["torch_linear", "gemv", "gemv_rows", "mma_rows", "mma_rows", "torch_linear",
                       "torch_linear"]
    assert [method.bucket(rows).silu is not None for rows in (1, 2, 3)] == [True, True, False]
