"""runner/warm_up.py's pass over each linear method's folded kernels: every bucket with a norm or a SiLU-mul
folded in, the unbounded last one included, is called once at its first row count (with and without the
residual for the norm), so that no decode or eager step builds a kernel variant mid-run."""

import torch

from nanovllm.layers.linear import ColumnParallelLinear, RowParallelLinear
from nanovllm.layers.linear_methods import Bucket, UnquantizedLinearMethod
from nanovllm.runner import warm_up

CALLS = []


def plain(x, weight, bias, pdl):
    return x @ weight.t()


def normed(x, norm_weight, eps, weight, bias, residual, pdl):
    CALLS.append(("normed", x.shape[0], residual is not None))
    return x @ weight.t(), x


def silu(x, weight, bias, pdl):
    CALLS.append(("silu", x.shape[0]))
    return x[:, : x.shape[1] // 2] @ weight.t()


class FoldingMethod(UnquantizedLinearMethod):
    """Folds at 1 row, none at 2-4, folds again from 5 rows (as per-channel fp8's table does from 17)."""

    BUCKETS = (Bucket(1, plain, normed, silu), Bucket(4, plain), Bucket(None, plain, normed, silu))


def test_every_folding_bucket_is_warmed_at_its_first_row_count():
    CALLS.clear()
    column = ColumnParallelLinear(8, 6, quant_method=FoldingMethod())
    row = RowParallelLinear(8, 6, quant_method=FoldingMethod())
    for layer in (column, row):
        layer.weight.data = torch.randn(6, 8)
        warm_up._fused_variants(layer, torch.float32)
    assert CALLS == [("normed", 1, False), ("normed", 1, True), ("normed", 5, False), ("normed", 5, True),
                     ("silu", 1), ("silu", 5)]
